// The shard's rules without gRPC: job creation, loads, step sessions (order, replay, skip,
// accumulation), parameter groups, and that every refused input leaves the state bit-identical.
#include "cpu_optimizer_server/shard/shard_store.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "cpu_optimizer_server/shard/shard_test_util.h"
#include "cpu_optimizer_server/shard/state_loader.h"
#include "cpu_optimizer_server/shard/step_session.h"
#include "cpu_optimizer_server/shard/wire_convert.h"

namespace offload {
namespace {

struct Snapshot {
  std::vector<float> p, m, v;
  uint64_t completed, adam, skipped;
  bool operator==(const Snapshot& o) const {
    return std::memcmp(p.data(), o.p.data(), p.size() * 4) == 0 &&
           std::memcmp(m.data(), o.m.data(), m.size() * 4) == 0 &&
           std::memcmp(v.data(), o.v.data(), v.size() * 4) == 0 && completed == o.completed &&
           adam == o.adam && skipped == o.skipped;
  }
};

Snapshot Take(const RangeState& r) {
  Snapshot s;
  const int64_t n = r.spec.length;
  s.p.assign(r.param, r.param + n);
  s.m.assign(Fp32(r.exp_avg), Fp32(r.exp_avg) + n);
  s.v.assign(Fp32(r.exp_avg_sq), Fp32(r.exp_avg_sq) + n);
  std::lock_guard<std::mutex> lock(r.mu);
  s.completed = r.completed_step;
  s.adam = r.adam_step;
  s.skipped = r.skipped_steps();
  return s;
}

class ShardStoreTest : public ::testing::Test {
 protected:
  // A range that spans several waves and ends in a partial tile.
  static constexpr int64_t kOffset = 1000;
  static constexpr int64_t kLength = 3 * kTileElements + 4321;

  ShardStoreTest() : pool_(ThreadPool::Options{2, false}) {
    ShardOptions options;
    options.memory_limit_bytes = int64_t{64} << 20;
    options.wave_elements = kTileElements;
    store_ = std::make_unique<ShardStore>(options, &pool_, BestSimdPath());
    seed_ = std::random_device()();
    rng_.seed(seed_);
  }

  JobConfig Config(const std::string& id = "job-1") {
    JobConfig c;
    c.job_id = id;
    c.ranges = {{kOffset, kLength}};
    c.adam.lr = 1e-2f;
    c.adam.weight_decay = 0.1f;
    c.param_dtype = DType::kFp16;
    return c;
  }

  std::vector<float> RandomFloats(int64_t n, float scale) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng_);
    return v;
  }
  std::vector<uint16_t> RandomFp16(int64_t n) {
    std::vector<uint16_t> g(n);
    grads32_ = RandomFloats(n, 0.5f);
    for (int64_t i = 0; i < n; ++i) g[i] = FloatToFp16(grads32_[i]);
    return g;
  }

  void CreateAndLoad() {
    ASSERT_TRUE(store_->CreateJob(Config()).ok());
    weights_ = RandomFloats(kLength, 1.0f);
    auto loader = StateLoader::Start(store_.get(), "job-1");
    ASSERT_TRUE(loader.ok());
    ASSERT_TRUE((*loader)
                    ->AddChunk(StateTensor::kMasterWeights, kOffset, DType::kFp32,
                               Bytes(weights_.data(), kLength * 4))
                    .ok());
    ASSERT_TRUE((*loader)->Apply().ok());
  }
  RangeState& Range() { return *(*store_->FindJob("job-1"))->ranges[0]; }

  // Runs a whole step with one gradient (sent in two chunks) and returns the outcome.
  absl::StatusOr<StepOutcome> RunStep(uint64_t step, const std::vector<uint16_t>& g,
                                      VectorSink* sink, bool skip = false) {
    auto session = StepSession::Open(store_.get(), "job-1", 0, step);
    if (!session.ok()) return session.status();
    const int64_t half = kLength / 2 + 3;
    if (auto s = (*session)->AddGradients(kOffset + half, DType::kFp16, false,
                                          Bytes(g.data() + half, (kLength - half) * 2));
        !s.ok()) {
      return s;
    }
    if (auto s = (*session)->AddGradients(kOffset, DType::kFp16, false, Bytes(g.data(), half * 2));
        !s.ok()) {
      return s;
    }
    return (*session)->Commit({step, 1e-2f, 0.5f, skip}, sink);
  }

  ThreadPool pool_;
  std::unique_ptr<ShardStore> store_;
  uint32_t seed_;
  std::mt19937 rng_;
  std::vector<float> weights_, grads32_;
};

TEST_F(ShardStoreTest, CreateJobValidatesEveryField) {
  auto expect = [&](JobConfig c, absl::StatusCode code, const char* what) {
    const int64_t used = store_->budget()->used();
    absl::StatusOr<int64_t> r = store_->CreateJob(c);
    EXPECT_EQ(r.status().code(), code) << what << ": " << r.status();
    EXPECT_EQ(store_->budget()->used(), used) << what;
  };
  JobConfig c = Config();
  c.job_id = "";
  expect(c, absl::StatusCode::kInvalidArgument, "empty id");
  c.job_id = "bad/id";
  expect(c, absl::StatusCode::kInvalidArgument, "slash in id");
  c = Config();
  c.ranges.clear();
  expect(c, absl::StatusCode::kInvalidArgument, "no ranges");
  c = Config();
  c.ranges = {{0, 100}, {50, 100}};
  expect(c, absl::StatusCode::kInvalidArgument, "overlap");
  c.ranges = {{0, 0}};
  expect(c, absl::StatusCode::kInvalidArgument, "empty range");
  c = Config();
  c.adam.eps = 0;
  expect(c, absl::StatusCode::kInvalidArgument, "eps 0");
  c = Config();
  c.adam.beta2 = 1.0f;
  expect(c, absl::StatusCode::kInvalidArgument, "beta2 1");
  c = Config();
  c.adam.lr = std::nanf("");
  expect(c, absl::StatusCode::kInvalidArgument, "NaN lr");
  c = Config();
  c.adam.weight_decay = INFINITY;
  expect(c, absl::StatusCode::kInvalidArgument, "inf wd");
  c = Config();
  c.param_dtype = DType::kFp32;
  expect(c, absl::StatusCode::kInvalidArgument, "fp32 params");
  c = Config();
  c.ranges = {{0, int64_t{8} << 20}};  // 96 MiB of state > 64 MiB limit
  expect(c, absl::StatusCode::kResourceExhausted, "over the memory limit");

  ASSERT_TRUE(store_->CreateJob(Config()).ok());
  expect(Config(), absl::StatusCode::kAlreadyExists, "duplicate");
  EXPECT_GT(store_->budget()->used(), 12 * kLength - 1);
  ASSERT_TRUE(store_->DropJob("job-1").ok());
  EXPECT_EQ(store_->budget()->used(), 0);
  EXPECT_EQ(store_->DropJob("job-1").code(), absl::StatusCode::kNotFound);
}

TEST_F(ShardStoreTest, StepNeedsLoadedWeights) {
  ASSERT_TRUE(store_->CreateJob(Config()).ok());
  auto session = StepSession::Open(store_.get(), "job-1", 0, 1);
  EXPECT_EQ(session.status().code(), absl::StatusCode::kFailedPrecondition) << session.status();
}

TEST_F(ShardStoreTest, StepMatchesTheKernelOnTheSameState) {
  CreateAndLoad();
  std::vector<uint16_t> g = RandomFp16(kLength);
  // Reference: the scalar kernel over copies of the state, same scalars.
  std::vector<float> p = weights_, m(kLength, 0), v(kLength, 0);
  std::vector<uint16_t> out(kLength);
  for (uint64_t step = 1; step <= 3; ++step) {
    VectorSink sink(kOffset, kLength);
    absl::StatusOr<StepOutcome> outcome = RunStep(step, g, &sink);
    ASSERT_TRUE(outcome.ok()) << outcome.status() << " seed " << seed_;
    EXPECT_TRUE(outcome->applied);
    EXPECT_EQ(outcome->adam_step, step);
    EXPECT_EQ(sink.sends(), 4);  // 3 full waves and a partial one

    AdamSpan span{g.data(), DType::kFp16, p.data(),     m.data(),
                  v.data(), out.data(),   DType::kFp16, kLength};
    GetAdamKernel(store_->simd_path())(
        ComputeAdamStepScalars(Config().adam, 1e-2f, static_cast<int64_t>(step), 0.5f), span);
    ASSERT_EQ(std::memcmp(sink.out().data(), out.data(), kLength * 2), 0) << "seed " << seed_;
    const RangeState& r = Range();
    ASSERT_EQ(std::memcmp(r.param, p.data(), kLength * 4), 0);
    ASSERT_EQ(std::memcmp(Fp32(r.exp_avg), m.data(), kLength * 4), 0);
    ASSERT_EQ(std::memcmp(Fp32(r.exp_avg_sq), v.data(), kLength * 4), 0);
  }
}

TEST_F(ShardStoreTest, ReplayReturnsTheSameParametersWithoutApplyingTwice) {
  CreateAndLoad();
  std::vector<uint16_t> g = RandomFp16(kLength);
  VectorSink first(kOffset, kLength);
  ASSERT_TRUE(RunStep(1, g, &first).ok());
  const Snapshot after = Take(Range());
  VectorSink again(kOffset, kLength);
  absl::StatusOr<StepOutcome> replay = RunStep(1, g, &again);
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_TRUE(replay->replayed);
  EXPECT_FALSE(replay->applied);
  EXPECT_EQ(first.out(), again.out());
  EXPECT_TRUE(Take(Range()) == after);
}

TEST_F(ShardStoreTest, OutOfOrderStepsAreRefused) {
  CreateAndLoad();
  const Snapshot before = Take(Range());
  EXPECT_EQ(StepSession::Open(store_.get(), "job-1", 0, 2).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(StepSession::Open(store_.get(), "job-1", 0, 0).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(StepSession::Open(store_.get(), "job-1", 1, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(StepSession::Open(store_.get(), "nope", 0, 1).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(Take(Range()) == before);
}

TEST_F(ShardStoreTest, OneStreamPerRange) {
  CreateAndLoad();
  auto a = StepSession::Open(store_.get(), "job-1", 0, 1);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(StepSession::Open(store_.get(), "job-1", 0, 1).status().code(),
            absl::StatusCode::kAborted);
  a->reset();  // the stream ends: the lease is free again
  EXPECT_TRUE(StepSession::Open(store_.get(), "job-1", 0, 1).ok());
}

TEST_F(ShardStoreTest, EveryBadInputLeavesTheStateBitIdentical) {
  CreateAndLoad();
  std::vector<uint16_t> g = RandomFp16(kLength);
  VectorSink warm(kOffset, kLength);
  ASSERT_TRUE(RunStep(1, g, &warm).ok());  // non-zero moments make the comparison meaningful
  const Snapshot before = Take(Range());
  const int64_t used = store_->budget()->used();

  struct Case {
    const char* what;
    absl::StatusCode code;
    std::function<absl::Status(StepSession*)> run;
  };
  VectorSink sink(kOffset, kLength);
  const std::string all = Bytes(g.data(), kLength * 2);
  std::vector<Case> cases = {
      {"odd byte count", absl::StatusCode::kInvalidArgument,
       [&](StepSession* s) { return s->AddGradients(kOffset, DType::kFp16, false, "abc"); }},
      {"empty chunk", absl::StatusCode::kInvalidArgument,
       [&](StepSession* s) { return s->AddGradients(kOffset, DType::kFp16, false, ""); }},
      {"before the range", absl::StatusCode::kOutOfRange,
       [&](StepSession* s) { return s->AddGradients(kOffset - 1, DType::kFp16, false, "ab"); }},
      {"past the range", absl::StatusCode::kOutOfRange,
       [&](StepSession* s) { return s->AddGradients(kOffset + 1, DType::kFp16, false, all); }},
      {"fp32 length mismatch", absl::StatusCode::kInvalidArgument,
       [&](StepSession* s) { return s->AddGradients(kOffset, DType::kFp32, false, "abcdef"); }},
      {"overlapping chunk", absl::StatusCode::kInvalidArgument,
       [&](StepSession* s) {
         EXPECT_TRUE(s->AddGradients(kOffset, DType::kFp16, false, all.substr(0, 200)).ok());
         return s->AddGradients(kOffset + 50, DType::kFp16, false, all.substr(0, 200));
       }},
      {"missing gradients", absl::StatusCode::kFailedPrecondition,
       [&](StepSession* s) {
         EXPECT_TRUE(s->AddGradients(kOffset, DType::kFp16, false, all.substr(2)).ok());
         return s->Commit({2, 1e-2f, 1.0f, false}, &sink).status();
       }},
      {"inf gradient without skip", absl::StatusCode::kInvalidArgument,
       [&](StepSession* s) {
         std::string bad = all;
         bad[100] = 0x00;
         bad[101] = 0x7c;  // fp16 +inf
         EXPECT_TRUE(s->AddGradients(kOffset, DType::kFp16, false, bad).ok());
         return s->Commit({2, 1e-2f, 1.0f, false}, &sink).status();
       }},
      {"commit of another step", absl::StatusCode::kFailedPrecondition,
       [&](StepSession* s) {
         EXPECT_TRUE(s->AddGradients(kOffset, DType::kFp16, false, all).ok());
         return s->Commit({3, 1e-2f, 1.0f, false}, &sink).status();
       }},
      {"NaN lr", absl::StatusCode::kInvalidArgument,
       [&](StepSession* s) {
         EXPECT_TRUE(s->AddGradients(kOffset, DType::kFp16, false, all).ok());
         return s->Commit({2, std::nanf(""), 1.0f, false}, &sink).status();
       }},
      {"negative grad_multiplier", absl::StatusCode::kInvalidArgument,
       [&](StepSession* s) {
         EXPECT_TRUE(s->AddGradients(kOffset, DType::kFp16, false, all).ok());
         return s->Commit({2, 1e-2f, -1.0f, false}, &sink).status();
       }},
      {"zero grad_multiplier (an omitted field)", absl::StatusCode::kInvalidArgument,
       [&](StepSession* s) {
         EXPECT_TRUE(s->AddGradients(kOffset, DType::kFp16, false, all).ok());
         return s->Commit({2, 1e-2f, 0.0f, false}, &sink).status();
       }},
      {"a chunk refused for memory does not count as received",
       absl::StatusCode::kFailedPrecondition,
       [&](StepSession* s) {
         {
           absl::StatusOr<Reservation> hog = store_->budget()->Take(
               store_->budget()->limit() - store_->budget()->used() - 16, "test");
           EXPECT_TRUE(hog.ok());
           EXPECT_EQ(s->AddGradients(kOffset, DType::kFp16, false, all.substr(0, 2000)).code(),
                     absl::StatusCode::kResourceExhausted);
         }
         EXPECT_TRUE(s->AddGradients(kOffset + 1000, DType::kFp16, false, all.substr(2000)).ok());
         return s->Commit({2, 1e-2f, 1.0f, false}, &sink).status();
       }},
      {"accumulator over the memory limit", absl::StatusCode::kResourceExhausted,
       [&](StepSession* s) {
         // Fill the budget so the accumulator cannot be had.
         absl::StatusOr<Reservation> hog = store_->budget()->Take(
             store_->budget()->limit() - store_->budget()->used() - 16, "test");
         EXPECT_TRUE(hog.ok());
         return s->AddGradients(kOffset, DType::kFp16, true, all);
       }},
      {"stream ends before the commit", absl::StatusCode::kOk,
       [&](StepSession* s) {
         return s->AddGradients(kOffset, DType::kFp16, false, all);  // then dropped
       }},
  };
  for (const Case& c : cases) {
    auto session = StepSession::Open(store_.get(), "job-1", 0, 2);
    ASSERT_TRUE(session.ok()) << c.what << ": " << session.status();
    absl::Status s = c.run(session->get());
    EXPECT_EQ(s.code(), c.code) << c.what << ": " << s;
    EXPECT_FALSE(s.message().empty() && !s.ok()) << c.what;
    session->reset();
    EXPECT_TRUE(Take(Range()) == before) << c.what;
    EXPECT_EQ(store_->budget()->used(), used) << c.what;
  }
}

TEST_F(ShardStoreTest, SkippedStepKeepsWeightsAndBiasCorrectionCount) {
  CreateAndLoad();
  std::vector<uint16_t> g = RandomFp16(kLength);
  const Snapshot before = Take(Range());
  VectorSink sink(kOffset, kLength);
  absl::StatusOr<StepOutcome> skipped = RunStep(1, g, &sink, /*skip=*/true);
  ASSERT_TRUE(skipped.ok()) << skipped.status();
  EXPECT_TRUE(skipped->skipped);
  EXPECT_EQ(skipped->adam_step, 0u);
  EXPECT_EQ(skipped->skipped_steps, 1u);
  Snapshot after = Take(Range());
  EXPECT_EQ(after.p, before.p);
  EXPECT_EQ(after.completed, 1u);
  // The next applied step is bias-correction step 1.
  absl::StatusOr<StepOutcome> next = RunStep(2, g, &sink);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->adam_step, 1u);
}

TEST_F(ShardStoreTest, MicroBatchesAccumulateInFp32) {
  CreateAndLoad();
  EXPECT_EQ(Range().accumulator, nullptr);  // not allocated for single-batch steps
  std::vector<float> g1 = RandomFloats(kLength, 0.3f), g2 = RandomFloats(kLength, 0.3f);
  std::vector<uint16_t> h1(kLength), h2(kLength);
  std::vector<float> sum(kLength);
  for (int64_t i = 0; i < kLength; ++i) {
    h1[i] = FloatToBf16(g1[i]);
    h2[i] = FloatToBf16(g2[i]);
    sum[i] = Bf16ToFloat(h1[i]) + Bf16ToFloat(h2[i]);
  }
  std::vector<float> p = weights_, m(kLength, 0), v(kLength, 0);
  std::vector<uint16_t> out(kLength);
  AdamSpan span{sum.data(), DType::kFp32, p.data(),     m.data(),
                v.data(),   out.data(),   DType::kFp16, kLength};
  GetAdamKernel(store_->simd_path())(ComputeAdamStepScalars(Config().adam, 1e-2f, 1, 1.0f), span);

  auto session = StepSession::Open(store_.get(), "job-1", 0, 1);
  ASSERT_TRUE(session.ok());
  // Micro-batch 1 plain, micro-batch 2 accumulating, each in two chunks, out of order.
  const int64_t cut = 7777;
  ASSERT_TRUE((*session)
                  ->AddGradients(kOffset + cut, DType::kBf16, false,
                                 Bytes(h1.data() + cut, (kLength - cut) * 2))
                  .ok());
  ASSERT_TRUE(
      (*session)->AddGradients(kOffset, DType::kBf16, false, Bytes(h1.data(), cut * 2)).ok());
  ASSERT_TRUE(
      (*session)->AddGradients(kOffset, DType::kBf16, true, Bytes(h2.data(), cut * 2)).ok());
  ASSERT_TRUE((*session)
                  ->AddGradients(kOffset + cut, DType::kBf16, true,
                                 Bytes(h2.data() + cut, (kLength - cut) * 2))
                  .ok());
  VectorSink sink(kOffset, kLength);
  ASSERT_TRUE((*session)->Commit({1, 1e-2f, 1.0f, false}, &sink).ok());
  EXPECT_NE(Range().accumulator, nullptr);
  EXPECT_EQ(std::memcmp(sink.out().data(), out.data(), kLength * 2), 0);
  EXPECT_EQ(std::memcmp(Range().param, p.data(), kLength * 4), 0);
}

TEST_F(ShardStoreTest, ReceiverLeavingMidStreamStillAppliesTheWholeStep) {
  CreateAndLoad();
  std::vector<uint16_t> g = RandomFp16(kLength);
  VectorSink leaving(kOffset, kLength);
  leaving.RefuseAfter(1);
  absl::StatusOr<StepOutcome> outcome = RunStep(1, g, &leaving);
  ASSERT_TRUE(outcome.ok());
  EXPECT_TRUE(outcome->receiver_gone);
  EXPECT_TRUE(outcome->applied);
  // Every wave was applied: the state equals the kernel's over the whole range.
  std::vector<float> p = weights_, m(kLength, 0), v(kLength, 0);
  std::vector<uint16_t> expect(kLength);
  AdamSpan span{g.data(), DType::kFp16,  p.data(),     m.data(),
                v.data(), expect.data(), DType::kFp16, kLength};
  GetAdamKernel(store_->simd_path())(ComputeAdamStepScalars(Config().adam, 1e-2f, 1, 0.5f), span);
  EXPECT_EQ(std::memcmp(Range().param, p.data(), kLength * 4), 0);
  EXPECT_EQ(std::memcmp(Range().exp_avg, m.data(), kLength * 4), 0);
  // A replay gets every parameter, equal to what a full stream would have carried.
  VectorSink replay(kOffset, kLength);
  ASSERT_TRUE(RunStep(1, g, &replay).ok());
  EXPECT_EQ(replay.out(), expect);
}

TEST_F(ShardStoreTest, LoadIsAllOrNothing) {
  CreateAndLoad();
  const Snapshot before = Take(Range());
  std::vector<float> w = RandomFloats(kLength, 1.0f);
  auto expect_refused = [&](const char* what, absl::StatusCode code, auto&& add) {
    auto loader = StateLoader::Start(store_.get(), "job-1");
    ASSERT_TRUE(loader.ok());
    ASSERT_TRUE(
        (*loader)
            ->AddChunk(StateTensor::kMasterWeights, kOffset, DType::kFp32, Bytes(w.data(), 400 * 4))
            .ok());
    EXPECT_EQ(add(loader->get()).code(), code) << what;
    EXPECT_TRUE(Take(Range()) == before) << what;
  };
  expect_refused("NaN weight", absl::StatusCode::kInvalidArgument, [&](StateLoader* l) {
    std::vector<float> bad(10, 1.0f);
    bad[3] = std::nanf("");
    return l->AddChunk(StateTensor::kMasterWeights, kOffset + 500, DType::kFp32,
                       Bytes(bad.data(), 40));
  });
  expect_refused("negative exp_avg_sq", absl::StatusCode::kInvalidArgument, [&](StateLoader* l) {
    float bad = -1.0f;
    return l->AddChunk(StateTensor::kExpAvgSq, kOffset, DType::kFp32, Bytes(&bad, 4));
  });
  expect_refused("overlap", absl::StatusCode::kInvalidArgument, [&](StateLoader* l) {
    return l->AddChunk(StateTensor::kMasterWeights, kOffset + 399, DType::kFp32,
                       Bytes(w.data(), 8));
  });
  expect_refused("outside the job", absl::StatusCode::kOutOfRange, [&](StateLoader* l) {
    return l->AddChunk(StateTensor::kMasterWeights, kOffset + kLength, DType::kFp32,
                       Bytes(w.data(), 8));
  });
  expect_refused("fp16 load", absl::StatusCode::kInvalidArgument, [&](StateLoader* l) {
    return l->AddChunk(StateTensor::kMasterWeights, kOffset + 500, DType::kFp16, "ab");
  });
  expect_refused("during a step", absl::StatusCode::kFailedPrecondition, [&](StateLoader* l) {
    auto session = StepSession::Open(store_.get(), "job-1", 0, 1);
    EXPECT_TRUE(session.ok());
    return l->Apply().status();
  });
}

TEST_F(ShardStoreTest, LoadRestoresStepCountersAndMoments) {
  CreateAndLoad();
  std::vector<float> m = RandomFloats(kLength, 0.1f), v = RandomFloats(kLength, 0.1f);
  for (float& x : v) x = x * x;
  auto loader = StateLoader::Start(store_.get(), "job-1");
  ASSERT_TRUE(loader.ok());
  ASSERT_TRUE(
      (*loader)
          ->AddChunk(StateTensor::kExpAvg, kOffset, DType::kFp32, Bytes(m.data(), kLength * 4))
          .ok());
  ASSERT_TRUE(
      (*loader)
          ->AddChunk(StateTensor::kExpAvgSq, kOffset, DType::kFp32, Bytes(v.data(), kLength * 4))
          .ok());
  EXPECT_EQ((*loader)->SetSteps(40, 41).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*loader)->SetSteps(~uint64_t{0}, 0).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE((*loader)->SetSteps(41, 40).ok());
  ASSERT_TRUE((*loader)->Apply().ok());
  EXPECT_EQ(std::memcmp(Range().exp_avg, m.data(), kLength * 4), 0);
  EXPECT_EQ(StepSession::Open(store_.get(), "job-1", 0, 1).status().code(),
            absl::StatusCode::kFailedPrecondition);
  std::vector<uint16_t> g = RandomFp16(kLength);
  VectorSink sink(kOffset, kLength);
  absl::StatusOr<StepOutcome> outcome = RunStep(42, g, &sink);
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_EQ(outcome->adam_step, 41u);
}

TEST_F(ShardStoreTest, ReadStateConvertsAndChecksBounds) {
  CreateAndLoad();
  std::vector<float> got;
  ASSERT_TRUE(store_
                  ->ReadState("job-1", StateTensor::kMasterWeights, DType::kFp32, kOffset + 5,
                              kLength - 5, 1000,
                              [&](int64_t off, int64_t n, const std::string& b) {
                                EXPECT_EQ(off, kOffset + 5 + static_cast<int64_t>(got.size()));
                                const float* f = reinterpret_cast<const float*>(b.data());
                                got.insert(got.end(), f, f + n);
                                return true;
                              })
                  .ok());
  EXPECT_EQ(got, std::vector<float>(weights_.begin() + 5, weights_.end()));
  auto noop = [](int64_t, int64_t, const std::string&) { return true; };
  EXPECT_EQ(store_
                ->ReadState("job-1", StateTensor::kMasterWeights, DType::kFp32, kOffset,
                            kLength + 1, 0, noop)
                .code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(
      store_->ReadState("job-1", StateTensor::kExpAvg, DType::kBf16, kOffset, 10, 0, noop).code(),
      absl::StatusCode::kInvalidArgument);
}

TEST_F(ShardStoreTest, DroppedJobFailsItsOpenStream) {
  CreateAndLoad();
  std::vector<uint16_t> g = RandomFp16(kLength);
  auto session = StepSession::Open(store_.get(), "job-1", 0, 1);
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE(
      (*session)->AddGradients(kOffset, DType::kFp16, false, Bytes(g.data(), kLength * 2)).ok());
  ASSERT_TRUE(store_->DropJob("job-1").ok());
  VectorSink sink(kOffset, kLength);
  EXPECT_EQ((*session)->Commit({1, 1e-2f, 1.0f, false}, &sink).status().code(),
            absl::StatusCode::kNotFound);
  session->reset();
  EXPECT_EQ(store_->budget()->used(), 0);
}

// --- Parameter groups. ---

class ParamGroupTest : public ShardStoreTest {
 protected:
  // Range-relative: inside the second tile (and so the second wave, one tile each here), and odd,
  // so the cut also falls inside a SIMD vector.
  static constexpr int64_t kCut = kTileElements + 5003;

  // Group A: AdamW with decay; group B: plain Adam without decay, other betas and eps, and no
  // bias correction.
  static AdamHyperParams A() {
    AdamHyperParams a;
    a.lr = 1e-2f;
    a.weight_decay = 0.1f;
    return a;
  }
  static AdamHyperParams B() {
    AdamHyperParams b;
    b.lr = 3e-3f;
    b.beta1 = 0.8f;
    b.beta2 = 0.99f;
    b.eps = 1e-6f;
    b.weight_decay = 0.0f;
    b.adamw = false;
    b.bias_correction = false;
    return b;
  }
  // The two groups over flat elements, reaching beyond the range on both sides (a shard gets every
  // group of the job).
  static std::vector<ParamGroupSpec> TwoGroups() {
    return {ParamGroupSpec{0, kOffset + kCut, A()},
            ParamGroupSpec{kOffset + kCut, int64_t{1} << 20, B()}};
  }
  static JobConfig Job(const std::string& id, std::vector<RangeSpec> ranges,
                       std::vector<ParamGroupSpec> groups, AdamHyperParams adam = A()) {
    JobConfig c;
    c.job_id = id;
    c.ranges = std::move(ranges);
    c.adam = adam;
    c.groups = std::move(groups);
    c.param_dtype = DType::kFp16;
    return c;
  }
  // Creates `config` (one range) and loads the master weights weights_[at, at + length).
  void CreateLoaded(const JobConfig& config, int64_t at) {
    ASSERT_TRUE(store_->CreateJob(config).ok()) << config.job_id;
    const RangeSpec& r = config.ranges[0];
    auto loader = StateLoader::Start(store_.get(), config.job_id);
    ASSERT_TRUE(loader.ok());
    ASSERT_TRUE((*loader)
                    ->AddChunk(StateTensor::kMasterWeights, r.offset, DType::kFp32,
                               Bytes(weights_.data() + at, r.length * 4))
                    .ok());
    ASSERT_TRUE((*loader)->Apply().ok());
  }
  RangeState& RangeOf(const std::string& id) { return *(*store_->FindJob(id))->ranges[0]; }
  // One step of job `id`'s only range, gradients g (its length,) in two chunks cut at `split`.
  absl::StatusOr<StepOutcome> Step(const std::string& id, uint64_t step, const uint16_t* g,
                                   int64_t split, const StepCommitArgs& args, VectorSink* sink) {
    const RangeSpec spec = RangeOf(id).spec;
    auto session = StepSession::Open(store_.get(), id, 0, step);
    if (!session.ok()) return session.status();
    OFFLOAD_RETURN_IF_ERROR((*session)->AddGradients(spec.offset + split, DType::kFp16, false,
                                                     Bytes(g + split, (spec.length - split) * 2)));
    OFFLOAD_RETURN_IF_ERROR(
        (*session)->AddGradients(spec.offset, DType::kFp16, false, Bytes(g, split * 2)));
    return (*session)->Commit(args, sink);
  }
  // The fp32 state of job `id` as ReadState streams it: master weights, then both moments.
  std::string ReadAll(const std::string& id) {
    const RangeSpec spec = RangeOf(id).spec;
    std::string all;
    for (StateTensor t :
         {StateTensor::kMasterWeights, StateTensor::kExpAvg, StateTensor::kExpAvgSq}) {
      EXPECT_TRUE(store_
                      ->ReadState(id, t, DType::kFp32, spec.offset, spec.length, 0,
                                  [&](int64_t, int64_t, const std::string& b) {
                                    all += b;
                                    return true;
                                  })
                      .ok());
    }
    return all;
  }
};

// Two groups in one range give, bit for bit, what two jobs over the two pieces with those
// configs and lrs give: weights, moments and the 16-bit copy, over several steps (one skipped).
TEST_F(ParamGroupTest, TwoGroupsAreTwoJobsBitForBit) {
  weights_ = RandomFloats(kLength, 1.0f);
  CreateLoaded(Job("grouped", {{kOffset, kLength}}, TwoGroups()), 0);
  CreateLoaded(Job("a", {{kOffset, kCut}}, {}, A()), 0);
  CreateLoaded(Job("b", {{kOffset + kCut, kLength - kCut}}, {}, B()), kCut);
  CreateLoaded(Job("all-a", {{kOffset, kLength}}, {}, A()), 0);
  for (uint64_t step = 1; step <= 5; ++step) {
    const std::vector<uint16_t> g = RandomFp16(kLength);
    const bool skip = step == 3;
    const float lr_a = 1e-2f / step, lr_b = 4e-3f + 1e-4f * step;
    VectorSink grouped(kOffset, kLength), pieces(kOffset, kLength);
    StepCommitArgs args{step, 123.0f, 0.5f, skip, {lr_a, lr_b}};
    absl::StatusOr<StepOutcome> one =
        Step("grouped", step, g.data(), kLength / 2 + 3, args, &grouped);
    ASSERT_TRUE(one.ok()) << one.status();
    ASSERT_TRUE(Step("a", step, g.data(), kCut / 3, {step, lr_a, 0.5f, skip}, &pieces).ok());
    ASSERT_TRUE(Step("b", step, g.data() + kCut, 7, {step, lr_b, 0.5f, skip}, &pieces).ok());
    VectorSink all_a(kOffset, kLength);
    ASSERT_TRUE(Step("all-a", step, g.data(), 5, {step, lr_a, 0.5f, skip}, &all_a).ok());
    EXPECT_EQ(one->applied, !skip);
    EXPECT_EQ(std::memcmp(grouped.out().data(), pieces.out().data(), kLength * 2), 0)
        << "step " << step << " seed " << seed_;
    const RangeState& r = RangeOf("grouped");
    const RangeState& a = RangeOf("a");
    const RangeState& b = RangeOf("b");
    for (StateTensor t :
         {StateTensor::kMasterWeights, StateTensor::kExpAvg, StateTensor::kExpAvgSq}) {
      ASSERT_EQ(std::memcmp(r.Tensor(t), a.Tensor(t), kCut * 4), 0) << "step " << step;
      ASSERT_EQ(std::memcmp(static_cast<const float*>(r.Tensor(t)) + kCut, b.Tensor(t),
                            (kLength - kCut) * 4),
                0)
          << "step " << step;
    }
  }
  // And the groups did differ: group A's config and lr everywhere gives other bits past the cut.
  EXPECT_EQ(std::memcmp(RangeOf("grouped").param, RangeOf("all-a").param, kCut * 4), 0);
  EXPECT_NE(std::memcmp(RangeOf("grouped").param + kCut, RangeOf("all-a").param + kCut,
                        (kLength - kCut) * 4),
            0);
}

// One explicit group equal to `adam`, narrow or reaching far beyond the range, with or without
// group_lr, is the job without groups bit for bit.
TEST_F(ParamGroupTest, OneGroupEqualToAdamIsNoGroups) {
  weights_ = RandomFloats(kLength, 1.0f);
  CreateLoaded(Job("plain", {{kOffset, kLength}}, {}, A()), 0);
  CreateLoaded(Job("exact", {{kOffset, kLength}}, {{kOffset, kLength, A()}}), 0);
  CreateLoaded(Job("wide", {{kOffset, kLength}}, {{0, int64_t{1} << 40, A()}}), 0);
  for (uint64_t step = 1; step <= 3; ++step) {
    const std::vector<uint16_t> g = RandomFp16(kLength);
    const float lr = 2e-3f * step;
    VectorSink plain(kOffset, kLength), exact(kOffset, kLength), wide(kOffset, kLength);
    ASSERT_TRUE(Step("plain", step, g.data(), 999, {step, lr, 0.5f, false}, &plain).ok());
    ASSERT_TRUE(Step("exact", step, g.data(), 999, {step, lr, 0.5f, false}, &exact).ok());
    ASSERT_TRUE(Step("wide", step, g.data(), 999, {step, 0.0f, 0.5f, false, {lr}}, &wide).ok());
    EXPECT_EQ(plain.out(), exact.out());
    EXPECT_EQ(plain.out(), wide.out());
    EXPECT_EQ(ReadAll("plain"), ReadAll("exact"));
    EXPECT_EQ(ReadAll("plain"), ReadAll("wide"));
  }
}

// The moments' storage on the wire: unset is fp32; bf16 with either rounding; anything else is
// refused by name, and fp16 state is refused by the store itself.
TEST_F(ParamGroupTest, WireStateDtype) {
  v1::CreateJobRequest request;
  request.set_job_id("wire");
  request.set_param_dtype(v1::DTYPE_BF16);
  v1::ParamRange* r = request.add_ranges();
  r->set_offset(0);
  r->set_length(100);
  *request.mutable_adam() = AdamConfigToProto(A());
  absl::StatusOr<JobConfig> config = JobConfigFromProto(request);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->state_dtype, DType::kFp32);
  request.set_state_dtype(v1::DTYPE_BF16);
  request.set_state_rounding(v1::STATE_ROUNDING_NEAREST);
  config = JobConfigFromProto(request);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->state_dtype, DType::kBf16);
  EXPECT_EQ(config->state_rounding, StateRounding::kNearest);
  request.set_state_rounding(static_cast<v1::StateRounding>(7));
  EXPECT_NE(JobConfigFromProto(request).status().message().find("state_rounding 7"),
            std::string::npos);
  request.set_state_rounding(v1::STATE_ROUNDING_STOCHASTIC);
  request.set_state_dtype(v1::DTYPE_FP16);
  EXPECT_NE(JobConfigFromProto(request).status().message().find("state_dtype DTYPE_FP16"),
            std::string::npos);
  JobConfig fp16_state = *config;
  fp16_state.state_dtype = DType::kFp16;
  EXPECT_EQ(store_->CreateJob(fp16_state).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(store_->Jobs().empty());
}

// The default group JobConfigFromProto makes from `adam`, and a request's groups as given.
TEST_F(ParamGroupTest, WireConfigAlwaysHasGroups) {
  v1::CreateJobRequest request;
  request.set_job_id("wire");
  request.set_param_dtype(v1::DTYPE_BF16);
  for (int64_t at : {100, 300}) {
    v1::ParamRange* r = request.add_ranges();
    r->set_offset(at);
    r->set_length(100);
  }
  *request.mutable_adam() = AdamConfigToProto(A());
  absl::StatusOr<JobConfig> config = JobConfigFromProto(request);
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_EQ(config->groups.size(), 1u);
  EXPECT_EQ(config->groups[0].offset, 100);
  EXPECT_EQ(config->groups[0].length, 300);
  EXPECT_EQ(config->groups[0].adam.weight_decay, 0.1f);

  request.clear_adam();  // unused with groups
  for (const ParamGroupSpec& g : TwoGroups()) {
    v1::ParamGroup* group = request.add_groups();
    group->set_offset(g.offset);
    group->set_length(g.length);
    *group->mutable_adam() = AdamConfigToProto(g.adam);
  }
  config = JobConfigFromProto(request);
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_EQ(config->groups.size(), 2u);
  EXPECT_EQ(config->groups[1].offset, kOffset + kCut);
  EXPECT_FALSE(config->groups[1].adam.adamw);
  EXPECT_FALSE(config->groups[1].adam.bias_correction);
  EXPECT_EQ(config->adam.weight_decay, 0.1f);  // the first group's
  request.mutable_groups(1)->mutable_adam()->clear_kind();
  EXPECT_EQ(JobConfigFromProto(request).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(JobConfigFromProto(request).status().message().find("groups[1].adam.kind"),
            std::string::npos);
}

TEST_F(ParamGroupTest, BadGroupsAreRefusedBeforeAnythingIsAllocated) {
  auto expect = [&](std::vector<ParamGroupSpec> groups, const std::string& names,
                    const char* what) {
    const int64_t used = store_->budget()->used();
    absl::StatusOr<int64_t> r =
        store_->CreateJob(Job("refused", {{kOffset, kLength}}, std::move(groups)));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << what << ": " << r.status();
    EXPECT_NE(r.status().message().find(names), std::string::npos) << what << ": " << r.status();
    EXPECT_EQ(store_->budget()->used(), used) << what;
    EXPECT_EQ(store_->FindJob("refused").status().code(), absl::StatusCode::kNotFound) << what;
  };
  std::vector<ParamGroupSpec> g = TwoGroups();
  g[1].offset -= 1;
  expect(g, "groups[1]", "overlap");
  g = TwoGroups();
  g[1].offset += 1;
  g[1].length -= 1;
  expect(g, "groups[1] starts at", "a gap");
  g = TwoGroups();
  g[1].length = kLength - kCut - 1;
  expect(g, "the last group, groups[1]", "the range's last element in no group");
  g = TwoGroups();
  std::swap(g[0], g[1]);
  expect(g, "groups[1]", "out of order");
  g = TwoGroups();
  g[1].adam.eps = 0;
  expect(g, "parameter group 1: adam.eps", "eps 0");
  g = TwoGroups();
  g[0].adam.beta1 = std::nanf("");
  expect(g, "parameter group 0: adam.beta1", "NaN beta1");
  g = TwoGroups();
  g[1].adam.weight_decay = -0.1f;
  expect(g, "parameter group 1: adam.weight_decay", "negative weight decay");
  g = TwoGroups();
  g[0].length = -5;
  expect(g, "groups[0]", "negative length");
  g.clear();
  for (int i = 0; i < kMaxParamGroups + 1; ++i) {
    g.push_back(ParamGroupSpec{kOffset + i * 100, i == kMaxParamGroups ? kLength : 100, A()});
  }
  expect(g, absl::StrCat("groups[", kMaxParamGroups, "]"), "65 groups");
  g.pop_back();
  g.back().length = kLength;
  EXPECT_TRUE(store_->CreateJob(Job("sixty-four", {{kOffset, kLength}}, g)).ok());
  EXPECT_EQ((*store_->FindJob("sixty-four"))->ranges[0]->group_pieces.size(),
            static_cast<size_t>(kMaxParamGroups));
}

TEST_F(ParamGroupTest, BadGroupLrLeavesTheStateBitIdentical) {
  weights_ = RandomFloats(kLength, 1.0f);
  CreateLoaded(Job("grouped", {{kOffset, kLength}}, TwoGroups()), 0);
  const std::vector<uint16_t> g = RandomFp16(kLength);
  VectorSink warm(kOffset, kLength);
  ASSERT_TRUE(Step("grouped", 1, g.data(), 5, {1, 0, 0.5f, false, {1e-2f, 1e-3f}}, &warm).ok());
  const std::string before = ReadAll("grouped");
  const Snapshot counters = Take(RangeOf("grouped"));
  struct Case {
    const char* what;
    std::vector<double> group_lr;
    bool skip;
    const char* names;
  };
  const std::vector<Case> cases = {
      {"one lr for two groups", {1e-3f}, false, "1 values but job grouped has 2"},
      {"three lrs for two groups", {1e-3f, 1e-3f, 1e-3f}, false, "3 values"},
      {"NaN lr of group 1", {1e-3f, std::nanf("")}, false, "group_lr[1] (parameter group 1)"},
      {"negative lr of group 0", {-1e-3f, 1e-3f}, false, "group_lr[0] (parameter group 0)"},
      {"inf lr of group 1", {1e-3f, INFINITY}, false, "group_lr[1]"},
      {"checked on a skipped step too", {1e-3f, -1.0f}, true, "group_lr[1]"},
  };
  for (const Case& c : cases) {
    VectorSink sink(kOffset, kLength);
    absl::StatusOr<StepOutcome> r =
        Step("grouped", 2, g.data(), 5, {2, 1e-3f, 0.5f, c.skip, c.group_lr}, &sink);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
        << c.what << ": " << r.status();
    EXPECT_NE(r.status().message().find(c.names), std::string::npos)
        << c.what << ": " << r.status();
    EXPECT_EQ(ReadAll("grouped"), before) << c.what;
    EXPECT_TRUE(Take(RangeOf("grouped")) == counters) << c.what;
  }
  // group_lr given: `lr` is not read (a NaN there is not refused).
  VectorSink sink(kOffset, kLength);
  EXPECT_TRUE(
      Step("grouped", 2, g.data(), 5, {2, std::nanf(""), 0.5f, false, {1e-3f, 0.0f}}, &sink).ok());
}

// --- Range steps: torch's per-parameter skip and step count (StepCommit.range_steps). ---

// A commit with range steps over two groups: a skipped run and two runs with their own t, each
// cut inside a tile, a wave and a SIMD vector, one across the group cut. Every element must be
// what the scalar reference gives piece by piece (skipped: state untouched, output the master
// rounded), and every element no range step covers what a commit without them gives.
TEST_F(ParamGroupTest, RangeStepsSkipOrOverrideTExactly) {
  weights_ = RandomFloats(kLength, 1.0f);
  CreateLoaded(Job("ranged", {{kOffset, kLength}}, TwoGroups()), 0);
  CreateLoaded(Job("plain", {{kOffset, kLength}}, TwoGroups()), 0);
  const double lrs[2] = {1e-2, 4e-3};
  // Two warm-up steps so the moments and the range's t (2) are not trivial.
  for (uint64_t step = 1; step <= 2; ++step) {
    const std::vector<uint16_t> g = RandomFp16(kLength);
    VectorSink a(kOffset, kLength), b(kOffset, kLength);
    const StepCommitArgs args{step, 0, 0.5f, false, {lrs[0], lrs[1]}, {}};
    ASSERT_TRUE(Step("ranged", step, g.data(), 77, args, &a).ok());
    ASSERT_TRUE(Step("plain", step, g.data(), 77, args, &b).ok());
  }
  const RangeState& r = RangeOf("ranged");
  const std::vector<float> p0(r.param, r.param + kLength),
      m0(Fp32(r.exp_avg), Fp32(r.exp_avg) + kLength),
      v0(Fp32(r.exp_avg_sq), Fp32(r.exp_avg_sq) + kLength);

  // Range-relative runs; the range's own t for step 3 is 3.
  struct Run {
    int64_t begin, end;
    uint64_t t;
  };
  const std::vector<Run> runs = {
      {17, 2 * 16 + 5, 1},                           // inside the first vector, t 1
      {kTileElements - 9, kTileElements + 3001, 0},  // skipped, across a tile and a wave
      {kCut - 100, kCut + 101, 2},  // across the group cut, t 2 (B: no bias correction)
      {kLength - 13, kLength, 3},   // the range's own t, spelled out
  };
  StepCommitArgs args{3, 0, 0.5f, false, {lrs[0], lrs[1]}, {}};
  // Two outside the range: clipped away by the shard.
  args.range_steps.push_back(RangeStep{0, kOffset, 0});
  for (const Run& run : runs) {
    args.range_steps.push_back(RangeStep{kOffset + run.begin, run.end - run.begin, run.t});
  }
  args.range_steps.push_back(RangeStep{kOffset + kLength, 1000, 1});
  const std::vector<uint16_t> g = RandomFp16(kLength);
  VectorSink ranged(kOffset, kLength), plain(kOffset, kLength);
  absl::StatusOr<StepOutcome> outcome = Step("ranged", 3, g.data(), kLength / 2, args, &ranged);
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_TRUE(outcome->applied);
  EXPECT_EQ(outcome->adam_step, 3u);  // the range's counters advance as always
  ASSERT_TRUE(
      Step("plain", 3, g.data(), 5, {3, 0, 0.5f, false, {lrs[0], lrs[1]}, {}}, &plain).ok());

  // The reference: the scalar kernel piece by piece on copies of the state before the step.
  std::vector<float> p = p0, m = m0, v = v0;
  std::vector<uint16_t> out(kLength);
  const AdamKernelFn scalar = GetAdamKernel(SimdPath::kScalar);
  auto reference = [&](int64_t b, int64_t e, uint64_t t) {
    for (int k = 0; k < 2; ++k) {
      const int64_t lo = std::max(b, k == 0 ? int64_t{0} : kCut);
      const int64_t hi = std::min(e, k == 0 ? kCut : kLength);
      if (lo >= hi) continue;
      AdamSpan span{g.data() + lo, DType::kFp16,    p.data() + lo, m.data() + lo,
                    v.data() + lo, out.data() + lo, DType::kFp16,  hi - lo};
      scalar(ComputeAdamStepScalars(k == 0 ? A() : B(), lrs[k], static_cast<int64_t>(t), 0.5f),
             span);
    }
  };
  int64_t at = 0;
  for (const Run& run : runs) {
    reference(at, run.begin, 3);
    if (run.t == 0) {
      for (int64_t i = run.begin; i < run.end; ++i) out[i] = FloatToFp16(p[i]);
    } else {
      reference(run.begin, run.end, run.t);
    }
    at = run.end;
  }
  reference(at, kLength, 3);
  EXPECT_EQ(std::memcmp(ranged.out().data(), out.data(), kLength * 2), 0) << "seed " << seed_;
  EXPECT_EQ(std::memcmp(r.param, p.data(), kLength * 4), 0) << "seed " << seed_;
  EXPECT_EQ(std::memcmp(Fp32(r.exp_avg), m.data(), kLength * 4), 0) << "seed " << seed_;
  EXPECT_EQ(std::memcmp(Fp32(r.exp_avg_sq), v.data(), kLength * 4), 0) << "seed " << seed_;

  // Spelled out: the skipped run is untouched, its output its master rounded; an element no run
  // covers, and the run with the range's own t, are the plain job's.
  const RangeState& q = RangeOf("plain");
  const Run& skipped = runs[1];
  for (int64_t i = skipped.begin; i < skipped.end; ++i) {
    ASSERT_EQ(std::memcmp(&r.param[i], &p0[i], 4), 0) << i;
    ASSERT_EQ(std::memcmp(&Fp32(r.exp_avg)[i], &m0[i], 4), 0) << i;
    ASSERT_EQ(std::memcmp(&Fp32(r.exp_avg_sq)[i], &v0[i], 4), 0) << i;
    ASSERT_EQ(ranged.out()[i], FloatToFp16(p0[i])) << i;
  }
  for (int64_t i : {int64_t{0}, int64_t{16}, runs[0].end, skipped.begin - 1, skipped.end,
                    kCut - 101, kCut + 101, kLength - 14, kLength - 13, kLength - 1}) {
    EXPECT_EQ(std::memcmp(&r.param[i], &q.param[i], 4), 0) << i;
    EXPECT_EQ(std::memcmp(&Fp32(r.exp_avg_sq)[i], &Fp32(q.exp_avg_sq)[i], 4), 0) << i;
    EXPECT_EQ(ranged.out()[i], plain.out()[i]) << i;
  }
  // And the overrides did something: t 1 in group A gives other weights than t 3.
  EXPECT_NE(std::memcmp(r.param + runs[0].begin, q.param + runs[0].begin,
                        (runs[0].end - runs[0].begin) * 4),
            0);

  // A replay sends the same parameters whatever range steps it carries.
  VectorSink replay(kOffset, kLength);
  args.range_steps = {RangeStep{kOffset, kLength, 0}};
  absl::StatusOr<StepOutcome> replayed = Step("ranged", 3, g.data(), 9, args, &replay);
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  EXPECT_TRUE(replayed->replayed);
  EXPECT_EQ(replay.out(), ranged.out());
}

// A skipped commit (overflow) applies none of its range steps, and its counters move as always.
TEST_F(ParamGroupTest, SkippedCommitIgnoresRangeSteps) {
  weights_ = RandomFloats(kLength, 1.0f);
  CreateLoaded(Job("ranged", {{kOffset, kLength}}, TwoGroups()), 0);
  const std::string before = ReadAll("ranged");
  VectorSink sink(kOffset, kLength);
  StepCommitArgs args{1, 1e-2, 0.5f, /*skip=*/true, {}, {{kOffset + 10, 100, 1}}};
  absl::StatusOr<StepOutcome> r = Step("ranged", 1, RandomFp16(kLength).data(), 3, args, &sink);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->skipped);
  EXPECT_EQ(r->adam_step, 0u);
  EXPECT_EQ(ReadAll("ranged"), before);
}

TEST_F(ParamGroupTest, BadRangeStepsLeaveTheStateBitIdentical) {
  weights_ = RandomFloats(kLength, 1.0f);
  CreateLoaded(Job("ranged", {{kOffset, kLength}}, TwoGroups()), 0);
  const std::vector<uint16_t> g = RandomFp16(kLength);
  VectorSink warm(kOffset, kLength);
  ASSERT_TRUE(Step("ranged", 1, g.data(), 5, {1, 1e-2, 0.5f, false, {}, {}}, &warm).ok());
  const std::string before = ReadAll("ranged");
  const Snapshot counters = Take(RangeOf("ranged"));
  struct Case {
    const char* what;
    std::vector<RangeStep> steps;
    bool skip;
    const char* names;
  };
  const std::vector<Case> cases = {
      {"empty", {{kOffset + 10, 0, 0}}, false, "range_steps[0] has offset"},
      {"negative length", {{kOffset + 10, -5, 0}}, false, "range_steps[0]"},
      {"negative offset", {{-1, 5, 0}}, false, "range_steps[0]"},
      {"offset + length overflows", {{kOffset, INT64_MAX, 0}}, false, "range_steps[0]"},
      {"overlapping",
       {{kOffset + 10, 20, 0}, {kOffset + 29, 5, 1}},
       false,
       "range_steps[1] starts at 1029, before range_steps[0] ends at 1030"},
      {"out of order", {{kOffset + 50, 5, 0}, {kOffset + 10, 5, 1}}, false, "sorted by offset"},
      {"t past adam_step + 1", {{kOffset + 10, 5, 3}}, false, "has t 3"},
      {"checked on a skipped step too", {{kOffset + 10, 5, 7}}, true, "has t 7"},
      {"checked outside the range too", {{kOffset + kLength + 5, 5, 9}}, false, "has t 9"},
  };
  for (const Case& c : cases) {
    VectorSink sink(kOffset, kLength);
    absl::StatusOr<StepOutcome> r =
        Step("ranged", 2, g.data(), 5, {2, 1e-2, 0.5f, c.skip, {}, c.steps}, &sink);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
        << c.what << ": " << r.status();
    EXPECT_NE(r.status().message().find(c.names), std::string::npos)
        << c.what << ": " << r.status();
    EXPECT_EQ(sink.sends(), 0) << c.what;
    EXPECT_EQ(ReadAll("ranged"), before) << c.what;
    EXPECT_TRUE(Take(RangeOf("ranged")) == counters) << c.what;
  }
  // t == adam_step + 1 is the range's own t: allowed.
  VectorSink sink(kOffset, kLength);
  EXPECT_TRUE(
      Step("ranged", 2, g.data(), 5, {2, 1e-2, 0.5f, false, {}, {{kOffset, 9, 2}}}, &sink).ok());
}

}  // namespace
}  // namespace offload
