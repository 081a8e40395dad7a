// The CUDA GPT-2 against the CPU backend, its reference: loss and every parameter gradient in
// fp32, fp16 and bf16 within a noise floor measured in the test, the gradient ranges streamed to
// the host through the pinned ring, the statistics that leave with them, bad input, and a short
// training run on the GPU-resident AdamW whose loss falls. Every test skips without a GPU.
#include "gpu_trainer/cuda/gpt2_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cpu_optimizer_server/adam/adam_kernel.h"
#include "gpu_trainer/cuda/optim/gpu_adamw.h"
#include "gpu_trainer/cuda/runtime/cuda_test_util.h"
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

CpuResult CpuReference(const Gpt2Config& c, const std::vector<float>& params,
                       const std::vector<int32_t>& inputs, const std::vector<int32_t>& targets,
                       float loss_scale) {
  auto model = Gpt2Cpu::Create(c, kBatch, kSeq, CpuKernelSet::kNaive);
  EXPECT_TRUE(model.ok()) << model.status();
  CpuResult r;
  r.grads.assign(params.size(), 0.0f);
  auto loss = (*model)->Forward(params.data(), inputs.data(), targets.data(), kBatch, kSeq);
  EXPECT_TRUE(loss.ok()) << loss.status();
  r.loss = *loss;
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

TEST_P(Gpt2CudaParity, LossAndGradientsMatchTheCpuBackend) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  const DType dtype = GetParam();
  const std::string name(DTypeName(dtype));
  const Gpt2Config c = SmallConfig();
  const std::vector<float> params = RoundParams(PerturbedParams(c, 11), dtype);
  const std::vector<int32_t> inputs = RandomTokens(kBatch * kSeq, c.vocab_size, 12);
  const std::vector<int32_t> targets = RandomTokens(kBatch * kSeq, c.vocab_size, 13);
  const float loss_scale = dtype == DType::kFp16 ? 1024.0f : 1.0f;
  const CpuResult ref = CpuReference(c, params, inputs, targets, loss_scale);
  const std::vector<ParamTensor> layout = Gpt2ParamLayout(c);

  // The floors. The loss is a mean over n = B T tokens in fp32: any order of that sum may move it
  // by 2 (n - 1) u (Higham 4.2), which the fp32 case's floor could otherwise fall below.
  double loss_floor = 2.0 * (kBatch * kSeq - 1) * 0x1p-24;
  std::vector<double> grad_floor(layout.size(), 0.0);
  for (int draw = 0; draw < kFloorDraws; ++draw) {
    const CpuResult moved = CpuReference(
        c, OneRoundingApart(params, UnitRoundoff(dtype), 14 + draw), inputs, targets, loss_scale);
    loss_floor =
        std::max(loss_floor, std::fabs(double{moved.loss} - ref.loss) / std::fabs(ref.loss));
    for (size_t k = 0; k < layout.size(); ++k) {
      const ParamTensor& t = layout[k];
      grad_floor[k] = std::max(grad_floor[k], MaxRelError(moved.grads.data() + t.offset,
                                                          ref.grads.data() + t.offset, t.numel));
    }
  }

  CudaModelOptions options;
  options.dtype = dtype;
  auto model = Gpt2Cuda::Create(c, kBatch, kSeq, options);
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_TRUE((*model)->SetParams(params.data()).ok());
  auto loss = (*model)->Forward(inputs.data(), targets.data(), kBatch, kSeq);
  ASSERT_TRUE(loss.ok()) << loss.status();
  const double loss_err = std::fabs(*loss - ref.loss) / std::fabs(ref.loss);
  std::printf("margin %s loss err=%.3e floor=%.3e floors=%.1f bound=%.0f floors\n", name.c_str(),
              loss_err, loss_floor, loss_err / loss_floor, kSpread);
  EXPECT_LE(loss_err, kSpread * loss_floor) << name;
  auto stats = (*model)->Backward(loss_scale, nullptr, nullptr);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_FALSE(stats->nonfinite);
  std::vector<float> grads(params.size());
  ASSERT_TRUE((*model)->CopyGradsToHost(grads.data()).ok());
  for (size_t k = 0; k < layout.size(); ++k) {
    const ParamTensor& t = layout[k];
    const double err = MaxRelError(grads.data() + t.offset, ref.grads.data() + t.offset, t.numel);
    ASSERT_GT(grad_floor[k], 0.0) << t.name << ": a floor of zero would demand the same bits";
    EXPECT_LE(err, kSpread * grad_floor[k]) << t.name << " " << name;
    RecordProperty(t.name, Sci(err));
    std::printf("margin %s %s err=%.3e floor=%.3e floors=%.1f bound=%.0f floors\n", name.c_str(),
                t.name.c_str(), err, grad_floor[k], err / grad_floor[k], kSpread);
  }
  // The statistics are those of the stored gradients.
  double sum_squares = 0;
  for (float g : grads) sum_squares += double{g} * g;
  EXPECT_NEAR(stats->sum_squares, sum_squares, 1e-6 * sum_squares);
}

INSTANTIATE_TEST_SUITE_P(AllStorageTypes, Gpt2CudaParity,
                         ::testing::Values(DType::kFp32, DType::kFp16, DType::kBf16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

struct CudaRun {
  float loss = 0;
  std::vector<float> grads;  // (num_params,)
};

CudaRun RunCuda(const Gpt2Config& c, DType dtype, bool checkpointing,
                const std::vector<float>& params, const std::vector<int32_t>& inputs,
                const std::vector<int32_t>& targets, float loss_scale) {
  CudaModelOptions options;
  options.dtype = dtype;
  options.activation_checkpointing = checkpointing;
  auto model = Gpt2Cuda::Create(c, kBatch, kSeq, options);
  EXPECT_TRUE(model.ok()) << model.status();
  CudaRun r;
  if (!model.ok()) return r;
  EXPECT_TRUE((*model)->SetParams(params.data()).ok());
  auto loss = (*model)->Forward(inputs.data(), targets.data(), kBatch, kSeq);
  EXPECT_TRUE(loss.ok()) << loss.status();
  r.loss = loss.value_or(NAN);
  EXPECT_TRUE((*model)->Backward(loss_scale, nullptr, nullptr).ok());
  r.grads.assign(params.size(), 0.0f);
  EXPECT_TRUE((*model)->CopyGradsToHost(r.grads.data()).ok());
  return r;
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

}  // namespace
}  // namespace offload
