// The shard's rules without gRPC: job creation, loads, step sessions (order, replay, skip,
// accumulation) and that every refused input leaves the state bit-identical.
#include "cpu_optimizer_server/shard/shard_store.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "cpu_optimizer_server/shard/state_loader.h"
#include "cpu_optimizer_server/shard/step_session.h"

namespace offload {
namespace {

// Collects streamed parameters into one vector indexed by flat offset - base.
class VectorSink : public ParamSink {
 public:
  VectorSink(int64_t base, int64_t n) : base_(base), out_(n, 0xdead) {}
  void* Buffer(int slot, int64_t offset, int64_t n) override {
    slots_[slot] = {offset, n};
    buffers_[slot].assign(n, 0);
    return buffers_[slot].data();
  }
  bool Send(int slot) override {
    ++sends_;
    if (refuse_after_ >= 0 && sends_ > refuse_after_) return false;
    std::memcpy(&out_[slots_[slot].first - base_], buffers_[slot].data(), slots_[slot].second * 2);
    return true;
  }
  const std::vector<uint16_t>& out() const { return out_; }
  int sends() const { return sends_; }
  void RefuseAfter(int n) { refuse_after_ = n; }

 private:
  int64_t base_;
  std::vector<uint16_t> out_;
  std::vector<uint16_t> buffers_[2];
  std::pair<int64_t, int64_t> slots_[2];
  int sends_ = 0;
  int refuse_after_ = -1;
};

std::string Bytes(const void* p, size_t n) { return std::string(static_cast<const char*>(p), n); }

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
  s.m.assign(r.exp_avg, r.exp_avg + n);
  s.v.assign(r.exp_avg_sq, r.exp_avg_sq + n);
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
    ASSERT_EQ(std::memcmp(r.exp_avg, m.data(), kLength * 4), 0);
    ASSERT_EQ(std::memcmp(r.exp_avg_sq, v.data(), kLength * 4), 0);
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

}  // namespace
}  // namespace offload
