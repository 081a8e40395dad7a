// The CUDA GPT-2 against the CPU backend, its reference: loss and every parameter gradient in
// fp32, fp16 and bf16 within a noise floor measured in the test, the gradient ranges streamed to
// the host through the pinned ring, the statistics that leave with them, bad input, and a short
// training run on the GPU-resident AdamW whose loss falls. Every test skips without a GPU.
#include "gpu_trainer/cuda/gpt2_cuda.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/logging.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"
#include "gpu_trainer/cuda/optim/gpu_adamw.h"
#include "gpu_trainer/cuda/runtime/cuda_test_util.h"
#include "gpu_trainer/cuda/runtime/transfer_schedule.h"
#include "gpu_trainer/model/gpt2.h"
#include "gpu_trainer/model/model_test_util.h"
#include "gtest/gtest.h"
#include "model_spec/param_layout.h"

namespace offload {
namespace {

using testing_util::MaxRelError;
using testing_util::PerturbedParams;
using testing_util::RandomTokens;
using testing_util::Sci;

// Odd sizes on purpose: V not a multiple of 64 (padded logit rows), T not a power of two, a
// head size of 16, a batch smaller than allocated in one test.
Gpt2Config SmallConfig() { return Gpt2Config{101, 40, 2, 3, 48}; }
constexpr int kBatch = 3;
constexpr int kSeq = 17;

struct CpuResult {
  float loss = 0;
  std::vector<float> grads;
};

CpuResult CpuReferenceAt(const Gpt2Config& c, const std::vector<float>& params,
                         const std::vector<int32_t>& inputs, const std::vector<int32_t>& targets,
                         float loss_scale, int B, int T) {
  auto model = Gpt2Cpu::Create(c, kBatch, kSeq, CpuKernelSet::kNaive);
  EXPECT_TRUE(model.ok()) << model.status();
  CpuResult r;
  r.grads.assign(params.size(), 0.0f);
  auto loss = (*model)->Forward(params.data(), inputs.data(), targets.data(), B, T);
  EXPECT_TRUE(loss.ok()) << loss.status();
  r.loss = loss.value_or(NAN);
  EXPECT_TRUE((*model)->Backward(params.data(), loss_scale, r.grads.data(), nullptr).ok());
  return r;
}

// The weights as the storage type holds them, so the CPU reference computes on the same values.
std::vector<float> RoundParams(const std::vector<float>& params, DType dtype) {
  return DispatchStorageType(dtype, [&](auto zero) {
    using T = decltype(zero);
    std::vector<float> out(params.size());
    for (size_t i = 0; i < params.size(); ++i) out[i] = HostToFloat<T>(HostFromFloat<T>(params[i]));
    return out;
  });
}

// The format's unit roundoff: half the distance from 1 to the next value.
double UnitRoundoff(DType dtype) {
  switch (dtype) {
    case DType::kFp32:
      return 0x1p-24;  // a draw in [-u, u] then rounded to fp32 moves about half the weights
    case DType::kFp16:
      return 0x1p-11;
    case DType::kBf16:
      return 0x1p-8;
  }
  return 0;
}

// Every value times (1 + d), d uniform in [-u, u]: one rounding of the format, at random, on
// every weight.
std::vector<float> OneRoundingApart(const std::vector<float>& params, double u, uint64_t seed) {
  testing_util::TestRng rng(seed);
  std::vector<float> out(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    out[i] = static_cast<float>(params[i] * (1.0 + rng.Uniform(-u, u)));
  }
  return out;
}

class Gpt2CudaParity : public ::testing::TestWithParam<DType> {};

// The bounds of Gpt2CudaParity, from a noise floor measured in the test: how far the fp32 CPU
// reference itself moves when every weight takes one rounding of the format (the largest of
// kFloorDraws draws, per tensor and for the loss). The GPU rounds every activation and gradient
// of the way as well; on the H100 (2026-11-27, one draw per floor) it sat at 0.3-2.8 floors in
// fp16, 0.4-1.7 in bf16 and 0.6-1.8 in fp32 (summation order only) over every tensor and the
// loss. kSpread is 3x the largest, rounded up. An error in a kernel is far above it: a missed
// bias or a wrong index moves a gradient by its own size, 100-1000 floors.
constexpr double kSpread = 10;
constexpr int kFloorDraws = 3;

// What a GPU run must match: the CPU reference at (B, T), and the floors above, from kFloorDraws
// draws seeded from floor_seed. The loss is a mean over n = B T tokens in fp32: any order of that
// sum may move it by 2 (n - 1) u (Higham 4.2), which the fp32 case's floor could otherwise fall
// below.
struct ParityReference {
  CpuResult ref;
  double loss_floor = 0;
  std::vector<double> grad_floor;  // per tensor of Gpt2ParamLayout
};

ParityReference MeasureParityReference(const Gpt2Config& c, DType dtype,
                                       const std::vector<float>& params,
                                       const std::vector<int32_t>& inputs,
                                       const std::vector<int32_t>& targets, float loss_scale, int B,
                                       int T, uint64_t floor_seed) {
  ParityReference p;
  p.ref = CpuReferenceAt(c, params, inputs, targets, loss_scale, B, T);
  const std::vector<ParamTensor> layout = Gpt2ParamLayout(c);
  p.loss_floor = 2.0 * (B * T - 1) * 0x1p-24;
  p.grad_floor.assign(layout.size(), 0.0);
  for (int draw = 0; draw < kFloorDraws; ++draw) {
    const CpuResult moved =
        CpuReferenceAt(c, OneRoundingApart(params, UnitRoundoff(dtype), floor_seed + draw), inputs,
                       targets, loss_scale, B, T);
    p.loss_floor =
        std::max(p.loss_floor, std::fabs(double{moved.loss} - p.ref.loss) / std::fabs(p.ref.loss));
    for (size_t k = 0; k < layout.size(); ++k) {
      const ParamTensor& t = layout[k];
      p.grad_floor[k] = std::max(
          p.grad_floor[k],
          MaxRelError(moved.grads.data() + t.offset, p.ref.grads.data() + t.offset, t.numel));
    }
  }
  return p;
}

struct CudaRun {
  float loss = NAN;
  std::vector<float> grads;  // (num_params,)
  CudaGradStats stats;
};

// One forward and backward of `m` at (B, T), its loss and every gradient widened to fp32.
CudaRun ForwardBackward(Gpt2Cuda& m, const std::vector<int32_t>& inputs,
                        const std::vector<int32_t>& targets, float loss_scale, int B, int T) {
  CudaRun r;
  auto loss = m.Forward(inputs.data(), targets.data(), B, T);
  EXPECT_TRUE(loss.ok()) << loss.status();
  r.loss = loss.value_or(NAN);
  auto stats = m.Backward(loss_scale, nullptr, nullptr);
  EXPECT_TRUE(stats.ok()) << stats.status();
  if (stats.ok()) r.stats = *stats;
  r.grads.assign(m.num_params(), NAN);
  EXPECT_TRUE(m.CopyGradsToHost(r.grads.data()).ok());
  return r;
}

// The loss and every gradient tensor of `got` within kSpread floors of the reference; each margin
// printed (as "margin WHAT ..." lines, which the GPU logs keep), with `beside`'s error (another
// path of the same model, e.g. the unfused one) next to it where given.
void ExpectWithinFloors(const std::string& what, const Gpt2Config& c, const ParityReference& p,
                        const CudaRun& got, const CudaRun* beside = nullptr) {
  auto loss_err = [&](const CudaRun& r) {
    return std::fabs(double{r.loss} - p.ref.loss) / std::fabs(p.ref.loss);
  };
  std::printf("margin %s loss err=%.3e%s floor=%.3e floors=%.1f bound=%.0f floors\n", what.c_str(),
              loss_err(got),
              beside ? absl::StrFormat(" (beside %.3e)", loss_err(*beside)).c_str() : "",
              p.loss_floor, loss_err(got) / p.loss_floor, kSpread);
  EXPECT_LE(loss_err(got), kSpread * p.loss_floor) << what;
  EXPECT_FALSE(got.stats.nonfinite) << what;
  const std::vector<ParamTensor> layout = Gpt2ParamLayout(c);
  ASSERT_EQ(got.grads.size(), p.ref.grads.size()) << what;
  for (size_t k = 0; k < layout.size(); ++k) {
    const ParamTensor& t = layout[k];
    auto err = [&](const CudaRun& r) {
      return MaxRelError(r.grads.data() + t.offset, p.ref.grads.data() + t.offset, t.numel);
    };
    ASSERT_GT(p.grad_floor[k], 0.0) << t.name << ": a floor of zero would demand the same bits";
    EXPECT_LE(err(got), kSpread * p.grad_floor[k]) << t.name << " " << what;
    std::printf("margin %s %s err=%.3e%s floor=%.3e floors=%.1f bound=%.0f floors\n", what.c_str(),
                t.name.c_str(), err(got),
                beside ? absl::StrFormat(" (beside %.3e)", err(*beside)).c_str() : "",
                p.grad_floor[k], err(got) / p.grad_floor[k], kSpread);
  }
}

TEST_P(Gpt2CudaParity, LossAndGradientsMatchTheCpuBackend) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  const DType dtype = GetParam();
  const std::string name(DTypeName(dtype));
  const Gpt2Config c = SmallConfig();
  const std::vector<float> params = RoundParams(PerturbedParams(c, 11), dtype);
  const std::vector<int32_t> inputs = RandomTokens(kBatch * kSeq, c.vocab_size, 12);
  const std::vector<int32_t> targets = RandomTokens(kBatch * kSeq, c.vocab_size, 13);
  const float loss_scale = dtype == DType::kFp16 ? 1024.0f : 1.0f;
  const ParityReference p =
      MeasureParityReference(c, dtype, params, inputs, targets, loss_scale, kBatch, kSeq, 14);

  CudaModelOptions options;
  options.dtype = dtype;
  auto model = Gpt2Cuda::Create(c, kBatch, kSeq, options);
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_TRUE((*model)->SetParams(params.data()).ok());
  const CudaRun got = ForwardBackward(**model, inputs, targets, loss_scale, kBatch, kSeq);
  ExpectWithinFloors(name, c, p, got);
  // The statistics are those of the stored gradients.
  double sum_squares = 0;
  for (float g : got.grads) sum_squares += double{g} * g;
  EXPECT_NEAR(got.stats.sum_squares, sum_squares, 1e-6 * sum_squares);
}

INSTANTIATE_TEST_SUITE_P(AllStorageTypes, Gpt2CudaParity,
                         ::testing::Values(DType::kFp32, DType::kFp16, DType::kBf16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

// The fused cuBLASLt epilogues (CudaModelOptions::fused_epilogues: the MLP's GELU in its first
// product, the GELU's backward and the bias gradients in the backward products) against the CPU
// backend, in the 16-bit modes that use them, with Gpt2CudaParity's floors and bound; the unfused
// model (the reference path) runs too and is printed beside it, so a GPU log shows what fusing
// changed per tensor.
class Gpt2CudaEpilogueParity : public ::testing::TestWithParam<DType> {};

TEST_P(Gpt2CudaEpilogueParity, FusedEpiloguesMatchTheCpuBackend) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  const DType dtype = GetParam();
  const std::string name(DTypeName(dtype));
  const Gpt2Config c = SmallConfig();
  const std::vector<float> params = RoundParams(PerturbedParams(c, 31), dtype);
  const std::vector<int32_t> inputs = RandomTokens(kBatch * kSeq, c.vocab_size, 32);
  const std::vector<int32_t> targets = RandomTokens(kBatch * kSeq, c.vocab_size, 33);
  const float loss_scale = dtype == DType::kFp16 ? 1024.0f : 1.0f;
  const ParityReference p =
      MeasureParityReference(c, dtype, params, inputs, targets, loss_scale, kBatch, kSeq, 34);
  auto run = [&](bool fused) -> CudaRun {
    CudaModelOptions options;
    options.dtype = dtype;
    options.fused_epilogues = fused;
    auto model = Gpt2Cuda::Create(c, kBatch, kSeq, options);
    EXPECT_TRUE(model.ok()) << model.status();
    if (!model.ok()) return CudaRun{};
    EXPECT_TRUE((*model)->SetParams(params.data()).ok());
    return ForwardBackward(**model, inputs, targets, loss_scale, kBatch, kSeq);
  };
  const CudaRun fused = run(true);
  const CudaRun unfused = run(false);
  ExpectWithinFloors(name + " fused (beside: unfused)", c, p, fused, &unfused);
}

INSTANTIATE_TEST_SUITE_P(SixteenBit, Gpt2CudaEpilogueParity,
                         ::testing::Values(DType::kFp16, DType::kBf16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

CudaRun RunCuda(const Gpt2Config& c, DType dtype, bool checkpointing,
                const std::vector<float>& params, const std::vector<int32_t>& inputs,
                const std::vector<int32_t>& targets, float loss_scale) {
  CudaModelOptions options;
  options.dtype = dtype;
  options.activation_checkpointing = checkpointing;
  auto model = Gpt2Cuda::Create(c, kBatch, kSeq, options);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return CudaRun{};
  EXPECT_TRUE((*model)->SetParams(params.data()).ok());
  return ForwardBackward(**model, inputs, targets, loss_scale, kBatch, kSeq);
}

double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::fabs(double{a[i]} - b[i]));
  return d;
}

// Activation checkpointing recomputes each block's forward with the same kernels on the same
// inputs. Where the GPU's kernels are deterministic (two plain runs give the same bits, the noise
// floor measured here) the checkpointed run must give those bits too; where they are not, it may
// differ from a plain run by no more than two plain runs differ from each other, with a margin of
// 2x for the draw.
class Gpt2CudaCheckpointing : public ::testing::TestWithParam<DType> {};

TEST_P(Gpt2CudaCheckpointing, RecomputedBlocksGiveThePlainGradients) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  const DType dtype = GetParam();
  const Gpt2Config c = Gpt2Config{101, 40, 3, 3, 48};  // three blocks: two are recomputed
  const std::vector<float> params = RoundParams(PerturbedParams(c, 21), dtype);
  const std::vector<int32_t> inputs = RandomTokens(kBatch * kSeq, c.vocab_size, 22);
  const std::vector<int32_t> targets = RandomTokens(kBatch * kSeq, c.vocab_size, 23);
  const float loss_scale = dtype == DType::kFp16 ? 1024.0f : 1.0f;
  const CudaRun plain1 = RunCuda(c, dtype, false, params, inputs, targets, loss_scale);
  const CudaRun plain2 = RunCuda(c, dtype, false, params, inputs, targets, loss_scale);
  const CudaRun checkpointed = RunCuda(c, dtype, true, params, inputs, targets, loss_scale);
  const double floor = MaxAbsDiff(plain1.grads, plain2.grads);
  const double diff = MaxAbsDiff(checkpointed.grads, plain1.grads);
  RecordProperty("plain_vs_plain", Sci(floor));
  RecordProperty("checkpointed_vs_plain", Sci(diff));
  EXPECT_EQ(checkpointed.loss, plain1.loss);  // the forward is the same code either way
  if (floor == 0) {
    EXPECT_EQ(diff, 0) << "deterministic kernels, so the same bits";
  } else {
    EXPECT_LE(diff, 2 * floor);
  }
}

INSTANTIATE_TEST_SUITE_P(AllStorageTypes, Gpt2CudaCheckpointing,
                         ::testing::Values(DType::kFp32, DType::kFp16, DType::kBf16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

TEST(Gpt2Cuda, StreamsGradientRangesToTheHostInBackwardOrder) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  const Gpt2Config c = SmallConfig();
  const std::vector<float> params = PerturbedParams(c, 21);
  const std::vector<int32_t> inputs = RandomTokens(kBatch * kSeq, c.vocab_size, 22);
  CudaModelOptions options;
  options.dtype = DType::kBf16;
  // A ring far smaller than one layer, so slots are reused within a range.
  options.staging.budget_bytes = 2 * 4096;
  options.staging.chunk_bytes = 4096;
  auto model = Gpt2Cuda::Create(c, kBatch, kSeq, options);
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_TRUE((*model)->SetParams(params.data()).ok());
  ASSERT_TRUE((*model)->Forward(inputs.data(), inputs.data(), kBatch, kSeq).ok());

  const int64_t n = (*model)->num_params();
  std::vector<uint16_t> host(n, 0xffff);
  std::mutex mu;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  auto stats = (*model)->Backward(1.0f, host.data(), [&](int64_t offset, int64_t count) {
    std::lock_guard<std::mutex> lock(mu);
    ranges.emplace_back(offset, count);
  });
  ASSERT_TRUE(stats.ok()) << stats.status();

  // Same ranges as Gpt2Cpu: ln_f, layers L-1 .. 0, then wte + wpe.
  const int L = c.num_layers;
  ASSERT_EQ(ranges.size(), static_cast<size_t>(L + 2));
  EXPECT_EQ(ranges[0].first, Gpt2LayerOffset(c, L));
  EXPECT_EQ(ranges[0].first + ranges[0].second, n);
  for (int l = L - 1; l >= 0; --l) {
    EXPECT_EQ(ranges[L - l].first, Gpt2LayerOffset(c, l));
    EXPECT_EQ(ranges[L - l].second, Gpt2LayerOffset(c, l + 1) - Gpt2LayerOffset(c, l));
  }
  EXPECT_EQ(ranges[L + 1], std::make_pair(int64_t{0}, Gpt2LayerOffset(c, 0)));

  // What arrived is what the GPU holds, bit for bit.
  std::vector<float> device(n);
  ASSERT_TRUE((*model)->CopyGradsToHost(device.data()).ok());
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(Bf16ToFloat(host[i]), device[i]) << "element " << i;
  }
}

TEST(Gpt2Cuda, OverflowIsFlagged) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  const Gpt2Config c = SmallConfig();
  const std::vector<float> params = PerturbedParams(c, 31);
  const std::vector<int32_t> inputs = RandomTokens(kBatch * kSeq, c.vocab_size, 32);
  CudaModelOptions options;
  options.dtype = DType::kFp16;
  auto model = Gpt2Cuda::Create(c, kBatch, kSeq, options);
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_TRUE((*model)->SetParams(params.data()).ok());
  ASSERT_TRUE((*model)->Forward(inputs.data(), inputs.data(), kBatch, kSeq).ok());
  // fp16 tops out at 65504: a loss scale of 2^40 must overflow somewhere.
  auto stats = (*model)->Backward(std::ldexp(1.0f, 40), nullptr, nullptr);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_TRUE(stats->nonfinite);
}

TEST(Gpt2Cuda, BadInputIsRefusedAndChangesNothing) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  const Gpt2Config c = SmallConfig();
  const std::vector<float> params = PerturbedParams(c, 41);
  std::vector<int32_t> inputs = RandomTokens(kBatch * kSeq, c.vocab_size, 42);
  CudaModelOptions options;
  options.dtype = DType::kFp32;
  auto model = Gpt2Cuda::Create(c, kBatch, kSeq, options);
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_TRUE((*model)->SetParams(params.data()).ok());
  EXPECT_EQ((*model)->Backward(1.0f, nullptr, nullptr).status().code(),
            absl::StatusCode::kFailedPrecondition);
  auto good = (*model)->Forward(inputs.data(), inputs.data(), kBatch, kSeq);
  ASSERT_TRUE(good.ok());
  std::vector<float> before(c.vocab_size), after(c.vocab_size);
  ASSERT_TRUE((*model)->CopyLogitsToHost(1, 5, before.data()).ok());

  std::vector<int32_t> bad = inputs;
  bad[7] = c.vocab_size;
  EXPECT_EQ((*model)->Forward(bad.data(), inputs.data(), kBatch, kSeq).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*model)->Forward(inputs.data(), inputs.data(), kBatch + 1, kSeq).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE((*model)->CopyLogitsToHost(1, 5, after.data()).ok());
  EXPECT_EQ(before, after);
  EXPECT_EQ((*model)->UploadWeights16(nullptr).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Gpt2Cuda::Create(c, kBatch, c.context_length + 1, options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Gpt2Cuda, SmallerBatchThanAllocatedMatchesTheCpu) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  const Gpt2Config c = SmallConfig();
  const std::vector<float> params = PerturbedParams(c, 51);
  const int B = 2, T = 9;
  const std::vector<int32_t> inputs = RandomTokens(B * T, c.vocab_size, 52);
  auto cpu = Gpt2Cpu::Create(c, kBatch, kSeq, CpuKernelSet::kNaive);
  ASSERT_TRUE(cpu.ok());
  auto ref = (*cpu)->Forward(params.data(), inputs.data(), inputs.data(), B, T);
  ASSERT_TRUE(ref.ok());
  CudaModelOptions options;
  options.dtype = DType::kFp32;
  auto model = Gpt2Cuda::Create(c, kBatch, kSeq, options);
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_TRUE((*model)->SetParams(params.data()).ok());
  auto loss = (*model)->Forward(inputs.data(), inputs.data(), B, T);
  ASSERT_TRUE(loss.ok());
  EXPECT_NEAR(*loss, *ref, 2e-5 * *ref);
  std::vector<float> logits(c.vocab_size);
  ASSERT_TRUE((*model)->CopyLogitsToHost(1, T - 1, logits.data()).ok());
  const float* ref_logits = (*cpu)->logits() + (int64_t{1} * T + T - 1) * c.vocab_size;
  EXPECT_LE(MaxRelError(logits.data(), ref_logits, c.vocab_size), 2e-5);
}

// The GPU-resident baseline end to end: the weights live on the GPU, AdamW runs there, and the
// loss of a fixed batch falls as the model memorises it.
TEST(Gpt2Cuda, TrainsWithTheGpuAdamW) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  const Gpt2Config c = SmallConfig();
  std::vector<float> master(Gpt2NumParams(c));
  InitGpt2Params(c, 61, master.data());
  const std::vector<int32_t> tokens = RandomTokens(kBatch * (kSeq + 1), c.vocab_size, 62);
  std::vector<int32_t> inputs, targets;
  for (int b = 0; b < kBatch; ++b) {
    for (int t = 0; t < kSeq; ++t) {
      inputs.push_back(tokens[b * (kSeq + 1) + t]);
      targets.push_back(tokens[b * (kSeq + 1) + t + 1]);
    }
  }
  CudaModelOptions options;
  options.dtype = DType::kBf16;
  auto model = Gpt2Cuda::Create(c, kBatch, kSeq, options);
  ASSERT_TRUE(model.ok()) << model.status();
  AdamHyperParams hp;
  hp.lr = 3e-3f;
  hp.beta2 = 0.95f;
  auto adam = GpuAdamW::Create(master.size(), DType::kBf16, hp, (*model)->compute_stream());
  ASSERT_TRUE(adam.ok()) << adam.status();
  ASSERT_TRUE((*adam)->Init(master.data()).ok());
  ASSERT_TRUE((*model)->SetParams(master.data()).ok());
  float first = 0, last = 0;
  for (int step = 0; step < 40; ++step) {
    auto loss = (*model)->Forward(inputs.data(), targets.data(), kBatch, kSeq);
    ASSERT_TRUE(loss.ok()) << loss.status();
    if (step == 0) first = *loss;
    last = *loss;
    ASSERT_TRUE((*model)->Backward(1.0f, nullptr, nullptr).ok());
    ASSERT_TRUE(
        (*adam)
            ->Step(hp.lr, 1.0f, /*skip=*/false, (*model)->device_grads(), (*model)->device_params())
            .ok());
  }
  EXPECT_NEAR(first, std::log(static_cast<float>(c.vocab_size)), 0.5f);
  EXPECT_LT(last, 0.5f * first) << "first " << first << " last " << last;
}

// ---- The offload pipeline (ARCHITECTURE.md section 6): weights up unit by unit in forward order,
// gradients down range by range, straight into registered host memory where it is registered.
// scripts/gpu-check runs these as their own line (*Pipeline*).

// Rounds to the model's bf16 and back: the weights a 16-bit upload carries.
std::vector<uint16_t> Bf16Weights(const std::vector<float>& params) {
  std::vector<uint16_t> w(params.size());
  for (size_t i = 0; i < params.size(); ++i) w[i] = FloatToBf16(params[i]);
  return w;
}

// The same forward through the three ways weights arrive: SetParams (fp32 rounded on the GPU),
// the unit-by-unit upload through the pinned ring, and the same upload read in place from
// registered memory. The weights are the same bits each way, and the kernels the same, so the
// losses are the same bits. Every upload here holds its units after the embeddings for 50 ms on
// the H2D stream (set_upload_delay_for_testing), and the weights it replaces are zeros: a block
// the forward did not wait for would compute on zeros, far from the whole loss. The observer sees
// each upload on the GPU's clock, overlapping the forward that waited for it.
TEST(Gpt2CudaPipeline, LayerByLayerUploadGivesTheLossOfTheWholeWeights) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  const Gpt2Config c = Gpt2Config{101, 40, 4, 3, 48};
  const std::vector<float> params = RoundParams(PerturbedParams(c, 31), DType::kBf16);
  const std::vector<int32_t> inputs = RandomTokens(kBatch * kSeq, c.vocab_size, 32);
  const std::vector<int32_t> targets = RandomTokens(kBatch * kSeq, c.vocab_size, 33);
  CudaModelOptions options;
  options.dtype = DType::kBf16;
  options.staging.budget_bytes = 2 * 4096;  // slots reused within a unit
  options.staging.chunk_bytes = 4096;
  // The reference attention: deterministic whatever the shape, so equal bits mean equal inputs.
  options.attention = AttentionKind::kReference;
  auto model = Gpt2Cuda::Create(c, kBatch, kSeq, options);
  ASSERT_TRUE(model.ok()) << model.status();
  Gpt2Cuda& m = **model;
  constexpr auto kDelay = std::chrono::milliseconds(50);
  m.set_upload_delay_for_testing(kDelay);
  struct Span {
    std::string what;
    std::chrono::steady_clock::time_point begin, end;
  };
  std::mutex mu;
  std::vector<Span> spans;
  m.set_transfer_observer([&](const char* what, int, auto begin, auto end) {
    std::lock_guard<std::mutex> lock(mu);
    spans.push_back(Span{what, begin, end});
  });

  ASSERT_TRUE(m.SetParams(params.data()).ok());
  absl::StatusOr<float> whole = m.Forward(inputs.data(), targets.data(), kBatch, kSeq);
  ASSERT_TRUE(whole.ok()) << whole.status();

  const std::vector<float> zeros(params.size(), 0.0f);
  const std::vector<uint16_t> w16 = Bf16Weights(params);
  ASSERT_TRUE(m.SetParams(zeros.data()).ok());
  ASSERT_TRUE(m.UploadWeights16(w16.data()).ok());
  absl::StatusOr<float> ring = m.Forward(inputs.data(), targets.data(), kBatch, kSeq);
  ASSERT_TRUE(ring.ok()) << ring.status();
  EXPECT_EQ(*ring, *whole);

  std::vector<uint16_t> pinned = w16;
  ASSERT_TRUE(m.RegisterHostMemory(pinned.data(), static_cast<int64_t>(pinned.size()) * 2).ok());
  EXPECT_TRUE(m.IsRegisteredHostMemory(pinned.data() + 5, 10));
  ASSERT_TRUE(m.SetParams(zeros.data()).ok());
  ASSERT_TRUE(m.UploadWeights16(pinned.data()).ok());
  absl::StatusOr<float> direct = m.Forward(inputs.data(), targets.data(), kBatch, kSeq);
  ASSERT_TRUE(direct.ok()) << direct.status();
  EXPECT_EQ(*direct, *whole);
  EXPECT_TRUE(m.UnregisterHostMemory(pinned.data()).ok());

  // Per upload: its span, then its forward's, and the upload took the delay at least. The direct
  // one returns at once, so its forward was already on the GPU, waiting, while the held units
  // were on their way (the ring's blocks the host until its last slots are queued).
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(spans.size(), 4u);
  for (int k = 0; k < 2; ++k) {
    const Span& upload = spans[2 * k];
    const Span& forward = spans[2 * k + 1];
    EXPECT_EQ(upload.what, "h2d_weights");
    EXPECT_EQ(forward.what, "forward_gpu");
    EXPECT_GE(upload.end - upload.begin, kDelay) << "upload " << k;
    EXPECT_GE(forward.end, upload.end) << "upload " << k;
  }
  EXPECT_LT(spans[3].begin, spans[2].end) << "the direct upload did not overlap its forward";
}

// Gradients through the ring, straight into registered memory, and into places of their own
// (every other range elsewhere, as a shared-memory segment's area would take them): the same
// bits land each way, in the schedule's ranges and order.
TEST(Gpt2CudaPipeline, RegisteredAndPlacedGradientsAreTheRingsBits) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  const Gpt2Config c = SmallConfig();
  const std::vector<float> params = PerturbedParams(c, 41);
  const std::vector<int32_t> inputs = RandomTokens(kBatch * kSeq, c.vocab_size, 42);
  CudaModelOptions options;
  options.dtype = DType::kBf16;
  options.staging.budget_bytes = 2 * 4096;
  options.staging.chunk_bytes = 4096;
  // The reference attention: its backward is deterministic, so three runs give the same bits
  // (cuDNN's may accumulate dQ with atomics).
  options.attention = AttentionKind::kReference;
  auto model = Gpt2Cuda::Create(c, kBatch, kSeq, options);
  ASSERT_TRUE(model.ok()) << model.status();
  Gpt2Cuda& m = **model;
  ASSERT_TRUE(m.SetParams(params.data()).ok());
  const int64_t n = m.num_params();
  const std::vector<FlatRange> schedule = BackwardGradientRanges(c);

  struct Landing {
    std::vector<uint16_t> grads;
    std::vector<std::pair<int64_t, int64_t>> ranges;
  };
  auto backward = [&](uint16_t* host, const std::function<uint16_t*(int64_t, int64_t)>& place) {
    Landing out;
    EXPECT_TRUE(m.Forward(inputs.data(), inputs.data(), kBatch, kSeq).ok());
    std::mutex mu;
    auto stats = m.Backward(
        1.0f, host,
        [&](int64_t offset, int64_t count) {
          std::lock_guard<std::mutex> lock(mu);
          out.ranges.emplace_back(offset, count);
        },
        place);
    EXPECT_TRUE(stats.ok()) << stats.status();
    return out;
  };
  std::vector<uint16_t> ring(n, 0xffff);
  Landing through_ring = backward(ring.data(), nullptr);
  through_ring.grads = ring;

  std::vector<uint16_t> registered(n, 0xffff);
  ASSERT_TRUE(m.RegisterHostMemory(registered.data(), n * 2).ok());
  EXPECT_EQ(m.RegisterHostMemory(registered.data() + 8, 16).code(),
            absl::StatusCode::kAlreadyExists);
  Landing direct = backward(registered.data(), nullptr);
  EXPECT_EQ(registered, ring);

  std::vector<uint16_t> elsewhere(n, 0xffff);  // the odd ranges' places, registered too
  ASSERT_TRUE(m.RegisterHostMemory(elsewhere.data(), n * 2).ok());
  std::vector<uint16_t> rest(n, 0xffff);  // the even ranges, through the ring
  int asked = 0;
  Landing placed = backward(rest.data(), [&](int64_t offset, int64_t count) -> uint16_t* {
    EXPECT_EQ(offset, schedule[asked].offset);
    EXPECT_EQ(count, schedule[asked].n);
    return asked++ % 2 == 1 ? elsewhere.data() + offset : nullptr;
  });
  for (size_t r = 0; r < schedule.size(); ++r) {
    const std::vector<uint16_t>& where = r % 2 == 1 ? elsewhere : rest;
    for (int64_t i = schedule[r].offset; i < schedule[r].end(); ++i) {
      ASSERT_EQ(where[i], ring[i]) << "range " << r << " element " << i;
    }
  }
  EXPECT_TRUE(m.UnregisterHostMemory(elsewhere.data()).ok());
  EXPECT_TRUE(m.UnregisterHostMemory(registered.data()).ok());
  EXPECT_EQ(m.UnregisterHostMemory(registered.data()).code(), absl::StatusCode::kNotFound);

  for (const Landing* l : {&through_ring, &direct, &placed}) {
    ASSERT_EQ(l->ranges.size(), schedule.size());
    for (size_t r = 0; r < schedule.size(); ++r) {
      EXPECT_EQ(l->ranges[r], std::make_pair(schedule[r].offset, schedule[r].n));
    }
  }
}

// cuDNN's fused flash attention (CudaModelOptions::attention = kCudnn) in the whole model against
// the CPU backend, with Gpt2CudaParity's floors and bound, the reference attention's model run
// and printed beside it. Then, on the same cuDNN model (carved for (kBatch, kSeq)), a smaller
// batch (its own plans, its statistics packed by its own shape) and a single-token batch, which
// cuDNN's backward does not take, so that batch runs the reference attention in buffers the
// model allocates for it. Names hold "Cudnn" for --gtest_filter=*Cudnn*.
class Gpt2CudaCudnnParity : public ::testing::TestWithParam<DType> {};

TEST_P(Gpt2CudaCudnnParity, CudnnAttentionMatchesTheCpuBackend) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  const DType dtype = GetParam();
  const std::string name(DTypeName(dtype));
  // SmallConfig's odd vocabulary and context with GPT-2's head size, 64 (the kernel tests in
  // cudnn/cudnn_attention_test.cc cover 16 and 32).
  const Gpt2Config c = Gpt2Config{101, 40, 2, 2, 128};
  const std::vector<float> params = RoundParams(PerturbedParams(c, 71), dtype);
  const std::vector<int32_t> inputs = RandomTokens(kBatch * kSeq, c.vocab_size, 72);
  const std::vector<int32_t> targets = RandomTokens(kBatch * kSeq, c.vocab_size, 73);
  const float loss_scale = dtype == DType::kFp16 ? 1024.0f : 1.0f;

  CudaModelOptions options;
  options.dtype = dtype;
  options.attention = AttentionKind::kCudnn;
  auto cudnn = Gpt2Cuda::Create(c, kBatch, kSeq, options);
  if (!cudnn.ok() && absl::StrContains(cudnn.status().message(), "cuDNN not found")) {
    GTEST_SKIP() << cudnn.status();
  }
  ASSERT_TRUE(cudnn.ok()) << cudnn.status();
  EXPECT_STREQ((*cudnn)->attention_path(), "cudnn");
  options.attention = AttentionKind::kReference;
  auto reference = Gpt2Cuda::Create(c, kBatch, kSeq, options);
  ASSERT_TRUE(reference.ok()) << reference.status();
  EXPECT_STREQ((*reference)->attention_path(), "reference");
  ASSERT_TRUE((*cudnn)->SetParams(params.data()).ok());
  ASSERT_TRUE((*reference)->SetParams(params.data()).ok());

  // The full batch, a smaller one, and one token (the reference's fallback on the cuDNN model).
  const std::pair<int, int> batches[] = {{kBatch, kSeq}, {2, 9}, {1, 1}};
  for (const auto& [B, T] : batches) {
    SCOPED_TRACE(::testing::Message() << name << " B=" << B << " T=" << T);
    const ParityReference p =
        MeasureParityReference(c, dtype, params, inputs, targets, loss_scale, B, T, 74);
    const CudaRun got = ForwardBackward(**cudnn, inputs, targets, loss_scale, B, T);
    const CudaRun base = ForwardBackward(**reference, inputs, targets, loss_scale, B, T);
    ExpectWithinFloors(absl::StrCat(name, " B=", B, " T=", T, " cudnn (beside: reference)"), c, p,
                       got, &base);
  }
}

INSTANTIATE_TEST_SUITE_P(SixteenBit, Gpt2CudaCudnnParity,
                         ::testing::Values(DType::kFp16, DType::kBf16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

TEST(Gpt2CudaCudnn, Fp32RunsTheReference) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  CudaModelOptions options;
  options.dtype = DType::kFp32;
  auto model = Gpt2Cuda::Create(SmallConfig(), kBatch, kSeq, options);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_STREQ((*model)->attention_path(), "reference");
  options.attention = AttentionKind::kCudnn;
  EXPECT_EQ(Gpt2Cuda::Create(SmallConfig(), kBatch, kSeq, options).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// Without cuDNN the default model runs the reference and its one log line says why, and a model
// that requires cuDNN is refused. In a child process (a fresh one, re-executed: the parent's
// cuDNN may already be loaded), with OFFLOAD_CUDNN_LIBRARY pointing nowhere.
TEST(Gpt2CudaCudnn, MissingCudnnRunsTheReferenceAndSaysSo) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("OFFLOAD_CUDNN_LIBRARY", "/nonexistent/libcudnn.so.9", 1);
        FLAGS_logtostderr = true;
        FLAGS_minloglevel = 0;
        CudaModelOptions options;
        options.dtype = DType::kBf16;
        auto model = Gpt2Cuda::Create(SmallConfig(), kBatch, kSeq, options);
        bool ok = model.ok() && std::string((*model)->attention_path()) == "reference";
        options.attention = AttentionKind::kCudnn;
        auto required = Gpt2Cuda::Create(SmallConfig(), kBatch, kSeq, options);
        ok = ok && required.status().code() == absl::StatusCode::kFailedPrecondition;
        std::fprintf(stderr, "child: %s\n", ok ? "as expected" : "NOT as expected");
        std::exit(ok ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "attention: reference \\(cuDNN not found");
}

}  // namespace
}  // namespace offload
