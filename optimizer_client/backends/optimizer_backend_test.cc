// The trainer's optimizer backends with parameter groups (PyTorch's param_groups): the in-process
// optimizer and shards behind every data plane compute the same bits for a job whose groups cut
// through tiles and across the shard boundary, with per-group lrs on every commit; one group
// equal to `adam` is a job without groups; and a bad group or group lr is refused through both.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/dtype.h"
#include "base/thread_pool.h"
#include "cpu_optimizer_server/grpc/optimizer_service.h"
#include "cpu_optimizer_server/shard/shard_store.h"
#include "model_spec/partition.h"
#include "optimizer_client/backends/inprocess_optimizer.h"
#include "optimizer_client/backends/local_shards_test_util.h"
#include "optimizer_client/backends/remote_optimizer.h"

namespace offload {
namespace {

constexpr int64_t kParams = 200003;
constexpr char kJob[] = "groups-job";

v1::AdamConfig Adam(v1::OptimizerKind kind, float beta1, float beta2, float eps, float wd) {
  v1::AdamConfig a;
  a.set_kind(kind);
  a.set_lr(1e-3f);
  a.set_beta1(beta1);
  a.set_beta2(beta2);
  a.set_eps(eps);
  a.set_weight_decay(wd);
  return a;
}

v1::ParamGroup Group(uint64_t offset, uint64_t length, const v1::AdamConfig& adam) {
  v1::ParamGroup g;
  g.set_offset(offset);
  g.set_length(length);
  *g.mutable_adam() = adam;
  return g;
}

class OptimizerBackendTest : public ::testing::Test {
 protected:
  OptimizerBackendTest() {
    absl::StatusOr<v1::PartitionMap> map = MakePartitionMap(kParams, 1, 2);
    EXPECT_TRUE(map.ok()) << map.status();
    map_ = *map;
    padded_ = static_cast<int64_t>(map_.padded_length());
    // Group 0 ends inside a tile of shard 0's slice; group 1 runs across the shard boundary;
    // group 2 takes the rest: AdamW with decay, Adam without, AdamW with other betas.
    groups_ = {Group(0, 70001, Adam(v1::OPTIMIZER_KIND_ADAMW, 0.9f, 0.999f, 1e-8f, 0.1f)),
               Group(70001, 80000, Adam(v1::OPTIMIZER_KIND_ADAM, 0.8f, 0.99f, 1e-6f, 0.0f)),
               Group(150001, padded_ - 150001,
                     Adam(v1::OPTIMIZER_KIND_ADAMW, 0.95f, 0.98f, 1e-7f, 0.01f))};
    std::mt19937 rng(7);
    std::normal_distribution<float> d(0.0f, 1.0f);
    master_.resize(padded_);
    for (float& x : master_) x = d(rng);
    for (int s = 0; s < 3; ++s) {
      grads_.emplace_back(padded_);
      for (uint16_t& g : grads_.back()) g = FloatToBf16(0.1f * d(rng));
    }
  }

  std::unique_ptr<RemoteOptimizer> Remote(const LocalShards& shards, TransportChoice plane) {
    auto remote = RemoteOptimizer::Connect(map_, shards.addresses(), ClientOptions{}, plane);
    EXPECT_TRUE(remote.ok()) << remote.status();
    return remote.ok() ? std::move(*remote) : nullptr;
  }

  struct Run {
    std::vector<std::vector<uint16_t>> weights16;  // after each step
    std::vector<float> master;
  };
  // Three steps of the job with `groups`, committing group_lr(step) with each.
  Run Train(OptimizerBackend* backend, const std::vector<v1::ParamGroup>& groups,
            bool use_group_lr) {
    Run run;
    EXPECT_TRUE(backend->CreateJob(kJob, groups_[0].adam(), DType::kBf16, groups).ok());
    EXPECT_TRUE(backend->LoadMasterWeights(master_.data()).ok());
    for (uint64_t step = 1; step <= 3; ++step) {
      const std::vector<double> lrs = {1e-3 / step, 5e-4, 2e-3 * step};
      run.weights16.emplace_back(padded_, 0);
      EXPECT_TRUE(backend->BeginStep(step).ok());
      EXPECT_TRUE(backend->SendGradients(0, grads_[step - 1].data(), padded_).ok());
      absl::StatusOr<StepCounters> counters = backend->Commit(
          lrs[0], 0.5f, false, run.weights16.back().data(),
          use_group_lr ? absl::Span<const double>(lrs) : absl::Span<const double>());
      EXPECT_TRUE(counters.ok()) << counters.status();
      if (counters.ok()) {
        EXPECT_EQ(counters->adam_step, step);
      }
    }
    run.master.resize(padded_);
    EXPECT_TRUE(backend->ReadMasterWeights(run.master.data()).ok());
    EXPECT_TRUE(backend->DropJob().ok());
    return run;
  }

  static bool Same(const Run& a, const Run& b) {
    return a.weights16 == b.weights16 &&
           std::memcmp(a.master.data(), b.master.data(), a.master.size() * 4) == 0;
  }

  v1::PartitionMap map_;
  int64_t padded_ = 0;
  std::vector<v1::ParamGroup> groups_;
  std::vector<float> master_;
  std::vector<std::vector<uint16_t>> grads_;  // (padded,) bf16 per step
};

// Every data plane a RemoteOptimizer can take, by the name TransportNames() gives it.
std::vector<std::pair<std::string, TransportChoice>> RemotePlanes() {
  std::vector<std::pair<std::string, TransportChoice>> planes = {{"grpc", TransportChoice::kGrpc},
                                                                 {"shm", TransportChoice::kShm}};
#ifdef OFFLOAD_HAVE_UCX
  planes.push_back({"ucx", TransportChoice::kUcx});
#endif
  return planes;
}

TEST_F(OptimizerBackendTest, InProcessAndEveryPlaneGiveTheSameBitsWithGroups) {
  InProcessOptimizer in_process(map_, 2, BestSimdPath());
  const Run reference = Train(&in_process, groups_, true);
  LocalShards shards(2);
  const std::vector<std::pair<std::string, TransportChoice>> planes = RemotePlanes();
  for (const auto& [name, plane] : planes) {
    std::unique_ptr<RemoteOptimizer> remote = Remote(shards, plane);
    ASSERT_NE(remote, nullptr) << name;
    EXPECT_EQ(remote->TransportNames(), name);
    EXPECT_TRUE(Same(Train(remote.get(), groups_, true), reference)) << name;
  }
  // The groups did matter: group 0's config and lr everywhere is other bits.
  InProcessOptimizer one_group(map_, 2, BestSimdPath());
  EXPECT_FALSE(Same(Train(&one_group, {}, false), reference));
}

TEST_F(OptimizerBackendTest, OneGroupEqualToAdamIsNoGroups) {
  const std::vector<v1::ParamGroup> one = {Group(0, padded_, groups_[0].adam())};
  InProcessOptimizer plain(map_, 2, BestSimdPath());
  const Run reference = Train(&plain, {}, false);
  InProcessOptimizer grouped(map_, 2, BestSimdPath());
  EXPECT_TRUE(Same(Train(&grouped, one, false), reference));
  LocalShards shards(2);
  std::unique_ptr<RemoteOptimizer> remote = Remote(shards, TransportChoice::kGrpc);
  ASSERT_NE(remote, nullptr);
  EXPECT_TRUE(Same(Train(remote.get(), one, false), reference));
}

TEST_F(OptimizerBackendTest, BadGroupsAndGroupLrsAreRefusedThroughBoth) {
  LocalShards shards(2);
  InProcessOptimizer in_process(map_, 2, BestSimdPath());
  std::unique_ptr<RemoteOptimizer> remote = Remote(shards, TransportChoice::kGrpc);
  ASSERT_NE(remote, nullptr);
  for (OptimizerBackend* backend : std::vector<OptimizerBackend*>{&in_process, remote.get()}) {
    std::vector<v1::ParamGroup> gap = groups_;
    gap[2].set_offset(gap[2].offset() + 1);
    absl::Status s = backend->CreateJob(kJob, groups_[0].adam(), DType::kBf16, gap);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("groups[2]"), std::string::npos) << s;
    // Each shard checks the groups against its own ranges: the one without the gap took the job.
    backend->DropJob().IgnoreError();

    ASSERT_TRUE(backend->CreateJob(kJob, groups_[0].adam(), DType::kBf16, groups_).ok());
    ASSERT_TRUE(backend->LoadMasterWeights(master_.data()).ok());
    std::vector<uint16_t> weights16(padded_);
    for (const std::vector<double>& lrs :
         {std::vector<double>{1e-3, 1e-3}, std::vector<double>{1e-3, std::nan(""), 1e-3}}) {
      ASSERT_TRUE(backend->BeginStep(1).ok());
      ASSERT_TRUE(backend->SendGradients(0, grads_[0].data(), padded_).ok());
      absl::StatusOr<StepCounters> c = backend->Commit(1e-3f, 1.0f, false, weights16.data(), lrs);
      EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
      EXPECT_NE(c.status().message().find("group_lr"), std::string::npos) << c.status();
    }
    std::vector<float> after(padded_);
    ASSERT_TRUE(backend->ReadMasterWeights(after.data()).ok());
    EXPECT_EQ(std::memcmp(after.data(), master_.data(), padded_ * 4), 0);
    ASSERT_TRUE(backend->DropJob().ok());
  }
}

// Range steps in global offsets reach each slice's shard as its part: a skipped run and a run
// with its own t across the shard boundary give the same bits in process and on every plane,
// the skipped run keeps its master weights (and sends them rounded), and a bad list is refused
// by the backend before any shard sees it, ending the step unapplied.
TEST_F(OptimizerBackendTest, RangeStepsAcrossTheShardBoundary) {
  ASSERT_EQ(map_.slices_size(), 2);
  const int64_t boundary = static_cast<int64_t>(map_.slices(1).offset());
  // Per step: step 1 plain; step 2 skips a run across the boundary (and one at the very end);
  // step 3 gives a run across the boundary t 2 and one inside group 0 t 1.
  const std::vector<std::vector<RangeStep>> steps = {
      {},
      {{10, 100, 1}, {boundary - 700, 1400, 0}, {padded_ - 50, 50, 0}},
      {{33, 77, 1}, {boundary - 300, 600, 2}}};
  auto train = [&](OptimizerBackend* backend) {
    Run run;
    EXPECT_TRUE(backend->CreateJob(kJob, groups_[0].adam(), DType::kBf16, groups_).ok());
    EXPECT_TRUE(backend->LoadMasterWeights(master_.data()).ok());
    std::vector<float> before(padded_);
    for (uint64_t step = 1; step <= 3; ++step) {
      EXPECT_TRUE(backend->ReadMasterWeights(before.data()).ok());
      const std::vector<double> lrs = {1e-3 / step, 5e-4, 2e-3 * step};
      run.weights16.emplace_back(padded_, 0);
      EXPECT_TRUE(backend->BeginStep(step).ok());
      EXPECT_TRUE(backend->SendGradients(0, grads_[step - 1].data(), padded_).ok());
      absl::StatusOr<StepCounters> counters =
          backend->Commit(lrs[0], 0.5f, false, run.weights16.back().data(), lrs, steps[step - 1]);
      EXPECT_TRUE(counters.ok()) << counters.status();
      if (counters.ok()) {
        EXPECT_EQ(counters->adam_step, step);
      }
      std::vector<float> after(padded_);
      EXPECT_TRUE(backend->ReadMasterWeights(after.data()).ok());
      for (const RangeStep& rs : steps[step - 1]) {
        if (rs.t != 0) continue;
        EXPECT_EQ(std::memcmp(after.data() + rs.offset, before.data() + rs.offset, rs.length * 4),
                  0)
            << "step " << step << " skipped run at " << rs.offset;
        int64_t wrong = -1;  // the first element not sent as its master weight rounded
        for (int64_t i = rs.offset; i < rs.offset + rs.length && wrong < 0; ++i) {
          if (run.weights16.back()[i] != FloatToBf16(before[i])) wrong = i;
        }
        EXPECT_EQ(wrong, -1) << "step " << step;
      }
    }
    run.master.resize(padded_);
    EXPECT_TRUE(backend->ReadMasterWeights(run.master.data()).ok());
    EXPECT_TRUE(backend->DropJob().ok());
    return run;
  };
  InProcessOptimizer in_process(map_, 2, BestSimdPath());
  const Run reference = train(&in_process);
  // The range steps did matter.
  EXPECT_FALSE(Same(Train(&in_process, groups_, true), reference));
  LocalShards shards(2);
  const std::vector<std::pair<std::string, TransportChoice>> planes = RemotePlanes();
  for (const auto& [name, plane] : planes) {
    std::unique_ptr<RemoteOptimizer> remote = Remote(shards, plane);
    ASSERT_NE(remote, nullptr) << name;
    EXPECT_TRUE(Same(train(remote.get()), reference)) << name;
  }

  // Refused by the backend, whole, through both; the step is over and nothing changed.
  std::unique_ptr<RemoteOptimizer> remote = Remote(shards, TransportChoice::kGrpc);
  ASSERT_NE(remote, nullptr);
  for (OptimizerBackend* backend : std::vector<OptimizerBackend*>{&in_process, remote.get()}) {
    ASSERT_TRUE(backend->CreateJob(kJob, groups_[0].adam(), DType::kBf16, groups_).ok());
    ASSERT_TRUE(backend->LoadMasterWeights(master_.data()).ok());
    std::vector<uint16_t> weights16(padded_);
    struct Case {
      std::vector<RangeStep> steps;
      const char* names;
    };
    const std::vector<Case> cases = {
        // Each half alone is valid on its shard: only the whole list shows the overlap.
        {{{boundary - 10, 20, 0}, {boundary - 5, 20, 1}}, "range_steps[1] starts at"},
        {{{padded_ - 5, 10, 0}}, "not inside the flat space"},
        {{{5, 0, 0}}, "range_steps[0]"},
        {{{5, 10, 7}}, "has t 7"},  // the shard's check
    };
    for (const Case& c : cases) {
      ASSERT_TRUE(backend->BeginStep(1).ok());
      ASSERT_TRUE(backend->SendGradients(0, grads_[0].data(), padded_).ok());
      absl::StatusOr<StepCounters> r =
          backend->Commit(1e-3, 1.0f, false, weights16.data(), {}, c.steps);
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
      EXPECT_NE(r.status().message().find(c.names), std::string::npos) << r.status();
    }
    std::vector<float> after(padded_);
    ASSERT_TRUE(backend->ReadMasterWeights(after.data()).ok());
    EXPECT_EQ(std::memcmp(after.data(), master_.data(), padded_ * 4), 0);
    ASSERT_TRUE(backend->DropJob().ok());
  }
}

// The update during backward (OptimizerBackend::UpdateEarly) through both backends: parts updated
// as their gradients arrive, one across the shard boundary, give the plain commit's bits on every
// backend, kept where the commit agrees (step 1; step 3, one part with the range's t spelled out)
// and redone where it does not (step 2: another multiplier), and the counters say so, in process
// and over every data plane. Bad calls are refused by the backend.
TEST_F(OptimizerBackendTest, UpdateDuringBackwardGivesTheSameBits) {
  InProcessOptimizer plain(map_, 2, BestSimdPath());
  const Run reference = Train(&plain, groups_, true);
  const int64_t cut = 60001;  // the second part runs across the shard boundary
  ASSERT_LT(cut, static_cast<int64_t>(map_.slices(1).offset()));
  auto train = [&](OptimizerBackend* backend, bool early, const std::string& name) {
    Run run;
    EXPECT_TRUE(backend->CreateJob(kJob, groups_[0].adam(), DType::kBf16, groups_).ok());
    EXPECT_TRUE(backend->LoadMasterWeights(master_.data()).ok());
    for (uint64_t step = 1; step <= 3; ++step) {
      const std::vector<double> lrs = {1e-3 / step, 5e-4, 2e-3 * step};
      const float multiplier = step == 2 ? 1.0f : 0.5f;  // the commit's is 0.5
      const uint16_t* g = grads_[step - 1].data();
      run.weights16.emplace_back(padded_, 0);
      EXPECT_TRUE(backend->BeginStep(step).ok());
      EXPECT_TRUE(backend->SendGradients(cut, g + cut, padded_ - cut).ok());
      absl::Status s = backend->UpdateEarly(cut, padded_ - cut, 0, lrs[0], multiplier, lrs);
      EXPECT_TRUE(s.ok()) << name << ": " << s;
      EXPECT_TRUE(backend->SendGradients(0, g, cut).ok());
      s = backend->UpdateEarly(0, cut, step == 3 ? step : 0, lrs[0], multiplier, lrs);
      EXPECT_TRUE(s.ok()) << name << ": " << s;
      absl::StatusOr<StepCounters> counters =
          backend->Commit(lrs[0], 0.5f, false, run.weights16.back().data(), lrs);
      EXPECT_TRUE(counters.ok()) << name << ": " << counters.status();
      if (!counters.ok()) continue;
      EXPECT_EQ(counters->adam_step, step);
      const uint64_t all = early ? static_cast<uint64_t>(padded_) : 0;
      EXPECT_EQ(counters->early_updated, step == 2 ? 0 : all) << name << " step " << step;
      EXPECT_EQ(counters->early_rolled_back, step == 2 ? all : 0) << name << " step " << step;
    }
    run.master.resize(padded_);
    EXPECT_TRUE(backend->ReadMasterWeights(run.master.data()).ok());
    EXPECT_TRUE(backend->DropJob().ok());
    return run;
  };
  InProcessOptimizer in_process(map_, 2, BestSimdPath());
  EXPECT_TRUE(Same(train(&in_process, true, "in process"), reference));
  LocalShards shards(2);
  for (const auto& [name, plane] : RemotePlanes()) {
    std::unique_ptr<RemoteOptimizer> remote = Remote(shards, plane);
    ASSERT_NE(remote, nullptr) << name;
    EXPECT_TRUE(Same(train(remote.get(), true, name), reference)) << name;
  }

  // Refused by the backend, and by the in-process shard; the step then fails as a refused chunk
  // does, and nothing changed.
  ASSERT_TRUE(in_process.CreateJob(kJob, groups_[0].adam(), DType::kBf16, groups_).ok());
  ASSERT_TRUE(in_process.LoadMasterWeights(master_.data()).ok());
  const std::vector<double> lrs = {1e-3, 5e-4, 2e-3};
  EXPECT_EQ(in_process.UpdateEarly(0, 10, 0, 1e-3, 1.0f, lrs).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(in_process.BeginStep(1).ok());
  EXPECT_EQ(in_process.UpdateEarly(padded_ - 5, 10, 0, 1e-3, 1.0f, lrs).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(in_process.UpdateEarly(-1, 10, 0, 1e-3, 1.0f, lrs).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(in_process.UpdateEarly(0, 10, 2, 1e-3, 1.0f, lrs).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(in_process.SendGradients(0, grads_[0].data(), cut).ok());
  const absl::Status missing = in_process.UpdateEarly(cut - 10, 20, 0, 1e-3, 1.0f, lrs);
  EXPECT_EQ(missing.code(), absl::StatusCode::kFailedPrecondition) << missing;
  in_process.AbortStep();
  std::vector<float> after(padded_);
  ASSERT_TRUE(in_process.ReadMasterWeights(after.data()).ok());
  EXPECT_EQ(std::memcmp(after.data(), master_.data(), padded_ * 4), 0);
}

// Occurrences of `needle` in `haystack`.
int Count(absl::string_view haystack, absl::string_view needle) {
  int n = 0;
  for (size_t at = haystack.find(needle); at != absl::string_view::npos;
       at = haystack.find(needle, at + needle.size())) {
    ++n;
  }
  return n;
}

// A shard that dies during a commit over shared memory: the error names it once, not as
// "optimizer shard A: optimizer shard A went away".
TEST_F(OptimizerBackendTest, ShardDeathNamesTheShardOnce) {
  absl::StatusOr<v1::PartitionMap> map = MakePartitionMap(kParams, 1, 1);
  ASSERT_TRUE(map.ok()) << map.status();
  ThreadPool pool(ThreadPool::Options{2, false});
  ShardStore store(ShardOptions{}, &pool, BestSimdPath());
  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<OptimizerServer>> server = OptimizerServer::Start(options, &store);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = absl::StrCat("127.0.0.1:", (*server)->port());
  auto remote = RemoteOptimizer::Connect(*map, {address}, ClientOptions{}, TransportChoice::kShm);
  ASSERT_TRUE(remote.ok()) << remote.status();
  ASSERT_TRUE((*remote)->CreateJob(kJob, groups_[0].adam(), DType::kBf16, {}).ok());
  ASSERT_TRUE((*remote)->LoadMasterWeights(master_.data()).ok());
  ASSERT_TRUE((*remote)->BeginStep(1).ok());
  ASSERT_TRUE((*remote)->SendGradients(0, grads_[0].data(), padded_).ok());
  // Hold the range's tensors so the shard's commit cannot finish, then stop the server.
  absl::StatusOr<std::shared_ptr<Job>> job = store.FindJob(kJob);
  ASSERT_TRUE(job.ok()) << job.status();
  RangeState* range = (*job)->ranges[0].get();
  range->tensors_mu.lock();
  std::vector<uint16_t> weights16(padded_);
  auto commit = std::async(std::launch::async, [&] {
    return (*remote)->Commit(1e-3f, 1.0f, false, weights16.data()).status();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  std::thread shutdown([&] { (*server)->Shutdown(); });
  const bool returned = commit.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  range->tensors_mu.unlock();
  shutdown.join();
  ASSERT_TRUE(returned) << "Commit still waits 10 s after the shard went away";
  const absl::Status s = commit.get();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("went away"), std::string::npos) << s;
  EXPECT_EQ(Count(s.message(), address), 1) << s;
  remote->reset();
  server->reset();
}

}  // namespace
}  // namespace offload
