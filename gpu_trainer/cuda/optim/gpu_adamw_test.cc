// GpuAdamW against the CPU shards' scalar reference (ARCHITECTURE.md section 5): the same initial
// master weights and the same 16-bit gradients over three steps, the middle one skipped, must give
// the same fp32 master weights and the same 16-bit weights, bit for bit, in fp16 and bf16, for
// AdamW and for Adam with L2 decay.
#include "gpu_trainer/cuda/optim/gpu_adamw.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "base/dtype.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"
#include "gpu_trainer/cuda/runtime/cuda_test_util.h"
#include "gpu_trainer/cuda/runtime/storage_type.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

using testing_util::DeviceArray;

// Not a multiple of any block or vector width, so every kernel tail is exercised; large enough
// for several thread blocks.
constexpr int64_t kN = 100003;

uint16_t ToStorageBits(float x, DType dtype) {
  return dtype == DType::kBf16 ? FloatToBf16(x) : FloatToFp16(x);
}

// What the model hands the optimizer in one step: gradients (n,) as 16-bit bits, already
// multiplied by the loss scale.
std::vector<uint16_t> RandomGrads(std::mt19937_64& rng, DType dtype, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<uint16_t> g(kN);
  for (int64_t i = 0; i < kN; ++i) g[i] = ToStorageBits(normal(rng), dtype);
  g[0] = ToStorageBits(0.0f, dtype);
  g[1] = ToStorageBits(-0.0f, dtype);
  return g;
}

std::vector<uint16_t> DownloadBits(const uint16_t* device) {
  std::vector<uint16_t> host(kN);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(host.data(), device, kN * sizeof(uint16_t), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return host;
}

// Index of the first element whose bits differ, or -1.
template <typename T>
int64_t FirstMismatch(const std::vector<T>& a, const std::vector<T>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<int64_t>(i);
  }
  return -1;
}

struct Case {
  DType dtype;
  bool adamw;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return std::string(DTypeName(info.param.dtype)) + (info.param.adamw ? "_AdamW" : "_Adam");
}

class GpuAdamWTest : public ::testing::TestWithParam<Case> {};

TEST_P(GpuAdamWTest, MatchesCpuScalarReferenceBitForBit) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  const DType dtype = GetParam().dtype;
  AdamHyperParams hp;
  hp.lr = 1e-3f;
  hp.beta1 = 0.9f;
  hp.beta2 = 0.95f;
  hp.eps = 1e-8f;
  hp.weight_decay = 0.1f;
  hp.adamw = GetParam().adamw;

  std::mt19937_64 rng(20240520);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> master(kN);  // (n,) the CPU reference's state, updated in place
  for (float& p : master) p = normal(rng);
  std::vector<float> exp_avg(kN, 0.0f), exp_avg_sq(kN, 0.0f);
  std::vector<uint16_t> out(kN);  // (n,) the reference's 16-bit weights

  cudaStream_t stream;
  OFFLOAD_ASSERT_CUDA_OK(cudaStreamCreate(&stream));
  absl::StatusOr<std::unique_ptr<GpuAdamW>> gpu = GpuAdamW::Create(kN, dtype, hp, stream);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_GE((*gpu)->device_bytes(), 12 * kN);
  ASSERT_TRUE((*gpu)->Init(master.data()).ok());
  // uint16_t stands in for the storage type: same size, and the kernel only sees the bits.
  DeviceArray<uint16_t> grads(kN), params(kN);  // (n,) each
  ASSERT_NE(grads.get(), nullptr);
  ASSERT_NE(params.get(), nullptr);
  OFFLOAD_ASSERT_CUDA_OK(cudaMemset(params.get(), 0xa5, kN * sizeof(uint16_t)));

  struct StepArgs {
    float lr, grad_multiplier;
    bool skip;
    float grad_scale;  // of the gradients as they arrive, loss scale included
  };
  // The middle step overflowed: its gradients hold an inf, and must leave no trace.
  const StepArgs steps[] = {{1e-3f, 1.0f / 1024, false, 1024 * 0.01f},
                            {8e-4f, 1.0f / 2048, true, 2048 * 0.01f},
                            {6e-4f, 0.7f / 1024, false, 1024 * 0.03f}};
  AdamKernelFn reference = GetAdamKernel(SimdPath::kScalar);
  int64_t applied = 0;
  std::vector<uint16_t> previous_params = DownloadBits(params.get());
  for (const StepArgs& a : steps) {
    std::vector<uint16_t> g = RandomGrads(rng, dtype, a.grad_scale);
    if (a.skip) g[kN / 2] = dtype == DType::kBf16 ? 0x7f80 : 0x7c00;  // +inf
    OFFLOAD_ASSERT_CUDA_OK(
        cudaMemcpy(grads.get(), g.data(), kN * sizeof(uint16_t), cudaMemcpyHostToDevice));
    ASSERT_TRUE((*gpu)->Step(a.lr, a.grad_multiplier, a.skip, grads.get(), params.get()).ok());
    if (!a.skip) {
      ++applied;
      AdamSpan span;
      span.grad = g.data();
      span.grad_dtype = dtype;
      span.param = master.data();
      span.exp_avg = exp_avg.data();
      span.exp_avg_sq = exp_avg_sq.data();
      span.out = out.data();
      span.out_dtype = dtype;
      span.n = kN;
      reference(ComputeAdamStepScalars(hp, a.lr, applied, a.grad_multiplier), span);
    }
    EXPECT_EQ((*gpu)->step(), applied);

    std::vector<float> gpu_master(kN);
    ASSERT_TRUE((*gpu)->CopyMasterToHost(gpu_master.data()).ok());
    const std::vector<uint16_t> gpu_params = DownloadBits(params.get());
    const int64_t bad_master = FirstMismatch(gpu_master, master);
    EXPECT_EQ(bad_master, -1) << "step " << applied << (a.skip ? " (skipped)" : "") << ": master["
                              << bad_master << "] GPU "
                              << gpu_master[bad_master < 0 ? 0 : bad_master] << " CPU "
                              << master[bad_master < 0 ? 0 : bad_master];
    // A skipped step leaves the device weights as they were, whatever the reference's last
    // output buffer says.
    const std::vector<uint16_t>& expected = a.skip ? previous_params : out;
    const int64_t bad_param = FirstMismatch(gpu_params, expected);
    EXPECT_EQ(bad_param, -1) << "step " << applied << (a.skip ? " (skipped)" : "")
                             << ": param bits[" << bad_param << "] GPU 0x" << std::hex
                             << gpu_params[bad_param < 0 ? 0 : bad_param] << " CPU 0x"
                             << expected[bad_param < 0 ? 0 : bad_param];
    previous_params = gpu_params;
  }
  EXPECT_EQ((*gpu)->step(), 2);
  gpu->reset();
  OFFLOAD_ASSERT_CUDA_OK(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(StorageTypes, GpuAdamWTest,
                         ::testing::Values(Case{DType::kBf16, true}, Case{DType::kFp16, true},
                                           Case{DType::kBf16, false}, Case{DType::kFp16, false}),
                         CaseName);

TEST(GpuAdamW, InitResetsTheStepCount) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  constexpr int64_t n = 1000;
  DeviceArray<uint16_t> grads(n), params(n);
  absl::StatusOr<std::unique_ptr<GpuAdamW>> gpu =
      GpuAdamW::Create(n, DType::kBf16, AdamHyperParams{}, /*stream=*/nullptr);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  std::vector<float> master(n, 0.5f);
  ASSERT_TRUE((*gpu)->Init(master.data()).ok());
  ASSERT_TRUE((*gpu)->Step(1e-3f, 1.0f, false, grads.get(), params.get()).ok());
  EXPECT_EQ((*gpu)->step(), 1);
  ASSERT_TRUE((*gpu)->Init(master.data()).ok());
  EXPECT_EQ((*gpu)->step(), 0);
  std::vector<float> back(n);
  ASSERT_TRUE((*gpu)->CopyMasterToHost(back.data()).ok());
  EXPECT_EQ(back, master);
  EXPECT_EQ((*gpu)->Step(1e-3f, 1.0f, false, nullptr, params.get()).code(),
            absl::StatusCode::kInvalidArgument);
}

// Host-only: runs (and must pass) without a GPU too.
TEST(GpuAdamW, RefusesAnEmptyParameterSpace) {
  for (const int64_t n : {int64_t{0}, int64_t{-1}}) {
    absl::StatusOr<std::unique_ptr<GpuAdamW>> gpu =
        GpuAdamW::Create(n, DType::kBf16, AdamHyperParams{}, /*stream=*/nullptr);
    EXPECT_EQ(gpu.status().code(), absl::StatusCode::kInvalidArgument) << gpu.status();
  }
}

}  // namespace
}  // namespace offload
