// The small parts of the training loop: loss scaling, lr schedule, gradient rounding and
// clipping.
#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "optimizer_client/precision/grad_stats.h"
#include "optimizer_client/precision/loss_scaler.h"
#include "optimizer_client/precision/lr_schedule.h"
#include "optimizer_client/precision/step_policy.h"

namespace offload {
namespace {

TEST(LossScaler, HalvesOnOverflowAndGrowsAfterTheWindow) {
  LossScalerOptions options;
  options.growth_interval = 3;
  DynamicLossScaler scaler(options, /*enabled=*/true);
  EXPECT_EQ(scaler.scale(), 65536.0f);
  scaler.Update(true);
  EXPECT_EQ(scaler.scale(), 32768.0f);
  EXPECT_EQ(scaler.skipped_steps(), 1u);
  scaler.Update(false);
  scaler.Update(false);
  EXPECT_EQ(scaler.scale(), 32768.0f);
  scaler.Update(false);
  EXPECT_EQ(scaler.scale(), 65536.0f);
  // An overflow resets the count of clean steps.
  scaler.Update(false);
  scaler.Update(true);
  scaler.Update(false);
  scaler.Update(false);
  EXPECT_EQ(scaler.scale(), 32768.0f);
  EXPECT_EQ(scaler.skipped_steps(), 2u);
}

TEST(LossScaler, DisabledKeepsOneButCountsSkips) {
  DynamicLossScaler scaler(LossScalerOptions{}, /*enabled=*/false);
  EXPECT_EQ(scaler.scale(), 1.0f);
  scaler.Update(true);
  for (int i = 0; i < 5000; ++i) scaler.Update(false);
  EXPECT_EQ(scaler.scale(), 1.0f);
  EXPECT_EQ(scaler.skipped_steps(), 1u);
}

TEST(LossScaler, StateRoundTripsAndBadStateIsRefused) {
  DynamicLossScaler a(LossScalerOptions{}, true);
  a.Update(true);
  a.Update(false);
  DynamicLossScaler b(LossScalerOptions{}, true);
  ASSERT_TRUE(b.Restore(a.State()).ok());
  EXPECT_EQ(b.State().SerializeAsString(), a.State().SerializeAsString());
  v1::LossScaleState bad = a.State();
  bad.set_scale(NAN);
  EXPECT_FALSE(b.Restore(bad).ok());
  EXPECT_EQ(b.scale(), a.scale());  // unchanged
  DynamicLossScaler bf16(LossScalerOptions{}, false);
  EXPECT_FALSE(bf16.Restore(a.State()).ok());  // a scaled state into a run without scaling
}

TEST(LrSchedule, WarmupThenCosineToTheFloor) {
  v1::LrSchedule s;
  s.set_max_lr(1.0f);
  s.set_min_lr(0.1f);
  s.set_warmup_steps(10);
  s.set_total_steps(110);
  ASSERT_TRUE(ValidateLrSchedule(s).ok());
  EXPECT_FLOAT_EQ(ScheduledLr(s, 1), 0.1f);
  EXPECT_FLOAT_EQ(ScheduledLr(s, 5), 0.5f);
  EXPECT_FLOAT_EQ(ScheduledLr(s, 10), 1.0f);
  EXPECT_FLOAT_EQ(ScheduledLr(s, 60), 0.55f);  // halfway through the cosine
  EXPECT_FLOAT_EQ(ScheduledLr(s, 110), 0.1f);
  EXPECT_FLOAT_EQ(ScheduledLr(s, 500), 0.1f);
  for (uint64_t t = 11; t < 110; ++t) EXPECT_LE(ScheduledLr(s, t + 1), ScheduledLr(s, t));
  s.set_min_lr(2.0f);
  EXPECT_FALSE(ValidateLrSchedule(s).ok());
  s.set_min_lr(0.1f);
  s.set_max_lr(NAN);
  EXPECT_FALSE(ValidateLrSchedule(s).ok());
}

TEST(GradStats, RoundsAndMeasuresWhatLeaves) {
  std::vector<float> g = {0.1f, -2.5f, 3e-8f, 1000.0f, -0.333f};
  std::vector<uint16_t> out(g.size());
  GradStats s = RoundGradients(g.data(), static_cast<int64_t>(g.size()), DType::kFp16, out.data());
  double want = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    EXPECT_EQ(out[i], FloatToFp16(g[i]));
    want += static_cast<double>(Fp16ToFloat(out[i])) * Fp16ToFloat(out[i]);
  }
  EXPECT_DOUBLE_EQ(s.sum_squares, want);
  EXPECT_FALSE(s.nonfinite);
  // 70000 overflows fp16 (an fp16 loss-scaling overflow) but not bf16.
  g.push_back(70000.0f);
  out.resize(g.size());
  EXPECT_TRUE(RoundGradients(g.data(), 6, DType::kFp16, out.data()).nonfinite);
  EXPECT_FALSE(RoundGradients(g.data(), 6, DType::kBf16, out.data()).nonfinite);
  g.push_back(NAN);
  out.resize(g.size());
  EXPECT_TRUE(RoundGradients(g.data(), 7, DType::kBf16, out.data()).nonfinite);
}

TEST(GradStats, ClipCoefficientIsTorchs) {
  EXPECT_FLOAT_EQ(ClipCoefficient(0.5, 1.0f), 1.0f);
  EXPECT_FLOAT_EQ(ClipCoefficient(4.0, 1.0f), static_cast<float>(1.0 / (4.0 + 1e-6)));
  EXPECT_FLOAT_EQ(ClipCoefficient(1e9, 0.0f), 1.0f);  // clipping off
}

TEST(GradStats, MeasuringRoundedGradientsMatchesRoundingThem) {
  std::vector<float> g = {0.1f, -2.5f, 3e-8f, 1000.0f, -0.333f, 70000.0f};
  for (DType dtype : {DType::kFp16, DType::kBf16}) {
    std::vector<uint16_t> out(g.size());
    const GradStats rounded = RoundGradients(g.data(), 6, dtype, out.data());
    const GradStats measured = MeasureGradients16(out.data(), 6, dtype);
    EXPECT_EQ(measured.sum_squares, rounded.sum_squares);
    EXPECT_EQ(measured.nonfinite, rounded.nonfinite);
  }
}

// Every 16-bit value alone, against dtype.h's conversion: the square exact, inf and NaN flagged,
// and the sum a plain sum would give (inf, or NaN over inf). Then all of them at once.
TEST(GradStats, MeasuresEvery16BitValueAsDtypeHConvertsIt) {
  for (DType dtype : {DType::kFp16, DType::kBf16}) {
    std::vector<uint16_t> all(1 << 16);
    double finite_sum = 0;
    bool any_nan = false;
    for (uint32_t h = 0; h < (1u << 16); ++h) {
      all[h] = static_cast<uint16_t>(h);
      const double v = dtype == DType::kFp16 ? Fp16ToFloat(all[h]) : Bf16ToFloat(all[h]);
      const GradStats one = MeasureGradients16(&all[h], 1, dtype);
      ASSERT_EQ(one.nonfinite, !std::isfinite(v)) << DTypeName(dtype) << " " << h;
      if (std::isnan(v)) {
        ASSERT_TRUE(std::isnan(one.sum_squares)) << h;
        any_nan = true;
      } else {
        ASSERT_EQ(one.sum_squares, v * v) << DTypeName(dtype) << " " << h;
        if (std::isfinite(v)) finite_sum += v * v;
      }
    }
    const GradStats whole = MeasureGradients16(all.data(), all.size(), dtype);
    EXPECT_TRUE(whole.nonfinite && any_nan && std::isnan(whole.sum_squares));
    // Only the finite values: their sum, to the rounding of any order of adding them.
    std::vector<uint16_t> finite;
    for (uint16_t h : all) {
      const float v = dtype == DType::kFp16 ? Fp16ToFloat(h) : Bf16ToFloat(h);
      if (std::isfinite(v)) finite.push_back(h);
    }
    const GradStats sum = MeasureGradients16(finite.data(), finite.size(), dtype);
    EXPECT_FALSE(sum.nonfinite);
    EXPECT_NEAR(sum.sum_squares, finite_sum, finite_sum * finite.size() * 0x1p-52);
    const uint16_t inf = dtype == DType::kFp16 ? 0x7c00 : 0x7f80;
    finite.push_back(inf);
    const GradStats with_inf = MeasureGradients16(finite.data(), finite.size(), dtype);
    EXPECT_TRUE(with_inf.nonfinite && std::isinf(with_inf.sum_squares));
  }
}

TEST(StepPolicy, FoldsScaleMicroBatchesAndClipIntoOneMultiplier) {
  StepPolicyOptions options;
  options.loss_scaling = true;
  options.micro_batches = 2;
  options.grad_clip = 1.0f;
  StepPolicy policy(options);
  const float scale = policy.loss_scale();  // 2^16
  // Gradients of norm 4 after unscaling and averaging the two micro-batches.
  const double norm = 4.0 * scale * 2;
  const StepDecision d = policy.Decide(GradStats{norm * norm, false});
  EXPECT_FALSE(d.skip);
  EXPECT_DOUBLE_EQ(d.grad_norm, 4.0);
  EXPECT_EQ(d.clip_coef, ClipCoefficient(4.0, 1.0f));
  EXPECT_EQ(d.grad_multiplier, d.clip_coef / (scale * 2.0f));
  // A per-step max norm overrides the option; 0 turns clipping off.
  EXPECT_EQ(policy.Decide(GradStats{norm * norm, false}, 0.0f).clip_coef, 1.0f);
  EXPECT_EQ(policy.Decide(GradStats{norm * norm, false}, 8.0f).clip_coef, 1.0f);
  // Deciding changes nothing; finishing a skipped step halves the scale.
  EXPECT_EQ(policy.loss_scale(), scale);
  const StepDecision skipped = policy.Decide(GradStats{INFINITY, true});
  EXPECT_TRUE(skipped.skip);
  EXPECT_EQ(skipped.clip_coef, 1.0f);  // no clipping by an inf norm
  EXPECT_EQ(skipped.grad_multiplier, 1.0f / (scale * 2.0f));
  policy.Finish(skipped);
  EXPECT_EQ(policy.loss_scale(), scale / 2);
  EXPECT_EQ(policy.scaler().skipped_steps(), 1u);
}

TEST(StepPolicy, WithoutLossScalingAnOverflowStillSkips) {
  StepPolicy policy(StepPolicyOptions{});  // bf16
  const StepDecision d = policy.Decide(GradStats{NAN, true});
  EXPECT_TRUE(d.skip);
  EXPECT_EQ(d.grad_multiplier, 1.0f);
  policy.Finish(d);
  EXPECT_EQ(policy.loss_scale(), 1.0f);
}

}  // namespace
}  // namespace offload
