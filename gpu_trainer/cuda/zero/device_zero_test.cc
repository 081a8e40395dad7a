// ZeRO on the device (GPU tests; they skip without one): the gradient buckets land the bits the
// flat gradient buffer lands, the ZeRO-3 window computes the bits stage 2 computes, and the
// device holds what the memory planner says.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "base/dtype.h"
#include "gpu_trainer/cuda/gpt2_cuda.h"
#include "gpu_trainer/cuda/memory_planner.h"
#include "gpu_trainer/cuda/runtime/cuda_test_util.h"
#include "gpu_trainer/cuda/zero/bucket_slots.h"
#include "gpu_trainer/cuda/zero/param_window.h"
#include "gpu_trainer/model/model_test_util.h"
#include "gtest/gtest.h"
#include "model_spec/gradient_buckets.h"
#include "model_spec/param_layout.h"
#include "model_spec/partition.h"
#ifdef OFFLOAD_HAVE_NCCL
#include "gpu_trainer/cuda/nccl/nccl_collectives.h"
#endif

namespace offload {
namespace {

using testing_util::PerturbedParams;
using testing_util::RandomTokens;

constexpr int kBatch = 3;
constexpr int kSeq = 17;
const Gpt2Config kConfig{101, 40, 4, 3, 48};

std::vector<uint16_t> Bf16Weights(const std::vector<float>& params) {
  std::vector<uint16_t> w(params.size());
  for (size_t i = 0; i < params.size(); ++i) w[i] = FloatToBf16(params[i]);
  return w;
}

CudaModelOptions Options(int64_t bucket_elements, int window_layers) {
  CudaModelOptions o;
  o.dtype = DType::kBf16;
  // A small ring, so a bucket's copy takes several slots and backward runs ahead of it.
  o.staging.budget_bytes = 2 * 4096;
  o.staging.chunk_bytes = 4096;
  // Deterministic whatever the shape: equal bits then mean equal inputs.
  o.attention = AttentionKind::kReference;
  o.gradient_bucket_elements = bucket_elements;
  o.param_window_layers = window_layers;
  return o;
}

struct StepResult {
  float loss = 0;
  std::vector<uint16_t> grads;  // (n,)
  CudaGradStats stats;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // as on_ready reported them
};

// One forward and backward with w16 as the weights, taken the model's way.
StepResult Step(Gpt2Cuda& m, const std::vector<uint16_t>& w16, bool windowed, uint64_t seed) {
  const std::vector<int32_t> inputs = RandomTokens(kBatch * kSeq, kConfig.vocab_size, seed);
  const std::vector<int32_t> targets = RandomTokens(kBatch * kSeq, kConfig.vocab_size, seed + 1);
  StepResult r;
  EXPECT_TRUE((windowed ? m.SetHostWeights16(w16.data()) : m.UploadWeights16(w16.data())).ok());
  absl::StatusOr<float> loss = m.Forward(inputs.data(), targets.data(), kBatch, kSeq);
  EXPECT_TRUE(loss.ok()) << loss.status();
  r.loss = loss.ok() ? *loss : 0;
  r.grads.assign(m.num_params(), 0xFFFF);
  std::mutex mu;
  absl::StatusOr<CudaGradStats> stats =
      m.Backward(1024.0f, r.grads.data(), [&](int64_t offset, int64_t n) {
        std::lock_guard<std::mutex> lock(mu);
        r.ranges.emplace_back(offset, n);
      });
  EXPECT_TRUE(stats.ok()) << stats.status();
  if (stats.ok()) r.stats = *stats;
  return r;
}

void ExpectSameBits(const StepResult& a, const StepResult& b, const char* what) {
  EXPECT_EQ(a.loss, b.loss) << what;
  ASSERT_EQ(a.grads.size(), b.grads.size()) << what;
  EXPECT_EQ(std::memcmp(a.grads.data(), b.grads.data(), a.grads.size() * 2), 0) << what;
  EXPECT_EQ(a.stats.nonfinite, b.stats.nonfinite) << what;
  // Summed bucket by bucket, in another order than one pass: equal to the rounding of doubles.
  EXPECT_NEAR(a.stats.sum_squares, b.stats.sum_squares, 1e-9 * b.stats.sum_squares) << what;
}

// Each bucket lands the bits the flat buffer does, the buckets cover the parameters once, and the
// device holds the embeddings' bucket and two more instead of every gradient.
TEST(Gpt2CudaBuckets, BucketsLandTheFlatGradientsBits) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  const std::vector<uint16_t> w16 = Bf16Weights(PerturbedParams(kConfig, 41));
  const int64_t n = Gpt2NumParams(kConfig);
  auto flat = Gpt2Cuda::Create(kConfig, kBatch, kSeq, Options(0, 0));
  ASSERT_TRUE(flat.ok()) << flat.status();
  const StepResult want = Step(**flat, w16, false, 42);
  const int64_t block = Gpt2UnitRange(kConfig, 1).size();
  for (const int64_t bucket_elements : {int64_t{1}, 2 * block, 10 * n}) {
    auto m = Gpt2Cuda::Create(kConfig, kBatch, kSeq, Options(bucket_elements, 0));
    ASSERT_TRUE(m.ok()) << m.status();
    for (int step = 0; step < 2; ++step) {
      const StepResult got = Step(**m, w16, false, 42);
      ExpectSameBits(got, want, "buckets");
      const GradientBucketPlan plan = PlanGradientBuckets(kConfig, n, bucket_elements);
      EXPECT_EQ((*m)->buckets_sent(), static_cast<int64_t>(plan.buckets.size()));
      int64_t covered = 0;
      for (const auto& [offset, size] : got.ranges) covered += size;
      EXPECT_EQ(covered, n);
    }
    EXPECT_EQ((*flat)->device_bytes() - (*m)->device_bytes(),
              (n - DeviceGradientElements(kConfig, bucket_elements)) * 2)
        << "bucket_elements " << bucket_elements;
  }
}

// ZeRO-3 through the device window gives stage 2's bits for every window size, from pageable and
// from registered host memory, over steps whose weights change, and after a forward without a
// backward (the sampler's): the same kernels read the same weights, only from other addresses.
TEST(Gpt2CudaWindow, WindowGivesStageTwosBits) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  std::vector<std::vector<uint16_t>> weights = {Bf16Weights(PerturbedParams(kConfig, 51)),
                                                Bf16Weights(PerturbedParams(kConfig, 52))};
  auto stage2 = Gpt2Cuda::Create(kConfig, kBatch, kSeq, Options(1, 0));
  ASSERT_TRUE(stage2.ok()) << stage2.status();
  std::vector<StepResult> want;
  for (size_t s = 0; s < weights.size(); ++s) want.push_back(Step(**stage2, weights[s], false, 60));
  const int L = kConfig.num_layers;
  for (const int window_layers : {1, 2, L}) {
    for (const bool registered : {false, true}) {
      auto m = Gpt2Cuda::Create(kConfig, kBatch, kSeq, Options(1, window_layers));
      ASSERT_TRUE(m.ok()) << m.status();
      const ParamWindowPlan plan = PlanParamWindow(kConfig, window_layers);
      for (size_t s = 0; s < weights.size(); ++s) {
        std::vector<uint16_t> w16 = weights[s];
        if (registered) {
          ASSERT_TRUE((*m)->RegisterHostMemory(w16.data(), w16.size() * 2).ok());
        }
        const int64_t before = (*m)->window_fills();
        ExpectSameBits(Step(**m, w16, true, 60), want[s], "window");
        EXPECT_EQ((*m)->window_fills() - before, plan.fills());
        // A forward alone, then a whole step again: the window starts over.
        const std::vector<int32_t> inputs = RandomTokens(kBatch * kSeq, kConfig.vocab_size, 70);
        ASSERT_TRUE((*m)->Forward(inputs.data(), nullptr, kBatch, kSeq).ok());
        ExpectSameBits(Step(**m, w16, true, 60), want[s], "window after a forward alone");
        if (registered) {
          ASSERT_TRUE((*m)->UnregisterHostMemory(w16.data()).ok());
        }
      }
      // The weights the device holds: the window, not the model.
      const int64_t n = Gpt2NumParams(kConfig);
      EXPECT_EQ((*stage2)->device_bytes() - (*m)->device_bytes(), (n - plan.total_elements) * 2);
    }
  }
  // The window needs its weights from the host, and refuses the stage-2 ways in.
  auto m = Gpt2Cuda::Create(kConfig, kBatch, kSeq, Options(1, 1));
  ASSERT_TRUE(m.ok());
  EXPECT_EQ((*m)->UploadWeights16(weights[0].data()).code(), absl::StatusCode::kFailedPrecondition);
  const std::vector<int32_t> inputs = RandomTokens(kBatch * kSeq, kConfig.vocab_size, 80);
  EXPECT_EQ((*m)->Forward(inputs.data(), nullptr, kBatch, kSeq).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// What cudaMemGetInfo sees a ZeRO-3 model take against the planner's figure for it: at least the
// planned weights, gradients and activations, and no more than the plan with its reserve.
TEST(Gpt2CudaWindow, DeviceMemoryIsThePlannersFigure) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  const Gpt2Config c{50257, 1024, 24, 16, 1024};  // gpt2-medium's shape
  const int B = 2, T = 1024, window_layers = 2;
  ParamPlacement placement;
  placement.zero_stage = 3;
  placement.window_layers = window_layers;
  CudaModelOptions options = Options(1, window_layers);  // the reference attention
  options.activation_checkpointing = true;
  size_t free_before = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
  auto m = Gpt2Cuda::Create(c, B, T, options);
  ASSERT_TRUE(m.ok()) << m.status();
  size_t free_after = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total), cudaSuccess);
  const int64_t used = static_cast<int64_t>(free_before) - static_cast<int64_t>(free_after);
  AttentionMemory reference;
  reference.fused = false;
  const CudaMemoryPlan plan =
      PlanGpt2CudaMemory(c, B, T, DType::kBf16, false, placement, true, 1, reference);
  std::printf("gpu zero3 device_used_mib=%lld planned_mib=%lld planned_params_mib=%lld\n",
              static_cast<long long>(used >> 20), static_cast<long long>(plan.total_bytes() >> 20),
              static_cast<long long>(plan.params_bytes >> 20));
  EXPECT_GE(used, plan.params_bytes + plan.grads_bytes);
  EXPECT_LE(used, plan.total_bytes());
}

#ifdef OFFLOAD_HAVE_NCCL
// The NCCL path on one GPU (scripts/gpu-check's *Nccl* line): a one-rank communicator runs every
// device collective of W ranks (the buckets widened, reduce-scattered, averaged and rounded over
// this rank's piece; the partition uploaded and all-gathered in place; the window's units
// gathered from the partition), and with one rank each is the identity, so the bits are the
// single-rank path's. Two ranks need two GPUs (nccl_collectives_test's *TwoRanks* case).
TEST(Gpt2CudaNccl, OneRankReducesAndGathersTheSingleRankBits) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  NcclOptions nccl;
  absl::StatusOr<std::unique_ptr<Collectives>> ranks = ConnectNccl(nccl, nullptr);
  ASSERT_TRUE(ranks.ok()) << ranks.status();
  const int64_t n = Gpt2NumParams(kConfig);
  absl::StatusOr<v1::PartitionMap> map = MakePartitionMap(n, 1, 1);
  ASSERT_TRUE(map.ok());
  const int64_t padded = static_cast<int64_t>(map->padded_length());
  std::vector<uint16_t> w16 = Bf16Weights(PerturbedParams(kConfig, 91));
  auto single = Gpt2Cuda::Create(kConfig, kBatch, kSeq, Options(1, 0));
  ASSERT_TRUE(single.ok()) << single.status();
  const StepResult want = Step(**single, w16, false, 92);
  std::vector<uint16_t> partition = w16;
  partition.resize(padded, 0);
  for (const int window_layers : {0, 2}) {
    CudaModelOptions options = Options(1, window_layers);
    options.collectives = ranks->get();
    options.padded_length = padded;
    auto m = Gpt2Cuda::Create(kConfig, kBatch, kSeq, options);
    ASSERT_TRUE(m.ok()) << m.status();
    for (int step = 0; step < 2; ++step) {
      ASSERT_TRUE((*m)->UploadPartition16(partition.data()).ok());
      const std::vector<int32_t> inputs = RandomTokens(kBatch * kSeq, kConfig.vocab_size, 92);
      const std::vector<int32_t> targets = RandomTokens(kBatch * kSeq, kConfig.vocab_size, 93);
      absl::StatusOr<float> loss = (*m)->Forward(inputs.data(), targets.data(), kBatch, kSeq);
      ASSERT_TRUE(loss.ok()) << loss.status();
      StepResult got;
      got.loss = *loss;
      got.grads.assign(n, 0xFFFF);
      absl::StatusOr<CudaGradStats> stats = (*m)->Backward(1024.0f, got.grads.data(), nullptr);
      ASSERT_TRUE(stats.ok()) << stats.status();
      got.stats = *stats;
      ExpectSameBits(got, want, window_layers > 0 ? "nccl window" : "nccl stage 2");
    }
  }
}
#endif  // OFFLOAD_HAVE_NCCL

}  // namespace
}  // namespace offload
