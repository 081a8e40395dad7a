// The step engine on the in-process shard engine: its micro-batch mirror is the shards' own sum
// (a step continued from the mirror's sum commits the same bits), a delayed commit holds the
// shards until it is waited for while the loss scale moves at once, and refused calls change
// nothing. The front ends' end-to-end bits are python/tests' and gpu_trainer/train's tests.
#include "optimizer_client/step_engine/step_engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "base/dtype.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"
#include "cpu_optimizer_server/grpc/service_test_util.h"
#include "model_spec/partition.h"
#include "optimizer_client/backends/inprocess_optimizer.h"

namespace offload {
namespace {

constexpr int64_t kParams = 4099;
constexpr char kJob[] = "engine-test";

class StepEngineTest : public ::testing::Test {
 protected:
  StepEngineTest() {
    absl::StatusOr<v1::PartitionMap> map = MakePartitionMap(kParams, 1, 2);
    EXPECT_TRUE(map.ok()) << map.status();
    map_ = *map;
    padded_ = static_cast<int64_t>(map_.padded_length());
  }

  // A fresh job on a fresh in-process backend, and an engine over it.
  std::unique_ptr<StepEngine> Start(DType dtype, bool measure = true) {
    backends_.push_back(std::make_unique<InProcessOptimizer>(map_, 1, BestSimdPath()));
    OptimizerBackend* backend = backends_.back().get();
    EXPECT_TRUE(backend->CreateJob(kJob, TestAdamW(), dtype).ok());
    std::vector<float> master(padded_, 0.0f);
    std::mt19937 rng(3);
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (int64_t i = 0; i < kParams; ++i) master[i] = d(rng);
    EXPECT_TRUE(backend->LoadMasterWeights(master.data()).ok());
    StepEngineOptions options;
    options.dtype = dtype;
    options.policy.loss_scaling = dtype == DType::kFp16;
    options.policy.grad_clip = 1.0f;
    options.measure_gradients = measure;
    absl::StatusOr<std::unique_ptr<StepEngine>> engine = StepEngine::Create(backend, options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return std::move(*engine);
  }

  // (padded,) 16-bit gradients, seeded; the padding zero.
  std::vector<uint16_t> Gradients(DType dtype, uint32_t seed) const {
    std::vector<uint16_t> g(padded_, 0);
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.0f, 0.5f);
    std::vector<float> g32(padded_, 0.0f);
    for (int64_t i = 0; i < kParams; ++i) g32[i] = d(rng);
    ConvertFromFloat(g32.data(), padded_, dtype, g.data());
    return g;
  }

  v1::PartitionMap map_;  // kParams over one rank and two shards
  int64_t padded_ = 0;
  std::vector<std::unique_ptr<InProcessOptimizer>> backends_;
};

TEST_F(StepEngineTest, TheMirrorIsTheShardsSumAndAStepContinuedFromItCommitsTheSameBits) {
  const std::vector<uint16_t> g0 = Gradients(DType::kBf16, 1);
  const std::vector<uint16_t> g1 = Gradients(DType::kBf16, 2);
  // The sum the shards fold: 0 + g0 + g1 in fp32, in micro-batch order.
  std::vector<float> want(padded_, 0.0f);
  AddAsFloat(g0.data(), DType::kBf16, padded_, want.data());
  AddAsFloat(g1.data(), DType::kBf16, padded_, want.data());

  std::unique_ptr<StepEngine> engine = Start(DType::kBf16);
  ASSERT_TRUE(engine->BeginStep(1).ok());
  // The first micro-batch in two pieces from two places, one written where the engine says.
  const int64_t half = padded_ / 2;
  engine->Enqueue(0, half, g0.data());
  uint16_t* buffer = engine->GradientBuffer(half, padded_ - half);
  std::copy(g0.begin() + half, g0.end(), buffer);
  engine->Enqueue(half, padded_ - half, buffer);
  ASSERT_TRUE(engine->NextMicroBatch().ok());
  // After the first micro-batch the engine's own buffer, never a plane's place.
  EXPECT_EQ(engine->GradientBuffer(0, 8), engine->gradients16());
  engine->Enqueue(0, padded_, g1.data());
  std::vector<float> sum(padded_);
  ASSERT_TRUE(engine->ReadGradientSum(0, padded_, sum.data()).ok());
  EXPECT_EQ(0, std::memcmp(sum.data(), want.data(), sum.size() * sizeof(float)));
  absl::StatusOr<GradStats> stats = engine->Drain();
  ASSERT_TRUE(stats.ok()) << stats.status();
  const GradStats want_stats = MeasureGradients32(want.data(), padded_);
  EXPECT_EQ(stats->sum_squares, want_stats.sum_squares);
  std::vector<uint16_t> weights(padded_);
  absl::StatusOr<CommitOutcome> outcome =
      engine->Commit(std::nullopt, -1, 1e-2, {}, weights.data());
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_FALSE(outcome->decision.skip);
  EXPECT_EQ(outcome->counters.adam_step, 1u);
  EXPECT_LT(outcome->decision.clip_coef, 1.0f);  // the sum's norm is far above 1: it clips

  // The same step continued from the mirror's sum on a fresh job: the same decision and bits.
  std::unique_ptr<StepEngine> resumed = Start(DType::kBf16);
  ASSERT_TRUE(resumed->BeginStep(1).ok());
  ASSERT_TRUE(resumed->RestoreGradientSum(sum.data()).ok());
  std::vector<uint16_t> resumed_weights(padded_);
  absl::StatusOr<CommitOutcome> again =
      resumed->Commit(std::nullopt, -1, 1e-2, {}, resumed_weights.data());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->decision.grad_norm, outcome->decision.grad_norm);
  EXPECT_EQ(resumed_weights, weights);
}

TEST_F(StepEngineTest, StatisticsHandedOverOrMeasuredDecideAlike) {
  const std::vector<uint16_t> g = Gradients(DType::kFp16, 5);
  std::unique_ptr<StepEngine> measured = Start(DType::kFp16, /*measure=*/true);
  std::unique_ptr<StepEngine> handed = Start(DType::kFp16, /*measure=*/false);
  ASSERT_TRUE(measured->BeginStep(1).ok());
  ASSERT_TRUE(handed->BeginStep(1).ok());
  measured->Enqueue(0, padded_, g.data());
  handed->Enqueue(0, padded_, g.data());
  handed->AddStats(MeasureGradients16(g.data(), padded_, DType::kFp16));
  absl::StatusOr<StepDecision> a = measured->Preview(std::nullopt);
  absl::StatusOr<StepDecision> b = handed->Preview(std::nullopt);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_GT(a->grad_norm, 0.0);
  EXPECT_EQ(a->grad_norm, b->grad_norm);
  EXPECT_EQ(a->grad_multiplier, b->grad_multiplier);
  // Preview changes nothing: the step is still open and can be committed.
  EXPECT_TRUE(measured->in_step());
}

TEST_F(StepEngineTest, ADelayedCommitHoldsTheShardsUntilWaitedWhileTheLossScaleMovesAtOnce) {
  std::unique_ptr<StepEngine> engine = Start(DType::kFp16);
  const float scale = engine->policy().loss_scale();
  ASSERT_TRUE(engine->BeginStep(1).ok());
  std::vector<uint16_t> g = Gradients(DType::kFp16, 7);
  g[11] = FloatToFp16(std::numeric_limits<float>::infinity());  // an overflow: the step skips
  engine->Enqueue(0, padded_, g.data());
  std::vector<uint16_t> weights(padded_);
  absl::StatusOr<StepDecision> d = engine->CommitAsync(std::nullopt, -1, 1e-2, {}, weights.data());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(d->skip);
  EXPECT_EQ(engine->policy().loss_scale(), scale / 2);  // the next backward uses it
  EXPECT_FALSE(engine->in_step());
  absl::Status refused = engine->BeginStep(2);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  absl::StatusOr<CommitOutcome> outcome = engine->WaitCommit();
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_EQ(outcome->counters.completed_step, 1u);
  EXPECT_EQ(outcome->counters.adam_step, 0u);  // skipped: no update
  EXPECT_EQ(engine->WaitCommit().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(engine->BeginStep(2).ok());
}

TEST_F(StepEngineTest, RefusedCallsChangeNothing) {
  std::unique_ptr<StepEngine> engine = Start(DType::kBf16);
  EXPECT_EQ(engine->BeginStep(0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->Drain().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine->NextMicroBatch().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(engine->BeginStep(1).ok());
  EXPECT_EQ(engine->BeginStep(2).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine->CheckGradientRange(padded_ - 1, 2).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(engine->CheckGradientRange(0, 0).code(), absl::StatusCode::kOutOfRange);
  // Range steps: a good list, then a bad one that leaves the good one in place.
  ASSERT_TRUE(engine->SetRangeSteps({RangeStep{0, 100, 0}}).ok());
  EXPECT_EQ(engine->SetRangeSteps({RangeStep{100, 10, 1}, RangeStep{0, 10, 1}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->SetRangeSteps({RangeStep{0, 10, 2}}).code(),
            absl::StatusCode::kInvalidArgument);  // t past the open step
  const std::vector<uint16_t> g = Gradients(DType::kBf16, 9);
  engine->Enqueue(0, padded_, g.data());
  ASSERT_TRUE(engine->NextMicroBatch().ok());
  EXPECT_EQ(engine->Speculate({1e-2}, {}).code(), absl::StatusCode::kFailedPrecondition);
  engine->Enqueue(0, padded_, g.data());
  std::vector<float> master_before(101);
  ASSERT_TRUE(engine->backend()
                  .ReadRange(v1::STATE_TENSOR_MASTER_WEIGHTS, 0, 101, master_before.data())
                  .ok());
  std::vector<uint16_t> weights(padded_);
  absl::StatusOr<CommitOutcome> outcome =
      engine->Commit(std::nullopt, -1, 1e-2, {}, weights.data());
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  // The range step kept from before the refusals: t 0 leaves [0, 100) as it was, and element
  // 100, which no range step names, is updated.
  std::vector<float> master_after(101);
  ASSERT_TRUE(engine->backend()
                  .ReadRange(v1::STATE_TENSOR_MASTER_WEIGHTS, 0, 101, master_after.data())
                  .ok());
  EXPECT_TRUE(std::equal(master_after.begin(), master_after.begin() + 100, master_before.begin()));
  EXPECT_NE(master_after[100], master_before[100]);
}

}  // namespace
}  // namespace offload
