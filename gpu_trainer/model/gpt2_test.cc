// The whole model: fast vs naive (loss, logits, every gradient), the on_ready contract, finite
// differences (catch a bug both kernel sets share), smaller batches than allocated, and refused
// inputs.
#include "gpu_trainer/model/gpt2.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gpu_trainer/model/model_test_util.h"
#include "gtest/gtest.h"
#include "model_spec/gpt2_config.h"
#include "model_spec/param_layout.h"

namespace offload {
namespace {

using ::testing::HasSubstr;
using testing_util::MaxRelError;
using testing_util::PerturbedParams;
using testing_util::RandomTokens;

// Small and odd: C/NH = 8, T below the context, vocab not a multiple of anything.
Gpt2Config SmallConfig() {
  return Gpt2Config{/*vocab_size=*/53, /*context_length=*/12, /*num_layers=*/3, /*num_heads=*/3,
                    /*channels=*/24};
}
constexpr int kB = 2, kT = 7;

std::unique_ptr<Gpt2Cpu> MakeModel(const Gpt2Config& c, int B, int T, CpuKernelSet set) {
  absl::StatusOr<std::unique_ptr<Gpt2Cpu>> model = Gpt2Cpu::Create(c, B, T, set);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? std::move(*model) : nullptr;
}

struct StepResult {
  float loss = 0.0f;
  std::vector<float> logits;                       // (B, T, V)
  std::vector<float> grads;                        // (num_params,)
  std::vector<std::pair<int64_t, int64_t>> ready;  // on_ready (offset, n) in call order
  std::vector<std::vector<float>> snapshots;       // grads[offset, offset + n) at each call
};

StepResult RunStep(Gpt2Cpu& model, const std::vector<float>& params,
                   const std::vector<int32_t>& inputs, const std::vector<int32_t>& targets, int B,
                   int T, float loss_scale) {
  StepResult r;
  absl::StatusOr<float> loss = model.Forward(params.data(), inputs.data(), targets.data(), B, T);
  EXPECT_TRUE(loss.ok()) << loss.status();
  r.loss = loss.value_or(NAN);
  const int64_t V = model.config().vocab_size;
  r.logits.assign(model.logits(), model.logits() + B * T * V);
  r.grads.assign(model.num_params(), NAN);  // Backward must overwrite every element
  absl::Status s =
      model.Backward(params.data(), loss_scale, r.grads.data(), [&](int64_t offset, int64_t n) {
        r.ready.emplace_back(offset, n);
        r.snapshots.emplace_back(r.grads.begin() + offset, r.grads.begin() + offset + n);
      });
  EXPECT_TRUE(s.ok()) << s;
  return r;
}

void ExpectGradsClose(const Gpt2Config& c, const std::vector<float>& got,
                      const std::vector<float>& want, double tol) {
  for (const ParamTensor& t : Gpt2ParamLayout(c)) {
    const double err = MaxRelError(got.data() + t.offset, want.data() + t.offset, t.numel);
    EXPECT_LE(err, tol) << t.name;
  }
}

// The two kernel sets sum every product in another order (BLAS's blocking and FMAs against plain
// loops), so they differ by fp32 order noise, not a fixed amount: measured 3.7e-7 to 4.1e-7 on the
// logits and 5.4e-7 to 6.8e-7 on the worst gradient tensor (relative to its largest element)
// with OpenBLAS's own choice on an AVX-512 machine and each of its x86-64 kernel families forced
// (OPENBLAS_CORETYPE = Haswell, SkylakeX, Zen, Sandybridge, Nehalem, Prescott). The bound is 15x
// the largest; a wrong formula or index in either set is orders of magnitude above it.
TEST(Gpt2Cpu, FastMatchesNaive) {
  const Gpt2Config c = SmallConfig();
  const std::vector<float> params = PerturbedParams(c, 1);
  const std::vector<int32_t> inputs = RandomTokens(kB * kT, c.vocab_size, 2);
  const std::vector<int32_t> targets = RandomTokens(kB * kT, c.vocab_size, 3);
  std::unique_ptr<Gpt2Cpu> naive = MakeModel(c, kB, kT, CpuKernelSet::kNaive);
  std::unique_ptr<Gpt2Cpu> fast = MakeModel(c, kB, kT, CpuKernelSet::kFast);
  ASSERT_TRUE(naive && fast);
  const StepResult n = RunStep(*naive, params, inputs, targets, kB, kT, 3.0f);
  const StepResult f = RunStep(*fast, params, inputs, targets, kB, kT, 3.0f);
  EXPECT_NEAR(f.loss, n.loss, 1e-5 * n.loss);
  EXPECT_LE(MaxRelError(f.logits, n.logits), 1e-5);
  ExpectGradsClose(c, f.grads, n.grads, 1e-5);
}

// Activation checkpointing recomputes each block's forward inside backward with the same kernels
// on the same inputs: the same bits, for both kernel sets, a smaller batch than allocated, and
// two steps in a row (the recompute must not leave anything the next Forward reads). It keeps
// one layer's activations where a plain model keeps L.
TEST(Gpt2Cpu, ActivationCheckpointingIsBitIdentical) {
  const Gpt2Config c = SmallConfig();
  const std::vector<float> params = PerturbedParams(c, 1);
  for (const CpuKernelSet set : {CpuKernelSet::kFast, CpuKernelSet::kNaive}) {
    std::unique_ptr<Gpt2Cpu> plain = MakeModel(c, kB, kT, set);
    absl::StatusOr<std::unique_ptr<Gpt2Cpu>> checkpointed =
        Gpt2Cpu::Create(c, kB, kT, set, /*activation_checkpointing=*/true);
    ASSERT_TRUE(plain && checkpointed.ok());
    EXPECT_TRUE((*checkpointed)->activation_checkpointing());
    EXPECT_LT((*checkpointed)->activation_bytes(), plain->activation_bytes());
    for (const int B : {kB, 1}) {
      for (int round = 0; round < 2; ++round) {
        const std::vector<int32_t> inputs = RandomTokens(B * kT, c.vocab_size, 2 + round);
        const std::vector<int32_t> targets = RandomTokens(B * kT, c.vocab_size, 5 + round);
        const StepResult want = RunStep(*plain, params, inputs, targets, B, kT, 3.0f);
        const StepResult got = RunStep(**checkpointed, params, inputs, targets, B, kT, 3.0f);
        EXPECT_EQ(got.loss, want.loss);
        EXPECT_EQ(0, std::memcmp(got.logits.data(), want.logits.data(), want.logits.size() * 4));
        EXPECT_EQ(0, std::memcmp(got.grads.data(), want.grads.data(), want.grads.size() * 4))
            << "B=" << B << " round " << round;
        EXPECT_EQ(got.ready, want.ready);
      }
    }
  }
}

// on_ready: [ln_f], [h.{L-1}], ..., [h.0], then [wte, wpe], contiguous, covering every element
// once, and each range already final when reported.
TEST(Gpt2Cpu, OnReadyOrderCoverageAndFinality) {
  const Gpt2Config c = SmallConfig();
  const int L = c.num_layers;
  const std::vector<float> params = PerturbedParams(c, 4);
  const std::vector<int32_t> inputs = RandomTokens(kB * kT, c.vocab_size, 5);
  const std::vector<int32_t> targets = RandomTokens(kB * kT, c.vocab_size, 6);
  std::vector<std::pair<int64_t, int64_t>> expected;
  expected.emplace_back(Gpt2LayerOffset(c, L), Gpt2NumParams(c) - Gpt2LayerOffset(c, L));
  for (int l = L - 1; l >= 0; l--) {
    expected.emplace_back(Gpt2LayerOffset(c, l), Gpt2LayerOffset(c, l + 1) - Gpt2LayerOffset(c, l));
  }
  expected.emplace_back(0, Gpt2LayerOffset(c, 0));

  for (const CpuKernelSet set : {CpuKernelSet::kNaive, CpuKernelSet::kFast}) {
    std::unique_ptr<Gpt2Cpu> model = MakeModel(c, kB, kT, set);
    ASSERT_TRUE(model);
    const StepResult r = RunStep(*model, params, inputs, targets, kB, kT, 1.0f);
    EXPECT_EQ(r.ready, expected);
    std::vector<int> covered(model->num_params(), 0);
    for (size_t i = 0; i < r.ready.size(); i++) {
      const auto [offset, n] = r.ready[i];
      for (int64_t j = offset; j < offset + n; j++) covered[j]++;
      EXPECT_EQ(std::memcmp(r.snapshots[i].data(), r.grads.data() + offset, n * sizeof(float)), 0)
          << "range " << i << " changed after it was reported";
    }
    EXPECT_TRUE(std::all_of(covered.begin(), covered.end(), [](int k) { return k == 1; }));
    for (float g : r.grads) ASSERT_TRUE(std::isfinite(g));
  }
}

TEST(Gpt2Cpu, GradientsScaleWithLossScaleAndOverwrite) {
  const Gpt2Config c = SmallConfig();
  const std::vector<float> params = PerturbedParams(c, 7);
  const std::vector<int32_t> inputs = RandomTokens(kB * kT, c.vocab_size, 8);
  const std::vector<int32_t> targets = RandomTokens(kB * kT, c.vocab_size, 9);
  std::unique_ptr<Gpt2Cpu> model = MakeModel(c, kB, kT, CpuKernelSet::kFast);
  ASSERT_TRUE(model);
  const StepResult one = RunStep(*model, params, inputs, targets, kB, kT, 1.0f);
  const StepResult big = RunStep(*model, params, inputs, targets, kB, kT, 1024.0f);
  std::vector<float> scaled(one.grads);
  for (float& g : scaled) g *= 1024.0f;  // a power of two: exact in both
  EXPECT_LE(MaxRelError(big.grads, scaled), 1e-6);
}

// Finite differences of the naive model's fp32 loss (combined in double) on a tiny model: a bug
// both kernel sets share (a wrong formula rather than a wrong optimisation) shows here and
// nowhere else. For each tensor: its largest-gradient element and two seeded random ones.
TEST(Gpt2Cpu, GradientsMatchFiniteDifferences) {
  const Gpt2Config c{/*vocab_size=*/11, /*context_length=*/6, /*num_layers=*/2, /*num_heads=*/2,
                     /*channels=*/8};
  const int B = 2, T = 5;
  std::vector<float> params = PerturbedParams(c, 10);
  const std::vector<int32_t> inputs = RandomTokens(B * T, c.vocab_size, 11);
  const std::vector<int32_t> targets = RandomTokens(B * T, c.vocab_size, 12);
  std::unique_ptr<Gpt2Cpu> model = MakeModel(c, B, T, CpuKernelSet::kNaive);
  ASSERT_TRUE(model);
  const StepResult r = RunStep(*model, params, inputs, targets, B, T, 1.0f);
  auto loss_at = [&](int64_t i, float value) {
    const float saved = params[i];
    params[i] = value;
    const double loss = *model->Forward(params.data(), inputs.data(), targets.data(), B, T);
    params[i] = saved;
    return loss;
  };
  testing_util::TestRng rng(13);
  double worst = 0.0;
  for (const ParamTensor& t : Gpt2ParamLayout(c)) {
    int64_t largest = t.offset;
    for (int64_t i = t.offset; i < t.offset + t.numel; i++) {
      if (std::fabs(r.grads[i]) > std::fabs(r.grads[largest])) largest = i;
    }
    for (const int64_t i : {largest, t.offset + rng.Int(static_cast<int32_t>(t.numel)),
                            t.offset + rng.Int(static_cast<int32_t>(t.numel))}) {
      // Five-point stencil: truncation error O(h^4), negligible at h = 1e-2, so what is left
      // is the fp32 rounding of the losses (~2.4e-7 each, ~2e-5 in fd at most).
      const float x = params[i], h = 1e-2f;
      const double fd = (8.0 * (loss_at(i, x + h) - loss_at(i, x - h)) -
                         (loss_at(i, x + 2 * h) - loss_at(i, x - 2 * h))) /
                        (12.0 * h);
      EXPECT_NEAR(r.grads[i], fd, 5e-5 + 1e-3 * std::fabs(fd)) << t.name << " element " << i;
      worst = std::max(worst, std::fabs(r.grads[i] - fd));
    }
  }
  RecordProperty("worst_abs_error", testing_util::Sci(worst));
}

// A model allocated for (2, 7) run at (1, 3) packs the smaller batch densely: same numbers as a
// model allocated for exactly (1, 3).
TEST(Gpt2Cpu, SmallerBatchThanAllocated) {
  const Gpt2Config c = SmallConfig();
  const std::vector<float> params = PerturbedParams(c, 14);
  const std::vector<int32_t> inputs = RandomTokens(3, c.vocab_size, 15);
  const std::vector<int32_t> targets = RandomTokens(3, c.vocab_size, 16);
  std::unique_ptr<Gpt2Cpu> big = MakeModel(c, kB, kT, CpuKernelSet::kFast);
  std::unique_ptr<Gpt2Cpu> exact = MakeModel(c, 1, 3, CpuKernelSet::kFast);
  ASSERT_TRUE(big && exact);
  // Run a full-size step first, so stale activations are there to be (wrongly) picked up.
  RunStep(*big, params, RandomTokens(kB * kT, c.vocab_size, 17),
          RandomTokens(kB * kT, c.vocab_size, 18), kB, kT, 1.0f);
  const StepResult a = RunStep(*big, params, inputs, targets, 1, 3, 1.0f);
  const StepResult b = RunStep(*exact, params, inputs, targets, 1, 3, 1.0f);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.logits, b.logits);
  EXPECT_EQ(a.grads, b.grads);
}

TEST(Gpt2Cpu, LogitsOnlyForward) {
  const Gpt2Config c = SmallConfig();
  const std::vector<float> params = PerturbedParams(c, 19);
  const std::vector<int32_t> inputs = RandomTokens(kB * kT, c.vocab_size, 20);
  const std::vector<int32_t> targets = RandomTokens(kB * kT, c.vocab_size, 21);
  std::unique_ptr<Gpt2Cpu> model = MakeModel(c, kB, kT, CpuKernelSet::kFast);
  ASSERT_TRUE(model);
  std::vector<float> grads(model->num_params());
  EXPECT_EQ(model->Backward(params.data(), 1.0f, grads.data(), nullptr).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(model->Forward(params.data(), inputs.data(), targets.data(), kB, kT).ok());
  const int64_t n = int64_t{kB} * kT * c.vocab_size;
  const std::vector<float> with_targets(model->logits(), model->logits() + n);
  absl::StatusOr<float> loss = model->Forward(params.data(), inputs.data(), nullptr, kB, kT);
  ASSERT_TRUE(loss.ok());
  EXPECT_EQ(*loss, 0.0f);
  EXPECT_EQ(std::vector<float>(model->logits(), model->logits() + n), with_targets);
  EXPECT_EQ(model->Backward(params.data(), 1.0f, grads.data(), nullptr).code(),
            absl::StatusCode::kFailedPrecondition);
}

// Refused calls compute nothing: the last good Forward's logits stay, and a Backward still
// returns that step's gradients.
TEST(Gpt2Cpu, BadInputsAreRefusedAndChangeNothing) {
  const Gpt2Config c = SmallConfig();
  const std::vector<float> params = PerturbedParams(c, 22);
  const std::vector<int32_t> inputs = RandomTokens(kB * kT, c.vocab_size, 23);
  const std::vector<int32_t> targets = RandomTokens(kB * kT, c.vocab_size, 24);
  std::unique_ptr<Gpt2Cpu> model = MakeModel(c, kB, kT, CpuKernelSet::kFast);
  ASSERT_TRUE(model);
  const StepResult good = RunStep(*model, params, inputs, targets, kB, kT, 1.0f);
  ASSERT_TRUE(model->Forward(params.data(), inputs.data(), targets.data(), kB, kT).ok());

  std::vector<int32_t> bad_inputs = inputs;
  bad_inputs[1 * kT + 3] = c.vocab_size;  // (b=1, t=3)
  std::vector<int32_t> bad_targets = targets;
  bad_targets[5] = -1;  // (b=0, t=5)
  const std::vector<int32_t> other = RandomTokens(kB * kT, c.vocab_size, 25);

  absl::StatusOr<float> r = model->Forward(params.data(), bad_inputs.data(), other.data(), kB, kT);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("inputs[b=1, t=3] = 53"));
  r = model->Forward(params.data(), other.data(), bad_targets.data(), kB, kT);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("targets[b=0, t=5] = -1"));
  for (const auto& [B, T] :
       {std::pair{kB + 1, kT}, std::pair{kB, kT + 1}, std::pair{0, kT}, std::pair{kB, 0}}) {
    r = model->Forward(params.data(), other.data(), other.data(), B, T);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << B << "x" << T;
  }
  EXPECT_EQ(model->Forward(nullptr, other.data(), nullptr, kB, kT).status().code(),
            absl::StatusCode::kInvalidArgument);

  const int64_t n = int64_t{kB} * kT * c.vocab_size;
  EXPECT_EQ(std::vector<float>(model->logits(), model->logits() + n), good.logits);
  std::vector<float> grads(model->num_params());
  ASSERT_TRUE(model->Backward(params.data(), 1.0f, grads.data(), nullptr).ok());
  EXPECT_EQ(grads, good.grads);
  EXPECT_EQ(model->Backward(params.data(), INFINITY, grads.data(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(model->Backward(params.data(), 1.0f, nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Gpt2Cpu, CreateRefusesBadSizes) {
  const Gpt2Config c = SmallConfig();
  EXPECT_EQ(Gpt2Cpu::Create(c, 1, c.context_length + 1, CpuKernelSet::kFast).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Gpt2Cpu::Create(c, 0, 4, CpuKernelSet::kFast).status().code(),
            absl::StatusCode::kInvalidArgument);
  Gpt2Config bad = c;
  bad.num_heads = 5;
  absl::StatusOr<std::unique_ptr<Gpt2Cpu>> m = Gpt2Cpu::Create(bad, 1, 4, CpuKernelSet::kFast);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("channels"));
  // 2^24 tokens of GPT-2 XL-sized attention do not fit anywhere: refused, not attempted.
  const Gpt2Config xl{50257, 1024, 48, 25, 1600};
  EXPECT_EQ(Gpt2Cpu::Create(xl, 16384, 1024, CpuKernelSet::kFast).status().code(),
            absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace offload
