// Tests of the CUDA backend's non-GEMM kernels, typed over the three storage types: each kernel
// against the CPU naive kernel (model/layers_naive.cc) fed the same inputs rounded to the
// storage type, held to KernelTolerance<T>(); the deterministic reductions also run twice and
// must repeat bit for bit; AdamW against the CPU scalar reference bit for bit; the token
// bucketing, which is host code, runs everywhere. Every GPU test skips without a GPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "base/dtype.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"
#include "cpu_optimizer_server/adam/adam_kernel_internal.h"
#include "gpu_trainer/cuda/kernels/bias_grad.h"
#include "gpu_trainer/cuda/kernels/convert.h"
#include "gpu_trainer/cuda/kernels/encoder.h"
#include "gpu_trainer/cuda/kernels/gelu.h"
#include "gpu_trainer/cuda/kernels/grad_norm.h"
#include "gpu_trainer/cuda/kernels/layernorm.h"
#include "gpu_trainer/cuda/kernels/residual.h"
#include "gpu_trainer/cuda/optim/adamw.h"
#include "gpu_trainer/cuda/runtime/cuda_test_util.h"
#include "gpu_trainer/cuda/runtime/storage_type.h"
#include "gpu_trainer/model/layers_naive.h"
#include "gpu_trainer/model/model_test_util.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

using testing_util::DeviceArray;
using testing_util::Download;
using testing_util::KernelTolerance;
using testing_util::MaxRelError;
using testing_util::RandomTokens;
using testing_util::RandomVector;
using testing_util::RoundTo;
using testing_util::Sci;
using testing_util::TestRng;
using testing_util::Upload;

// The statistics LayerNorm saves are fp32 whatever T is, computed from the same rounded inputs
// as the reference: only the summation order differs.
constexpr double kStatsTolerance = 1e-5;

// Copies without conversion, for ids, fp32 state and bit-level comparisons.
template <typename U>
std::unique_ptr<DeviceArray<U>> UploadRaw(const std::vector<U>& host) {
  auto array = std::make_unique<DeviceArray<U>>(static_cast<int64_t>(host.size()));
  cudaMemcpy(array->get(), host.data(), host.size() * sizeof(U), cudaMemcpyHostToDevice);
  return array;
}

template <typename U>
std::vector<U> DownloadRaw(const U* device, int64_t n) {
  std::vector<U> host(static_cast<size_t>(n));
  cudaDeviceSynchronize();
  cudaMemcpy(host.data(), device, host.size() * sizeof(U), cudaMemcpyDeviceToHost);
  return host;
}

template <typename T>
std::vector<T> ToStorage(const std::vector<float>& values) {
  std::vector<T> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = HostFromFloat<T>(values[i]);
  return out;
}

template <typename U>
bool SameBits(const U& a, const U& b) {
  return std::memcmp(&a, &b, sizeof(U)) == 0;
}

// The first index where two arrays differ in bits, or -1.
template <typename U>
int64_t FirstBitDifference(const std::vector<U>& a, const std::vector<U>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!SameBits(a[i], b[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

// Kernels launched on the legacy default stream; a fault inside one surfaces here.
#define OFFLOAD_ASSERT_DEVICE_OK() OFFLOAD_ASSERT_CUDA_OK(cudaDeviceSynchronize())

class StorageTypeNames {
 public:
  template <typename T>
  static std::string GetName(int) {
    return std::string(DTypeName(StorageDType<T>()));
  }
};

template <typename T>
class ElementwiseKernelsTest : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, __half, __nv_bfloat16>;
TYPED_TEST_SUITE(ElementwiseKernelsTest, StorageTypes, StorageTypeNames);

// ---------------------------------------------------------------------------------------------
// Token buckets: host code, runs without a GPU.

TEST(TokenBucketsTest, GroupsPositionsByTokenInAscendingOrder) {
  const std::vector<int32_t> inp = {5, 2, 5, 0, 2, 5, 7};
  TokenBuckets buckets;
  BuildTokenBuckets(inp.data(), static_cast<int64_t>(inp.size()), &buckets);
  EXPECT_EQ(buckets.tokens, (std::vector<int32_t>{0, 2, 5, 7}));
  EXPECT_EQ(buckets.offsets, (std::vector<int32_t>{0, 1, 3, 6, 7}));
  EXPECT_EQ(buckets.positions, (std::vector<int32_t>{3, 1, 4, 0, 2, 5, 6}));
}

TEST(TokenBucketsTest, EmptyBatchHasNoBucketsAndIsReusable) {
  TokenBuckets buckets;
  const std::vector<int32_t> inp = {3, 3};
  BuildTokenBuckets(inp.data(), 2, &buckets);
  BuildTokenBuckets(nullptr, 0, &buckets);
  EXPECT_TRUE(buckets.tokens.empty());
  EXPECT_EQ(buckets.offsets, (std::vector<int32_t>{0}));
  EXPECT_TRUE(buckets.positions.empty());
}

TEST(TokenBucketsTest, RandomBatchIsAPartitionByToken) {
  const int64_t n = 4 * 1023;
  const std::vector<int32_t> inp = RandomTokens(n, 300, /*seed=*/11);
  TokenBuckets buckets;
  BuildTokenBuckets(inp.data(), n, &buckets);
  const size_t num_buckets = buckets.tokens.size();
  ASSERT_EQ(buckets.offsets.size(), num_buckets + 1);
  ASSERT_EQ(buckets.positions.size(), static_cast<size_t>(n));
  EXPECT_EQ(buckets.offsets.front(), 0);
  EXPECT_EQ(buckets.offsets.back(), n);
  EXPECT_EQ(num_buckets, std::set<int32_t>(inp.begin(), inp.end()).size());
  std::vector<bool> seen(n, false);
  for (size_t u = 0; u < num_buckets; ++u) {
    if (u > 0) {
      EXPECT_LT(buckets.tokens[u - 1], buckets.tokens[u]);
    }
    ASSERT_LT(buckets.offsets[u], buckets.offsets[u + 1]) << "empty bucket " << u;
    for (int32_t k = buckets.offsets[u]; k < buckets.offsets[u + 1]; ++k) {
      const int32_t pos = buckets.positions[k];
      ASSERT_GE(pos, 0);
      ASSERT_LT(pos, n);
      EXPECT_EQ(inp[pos], buckets.tokens[u]);
      if (k > buckets.offsets[u]) {
        EXPECT_LT(buckets.positions[k - 1], pos);
      }
      EXPECT_FALSE(seen[pos]) << "position " << pos << " twice";
      seen[pos] = true;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Encoder.

TYPED_TEST(ElementwiseKernelsTest, EncoderForwardMatchesCpu) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  using T = TypeParam;
  for (const int C : {96, 771}) {
    SCOPED_TRACE(::testing::Message() << "C=" << C);
    const int B = 3, Tn = 5, maxT = 8, V = 37;
    const std::vector<int32_t> inp = RandomTokens(B * Tn, V, 1);                    // (B, T)
    const std::vector<float> wte = RoundTo<T>(RandomVector(int64_t{V} * C, 2));     // (V, C)
    const std::vector<float> wpe = RoundTo<T>(RandomVector(int64_t{maxT} * C, 3));  // (maxT, C)
    const int64_t n = int64_t{B} * Tn * C;
    std::vector<float> want(n);  // (B, T, C)
    NaiveKernels().encoder_forward(want.data(), inp.data(), wte.data(), wpe.data(), B, Tn, C);

    auto d_inp = UploadRaw(inp);
    auto d_wte = Upload<T>(wte);
    auto d_wpe = Upload<T>(wpe);
    DeviceArray<T> d_out(n);
    OFFLOAD_ASSERT_CUDA_OK(
        EncoderForward<T>(d_out.get(), d_inp->get(), d_wte->get(), d_wpe->get(), B, Tn, C, 0));
    OFFLOAD_ASSERT_DEVICE_OK();
    const double err = MaxRelError(Download(d_out.get(), n), want);
    EXPECT_LE(err, KernelTolerance<T>()) << Sci(err);
  }
}

TYPED_TEST(ElementwiseKernelsTest, EncoderBackwardAccumulatesIntoDwteAndOverwritesDwpe) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  using T = TypeParam;
  for (const int C : {96, 771}) {
    SCOPED_TRACE(::testing::Message() << "C=" << C);
    const int B = 4, Tn = 7, maxT = 11, V = 50;
    // Tokens from the first 12 ids only: rows 12..V-1 must stay untouched, and 28 positions
    // over 12 ids repeat tokens; one token also fills a run of positions across a row boundary.
    std::vector<int32_t> inp = RandomTokens(B * Tn, 12, 21);  // (B, T)
    for (int i = 5; i < 10; ++i) inp[i] = 7;
    const std::vector<float> dwte0 = RoundTo<T>(RandomVector(int64_t{V} * C, 22));  // (V, C)
    const std::vector<float> dout = RoundTo<T>(RandomVector(int64_t{B} * Tn * C, 23));
    std::vector<float> want_dwte = dwte0;
    std::vector<float> want_dwpe(int64_t{maxT} * C, 0.0f);  // (maxT, C)
    NaiveKernels().encoder_backward(want_dwte.data(), want_dwpe.data(), dout.data(), inp.data(), B,
                                    Tn, C);

    TokenBuckets buckets;
    BuildTokenBuckets(inp.data(), B * Tn, &buckets);
    auto d_tokens = UploadRaw(buckets.tokens);
    auto d_offsets = UploadRaw(buckets.offsets);
    auto d_positions = UploadRaw(buckets.positions);
    const std::vector<T> dwte0_bits = ToStorage<T>(dwte0);
    auto d_dwte = UploadRaw(dwte0_bits);
    // Garbage in dwpe: every row of it must be overwritten.
    auto d_dwpe = Upload<T>(RandomVector(int64_t{maxT} * C, 24, 100.0f));
    auto d_dout = Upload<T>(dout);
    const auto run = [&] {
      return EncoderBackward<T>(d_dwte->get(), d_dwpe->get(), d_dout->get(), d_tokens->get(),
                                d_offsets->get(), d_positions->get(),
                                static_cast<int>(buckets.tokens.size()), B, Tn, maxT, C, 0);
    };
    OFFLOAD_ASSERT_CUDA_OK(run());
    OFFLOAD_ASSERT_DEVICE_OK();

    const std::vector<float> dwte = Download(d_dwte->get(), int64_t{V} * C);
    const double dwte_err = MaxRelError(dwte, want_dwte);
    EXPECT_LE(dwte_err, KernelTolerance<T>()) << Sci(dwte_err);
    const std::vector<T> dwte_bits = DownloadRaw(d_dwte->get(), int64_t{V} * C);
    const std::set<int32_t> used(inp.begin(), inp.end());
    for (int v = 0; v < V; ++v) {
      if (used.count(v) != 0) continue;
      for (int c = 0; c < C; ++c) {
        const int64_t i = int64_t{v} * C + c;
        ASSERT_TRUE(SameBits(dwte_bits[i], dwte0_bits[i])) << "untouched row " << v << " col " << c;
      }
    }

    const std::vector<float> dwpe = Download(d_dwpe->get(), int64_t{maxT} * C);
    const int64_t used_rows = int64_t{Tn} * C;
    const double dwpe_err = MaxRelError(dwpe.data(), want_dwpe.data(), used_rows);
    EXPECT_LE(dwpe_err, KernelTolerance<T>()) << Sci(dwpe_err);
    for (int64_t i = used_rows; i < int64_t{maxT} * C; ++i) {
      ASSERT_EQ(dwpe[i], 0.0f) << "dwpe row " << i / C << " beyond T";
    }

    // Deterministic: the same inputs give the same bits.
    const std::vector<T> first_dwpe = DownloadRaw(d_dwpe->get(), int64_t{maxT} * C);
    cudaMemcpy(d_dwte->get(), dwte0_bits.data(), dwte0_bits.size() * sizeof(T),
               cudaMemcpyHostToDevice);
    OFFLOAD_ASSERT_CUDA_OK(run());
    EXPECT_EQ(FirstBitDifference(DownloadRaw(d_dwte->get(), int64_t{V} * C), dwte_bits), -1);
    EXPECT_EQ(FirstBitDifference(DownloadRaw(d_dwpe->get(), int64_t{maxT} * C), first_dwpe), -1);
  }
}

// ---------------------------------------------------------------------------------------------
// LayerNorm.

// Inputs with a different mean per row, so the mean matters and the variance is taken around it.
std::vector<float> LayerNormInput(int N, int C, uint64_t seed) {
  std::vector<float> x = RandomVector(int64_t{N} * C, seed, 2.0f);
  for (int r = 0; r < N; ++r) {
    for (int c = 0; c < C; ++c) x[int64_t{r} * C + c] += 0.3f * static_cast<float>(r % 7);
  }
  return x;
}

std::vector<float> LayerNormWeight(int C, uint64_t seed) {
  std::vector<float> w = RandomVector(C, seed, 0.5f);
  for (float& x : w) x += 1.0f;
  return w;
}

struct RowsCols {
  int N;
  int C;
};

TYPED_TEST(ElementwiseKernelsTest, LayerNormForwardMatchesCpu) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  using T = TypeParam;
  for (const RowsCols shape : {RowsCols{74, 96}, RowsCols{37, 771}, RowsCols{5, 31}}) {
    const int N = shape.N, C = shape.C;
    SCOPED_TRACE(::testing::Message() << "N=" << N << " C=" << C);
    const std::vector<float> inp = RoundTo<T>(LayerNormInput(N, C, 31));   // (N, C)
    const std::vector<float> weight = RoundTo<T>(LayerNormWeight(C, 32));  // (C,)
    const std::vector<float> bias = RoundTo<T>(RandomVector(C, 33));       // (C,)
    std::vector<float> want_out(int64_t{N} * C), want_mean(N), want_rstd(N);
    NaiveKernels().layernorm_forward(want_out.data(), want_mean.data(), want_rstd.data(),
                                     inp.data(), weight.data(), bias.data(), 1, N, C);

    auto d_inp = Upload<T>(inp);
    auto d_weight = Upload<T>(weight);
    auto d_bias = Upload<T>(bias);
    DeviceArray<T> d_out(int64_t{N} * C);
    DeviceArray<float> d_mean(N), d_rstd(N);
    OFFLOAD_ASSERT_CUDA_OK(LayerNormForward<T>(d_out.get(), d_mean.get(), d_rstd.get(),
                                               d_inp->get(), d_weight->get(), d_bias->get(), N, C,
                                               0));
    OFFLOAD_ASSERT_DEVICE_OK();
    const double out_err = MaxRelError(Download(d_out.get(), int64_t{N} * C), want_out);
    EXPECT_LE(out_err, KernelTolerance<T>()) << Sci(out_err);
    const double mean_err = MaxRelError(Download(d_mean.get(), N), want_mean);
    EXPECT_LE(mean_err, kStatsTolerance) << Sci(mean_err);
    const double rstd_err = MaxRelError(Download(d_rstd.get(), N), want_rstd);
    EXPECT_LE(rstd_err, kStatsTolerance) << Sci(rstd_err);
  }
}

TYPED_TEST(ElementwiseKernelsTest, LayerNormBackwardAccumulatesDinpAndOverwritesParamGrads) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  using T = TypeParam;
  // 4099 rows: more than the chunk cap times the minimum chunk, so chunks hold 17 rows and the
  // last one is empty.
  for (const RowsCols shape : {RowsCols{74, 96}, RowsCols{37, 771}, RowsCols{4099, 96}}) {
    const int N = shape.N, C = shape.C;
    SCOPED_TRACE(::testing::Message() << "N=" << N << " C=" << C);
    const int64_t nc = int64_t{N} * C;
    const std::vector<float> inp = RoundTo<T>(LayerNormInput(N, C, 41));   // (N, C)
    const std::vector<float> weight = RoundTo<T>(LayerNormWeight(C, 42));  // (C,)
    const std::vector<float> bias = RoundTo<T>(RandomVector(C, 43));       // (C,)
    const std::vector<float> dout = RoundTo<T>(RandomVector(nc, 44));      // (N, C)
    const std::vector<float> dinp0 = RoundTo<T>(RandomVector(nc, 45));     // (N, C)
    // The statistics both sides use: the reference forward's, as the model would save them.
    std::vector<float> out(nc), mean(N), rstd(N);
    NaiveKernels().layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(),
                                     weight.data(), bias.data(), 1, N, C);
    std::vector<float> want_dinp = dinp0;
    std::vector<float> want_dweight(C, 0.0f), want_dbias(C, 0.0f);
    NaiveKernels().layernorm_backward(want_dinp.data(), want_dweight.data(), want_dbias.data(),
                                      dout.data(), inp.data(), weight.data(), mean.data(),
                                      rstd.data(), 1, N, C);

    auto d_inp = Upload<T>(inp);
    auto d_weight = Upload<T>(weight);
    auto d_dout = Upload<T>(dout);
    auto d_mean = UploadRaw(mean);
    auto d_rstd = UploadRaw(rstd);
    auto d_dinp = Upload<T>(dinp0);
    auto d_dweight = Upload<T>(RandomVector(C, 46, 50.0f));  // garbage: must be overwritten
    auto d_dbias = Upload<T>(RandomVector(C, 47, 50.0f));
    DeviceArray<float> scratch(LayerNormBackwardScratchFloats(N, C));
    const auto run = [&] {
      return LayerNormBackward<T>(d_dinp->get(), d_dweight->get(), d_dbias->get(), scratch.get(),
                                  d_dout->get(), d_inp->get(), d_weight->get(), d_mean->get(),
                                  d_rstd->get(), N, C, 0);
    };
    OFFLOAD_ASSERT_CUDA_OK(run());
    OFFLOAD_ASSERT_DEVICE_OK();
    const double dinp_err = MaxRelError(Download(d_dinp->get(), nc), want_dinp);
    EXPECT_LE(dinp_err, KernelTolerance<T>()) << Sci(dinp_err);
    const double dweight_err = MaxRelError(Download(d_dweight->get(), C), want_dweight);
    EXPECT_LE(dweight_err, KernelTolerance<T>()) << Sci(dweight_err);
    const double dbias_err = MaxRelError(Download(d_dbias->get(), C), want_dbias);
    EXPECT_LE(dbias_err, KernelTolerance<T>()) << Sci(dbias_err);

    // Deterministic, and dinp really accumulates: a second call from the same dinp gives the
    // same bits; one more call adds the same gradient again.
    const std::vector<T> dinp_bits = DownloadRaw(d_dinp->get(), nc);
    const std::vector<T> dweight_bits = DownloadRaw(d_dweight->get(), C);
    const std::vector<T> dbias_bits = DownloadRaw(d_dbias->get(), C);
    const std::vector<T> dinp0_bits = ToStorage<T>(dinp0);
    cudaMemcpy(d_dinp->get(), dinp0_bits.data(), nc * sizeof(T), cudaMemcpyHostToDevice);
    OFFLOAD_ASSERT_CUDA_OK(run());
    EXPECT_EQ(FirstBitDifference(DownloadRaw(d_dinp->get(), nc), dinp_bits), -1);
    EXPECT_EQ(FirstBitDifference(DownloadRaw(d_dweight->get(), C), dweight_bits), -1);
    EXPECT_EQ(FirstBitDifference(DownloadRaw(d_dbias->get(), C), dbias_bits), -1);
    OFFLOAD_ASSERT_CUDA_OK(run());
    NaiveKernels().layernorm_backward(want_dinp.data(), want_dweight.data(), want_dbias.data(),
                                      dout.data(), inp.data(), weight.data(), mean.data(),
                                      rstd.data(), 1, N, C);
    const double twice_err = MaxRelError(Download(d_dinp->get(), nc), want_dinp);
    EXPECT_LE(twice_err, 2 * KernelTolerance<T>()) << Sci(twice_err);
    // dweight and dbias are overwritten, not added to: still the single-pass sums.
    EXPECT_EQ(FirstBitDifference(DownloadRaw(d_dweight->get(), C), dweight_bits), -1);
    EXPECT_EQ(FirstBitDifference(DownloadRaw(d_dbias->get(), C), dbias_bits), -1);
  }
}

// ---------------------------------------------------------------------------------------------
// GELU and the residual add.

TYPED_TEST(ElementwiseKernelsTest, GeluForwardMatchesCpuAndWorksInPlace) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  using T = TypeParam;
  const int64_t n = 10007;
  // Up to +-6: the tanh saturates at both ends, and x^3 matters.
  const std::vector<float> inp = RoundTo<T>(RandomVector(n, 51, 6.0f));
  std::vector<float> want(n);
  NaiveKernels().gelu_forward(want.data(), inp.data(), n);

  auto d_inp = Upload<T>(inp);
  DeviceArray<T> d_out(n);
  OFFLOAD_ASSERT_CUDA_OK(GeluForward<T>(d_out.get(), d_inp->get(), n, 0));
  OFFLOAD_ASSERT_DEVICE_OK();
  const std::vector<T> out_bits = DownloadRaw(d_out.get(), n);
  const double err = MaxRelError(Download(d_out.get(), n), want);
  EXPECT_LE(err, KernelTolerance<T>()) << Sci(err);

  OFFLOAD_ASSERT_CUDA_OK(GeluForward<T>(d_inp->get(), d_inp->get(), n, 0));
  EXPECT_EQ(FirstBitDifference(DownloadRaw(d_inp->get(), n), out_bits), -1)
      << "in place differs from out of place";
}

TYPED_TEST(ElementwiseKernelsTest, GeluBackwardMatchesCpuAndWorksInPlace) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  using T = TypeParam;
  const int64_t n = 10007;
  const std::vector<float> inp = RoundTo<T>(RandomVector(n, 61, 6.0f));
  const std::vector<float> dout = RoundTo<T>(RandomVector(n, 62));
  std::vector<float> want(n);
  NaiveKernels().gelu_backward(want.data(), inp.data(), dout.data(), n);

  auto d_inp = Upload<T>(inp);
  auto d_dout = Upload<T>(dout);
  auto d_dinp = Upload<T>(RandomVector(n, 63, 10.0f));  // garbage: overwritten
  OFFLOAD_ASSERT_CUDA_OK(GeluBackward<T>(d_dinp->get(), d_inp->get(), d_dout->get(), n, 0));
  OFFLOAD_ASSERT_DEVICE_OK();
  const std::vector<T> dinp_bits = DownloadRaw(d_dinp->get(), n);
  const double err = MaxRelError(Download(d_dinp->get(), n), want);
  EXPECT_LE(err, KernelTolerance<T>()) << Sci(err);

  OFFLOAD_ASSERT_CUDA_OK(GeluBackward<T>(d_dout->get(), d_inp->get(), d_dout->get(), n, 0));
  EXPECT_EQ(FirstBitDifference(DownloadRaw(d_dout->get(), n), dinp_bits), -1)
      << "in place differs from out of place";
}

TYPED_TEST(ElementwiseKernelsTest, ResidualForwardMatchesCpuAndMayAliasAnInput) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  using T = TypeParam;
  // The large size makes every thread of the capped grid loop more than once.
  for (const int64_t n : {int64_t{10007}, (int64_t{1} << 24) + 4099}) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    const std::vector<float> a = RoundTo<T>(RandomVector(n, 71));
    const std::vector<float> b = RoundTo<T>(RandomVector(n, 72));
    std::vector<float> want(n);
    NaiveKernels().residual_forward(want.data(), a.data(), b.data(), n);

    auto d_a = Upload<T>(a);
    auto d_b = Upload<T>(b);
    DeviceArray<T> d_out(n);
    OFFLOAD_ASSERT_CUDA_OK(ResidualForward<T>(d_out.get(), d_a->get(), d_b->get(), n, 0));
    OFFLOAD_ASSERT_DEVICE_OK();
    const std::vector<T> out_bits = DownloadRaw(d_out.get(), n);
    const double err = MaxRelError(Download(d_out.get(), n), want);
    EXPECT_LE(err, KernelTolerance<T>()) << Sci(err);

    OFFLOAD_ASSERT_CUDA_OK(ResidualForward<T>(d_b->get(), d_a->get(), d_b->get(), n, 0));
    EXPECT_EQ(FirstBitDifference(DownloadRaw(d_b->get(), n), out_bits), -1);
    OFFLOAD_ASSERT_CUDA_OK(ResidualForward<T>(d_a->get(), d_a->get(), d_out.get(), n, 0));
    // a + (a + b) now: checks the first input may be the output too.
    std::vector<float> want2(n);
    NaiveKernels().residual_forward(want2.data(), a.data(), RoundTo<T>(want).data(), n);
    const double err2 = MaxRelError(Download(d_a->get(), n), want2);
    EXPECT_LE(err2, KernelTolerance<T>()) << Sci(err2);
  }
}

// ---------------------------------------------------------------------------------------------
// 16-byte vector loads (kernels/vector_access.h): the same data placed k elements past a 16-byte
// boundary. k = 0 takes the vector path (with a scalar tail when n is not a multiple of the
// width), any other k the scalar path; the elementwise kernels must give the same bits either
// way, and the k = 0 result must match the CPU.

// `values` on the device starting `offset` elements into an allocation (16-byte aligned at 0).
template <typename T>
struct Shifted {
  std::unique_ptr<DeviceArray<T>> array;
  int offset;
  T* get() const { return array->get() + offset; }
};

template <typename T>
Shifted<T> UploadShifted(const std::vector<float>& values, int offset) {
  std::vector<float> padded(offset + values.size(), 0.0f);
  std::copy(values.begin(), values.end(), padded.begin() + offset);
  return {Upload<T>(padded), offset};
}

constexpr int64_t kVectorLengths[] = {1, 7, 8, 9, 15, 1000, 1003, 4099};
constexpr int kVectorOffsets[] = {0, 1, 3};

TYPED_TEST(ElementwiseKernelsTest, GeluVectorAndScalarPathsGiveTheSameBits) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  using T = TypeParam;
  for (const int64_t n : kVectorLengths) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    const std::vector<float> inp = RoundTo<T>(RandomVector(n, 91, 6.0f));
    const std::vector<float> dout = RoundTo<T>(RandomVector(n, 92));
    std::vector<float> want_out(n), want_dinp(n);
    NaiveKernels().gelu_forward(want_out.data(), inp.data(), n);
    NaiveKernels().gelu_backward(want_dinp.data(), inp.data(), dout.data(), n);
    std::vector<std::vector<T>> outs, dinps;
    for (const int offset : kVectorOffsets) {
      const Shifted<T> d_inp = UploadShifted<T>(inp, offset);
      const Shifted<T> d_dout = UploadShifted<T>(dout, offset);
      const Shifted<T> d_out = UploadShifted<T>(std::vector<float>(n, 0.0f), offset);
      const Shifted<T> d_dinp = UploadShifted<T>(std::vector<float>(n, 0.0f), offset);
      OFFLOAD_ASSERT_CUDA_OK(GeluForward<T>(d_out.get(), d_inp.get(), n, 0));
      OFFLOAD_ASSERT_CUDA_OK(GeluBackward<T>(d_dinp.get(), d_inp.get(), d_dout.get(), n, 0));
      OFFLOAD_ASSERT_DEVICE_OK();
      outs.push_back(DownloadRaw(d_out.get(), n));
      dinps.push_back(DownloadRaw(d_dinp.get(), n));
      if (offset == 0) {
        EXPECT_LE(MaxRelError(Download(d_out.get(), n), want_out), KernelTolerance<T>());
        EXPECT_LE(MaxRelError(Download(d_dinp.get(), n), want_dinp), KernelTolerance<T>());
      }
    }
    for (size_t k = 1; k < outs.size(); ++k) {
      EXPECT_EQ(FirstBitDifference(outs[k], outs[0]), -1) << "offset " << kVectorOffsets[k];
      EXPECT_EQ(FirstBitDifference(dinps[k], dinps[0]), -1) << "offset " << kVectorOffsets[k];
    }
  }
}

TYPED_TEST(ElementwiseKernelsTest, ResidualVectorAndScalarPathsGiveTheSameBits) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  using T = TypeParam;
  for (const int64_t n : kVectorLengths) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    const std::vector<float> a = RoundTo<T>(RandomVector(n, 93));
    const std::vector<float> b = RoundTo<T>(RandomVector(n, 94));
    std::vector<float> want(n);
    NaiveKernels().residual_forward(want.data(), a.data(), b.data(), n);
    std::vector<std::vector<T>> outs;
    for (const int offset : kVectorOffsets) {
      const Shifted<T> d_a = UploadShifted<T>(a, offset);
      const Shifted<T> d_b = UploadShifted<T>(b, offset);
      const Shifted<T> d_out = UploadShifted<T>(std::vector<float>(n, 0.0f), offset);
      OFFLOAD_ASSERT_CUDA_OK(ResidualForward<T>(d_out.get(), d_a.get(), d_b.get(), n, 0));
      OFFLOAD_ASSERT_DEVICE_OK();
      outs.push_back(DownloadRaw(d_out.get(), n));
      if (offset == 0) {
        EXPECT_LE(MaxRelError(Download(d_out.get(), n), want), KernelTolerance<T>());
      }
    }
    for (size_t k = 1; k < outs.size(); ++k) {
      EXPECT_EQ(FirstBitDifference(outs[k], outs[0]), -1) << "offset " << kVectorOffsets[k];
    }
  }
}

// LayerNorm's rows sum in another order on the vector path, so the two paths may differ in the
// statistics' last bits: each is held to the CPU within the kernel tolerances instead. Rows of
// 768 are all aligned at offset 0, all unaligned at offset 1; rows of 771 alternate.
TYPED_TEST(ElementwiseKernelsTest, LayerNormVectorAndScalarRowsMatchCpu) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  using T = TypeParam;
  for (const RowsCols shape : {RowsCols{9, 768}, RowsCols{9, 771}, RowsCols{3, 5}}) {
    const int N = shape.N, C = shape.C;
    const int64_t nc = int64_t{N} * C;
    const std::vector<float> inp = RoundTo<T>(LayerNormInput(N, C, 95));
    const std::vector<float> weight = RoundTo<T>(LayerNormWeight(C, 96));
    const std::vector<float> bias = RoundTo<T>(RandomVector(C, 97));
    const std::vector<float> dout = RoundTo<T>(RandomVector(nc, 98));
    const std::vector<float> dinp0 = RoundTo<T>(RandomVector(nc, 99));
    std::vector<float> want_out(nc), want_mean(N), want_rstd(N);
    NaiveKernels().layernorm_forward(want_out.data(), want_mean.data(), want_rstd.data(),
                                     inp.data(), weight.data(), bias.data(), 1, N, C);
    std::vector<float> want_dinp = dinp0, want_dweight(C, 0.0f), want_dbias(C, 0.0f);
    NaiveKernels().layernorm_backward(want_dinp.data(), want_dweight.data(), want_dbias.data(),
                                      dout.data(), inp.data(), weight.data(), want_mean.data(),
                                      want_rstd.data(), 1, N, C);
    auto d_weight = Upload<T>(weight);
    auto d_bias = Upload<T>(bias);
    auto d_mean_ref = UploadRaw(want_mean);
    auto d_rstd_ref = UploadRaw(want_rstd);
    for (const int offset : kVectorOffsets) {
      SCOPED_TRACE(::testing::Message() << "N=" << N << " C=" << C << " offset=" << offset);
      const Shifted<T> d_inp = UploadShifted<T>(inp, offset);
      const Shifted<T> d_out = UploadShifted<T>(std::vector<float>(nc, 0.0f), offset);
      const Shifted<T> d_dout = UploadShifted<T>(dout, offset);
      const Shifted<T> d_dinp = UploadShifted<T>(dinp0, offset);
      DeviceArray<float> d_mean(N), d_rstd(N);
      OFFLOAD_ASSERT_CUDA_OK(LayerNormForward<T>(d_out.get(), d_mean.get(), d_rstd.get(),
                                                 d_inp.get(), d_weight->get(), d_bias->get(), N, C,
                                                 0));
      DeviceArray<T> d_dweight(C), d_dbias(C);
      DeviceArray<float> scratch(LayerNormBackwardScratchFloats(N, C));
      OFFLOAD_ASSERT_CUDA_OK(LayerNormBackward<T>(
          d_dinp.get(), d_dweight.get(), d_dbias.get(), scratch.get(), d_dout.get(), d_inp.get(),
          d_weight->get(), d_mean_ref->get(), d_rstd_ref->get(), N, C, 0));
      OFFLOAD_ASSERT_DEVICE_OK();
      const double out_err = MaxRelError(Download(d_out.get(), nc), want_out);
      EXPECT_LE(out_err, KernelTolerance<T>()) << Sci(out_err);
      EXPECT_LE(MaxRelError(Download(d_mean.get(), N), want_mean), kStatsTolerance);
      EXPECT_LE(MaxRelError(Download(d_rstd.get(), N), want_rstd), kStatsTolerance);
      const double dinp_err = MaxRelError(Download(d_dinp.get(), nc), want_dinp);
      EXPECT_LE(dinp_err, KernelTolerance<T>()) << Sci(dinp_err);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Bias gradient.

TYPED_TEST(ElementwiseKernelsTest, BiasGradIsColumnSumAndDeterministic) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  using T = TypeParam;
  for (const RowsCols shape :
       {RowsCols{1000, 771}, RowsCols{4099, 96}, RowsCols{5, 2304}, RowsCols{1, 3}}) {
    const int N = shape.N, OC = shape.C;
    SCOPED_TRACE(::testing::Message() << "N=" << N << " OC=" << OC);
    const std::vector<float> dout = RoundTo<T>(RandomVector(int64_t{N} * OC, 81));  // (N, OC)
    std::vector<double> sums(OC, 0.0);
    for (int r = 0; r < N; ++r) {
      for (int c = 0; c < OC; ++c) sums[c] += dout[int64_t{r} * OC + c];
    }
    const std::vector<float> want(sums.begin(), sums.end());

    auto d_dout = Upload<T>(dout);
    auto d_dbias = Upload<T>(RandomVector(OC, 82, 50.0f));  // garbage: overwritten
    DeviceArray<float> scratch(BiasGradScratchFloats(N, OC));
    OFFLOAD_ASSERT_CUDA_OK(BiasGrad<T>(d_dbias->get(), scratch.get(), d_dout->get(), N, OC, 0));
    OFFLOAD_ASSERT_DEVICE_OK();
    const std::vector<T> first = DownloadRaw(d_dbias->get(), OC);
    const double err = MaxRelError(Download(d_dbias->get(), OC), want);
    EXPECT_LE(err, KernelTolerance<T>()) << Sci(err);

    OFFLOAD_ASSERT_CUDA_OK(BiasGrad<T>(d_dbias->get(), scratch.get(), d_dout->get(), N, OC, 0));
    EXPECT_EQ(FirstBitDifference(DownloadRaw(d_dbias->get(), OC), first), -1);
  }
}

// ---------------------------------------------------------------------------------------------
// Conversions: bit for bit against the host's (dtype.h), NaN only as NaN.

std::vector<float> ConversionProbes() {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(),
                          -std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::min(),
                          std::numeric_limits<float>::denorm_min(),
                          1e-40f,           // fp32 subnormal
                          65504.0f,         // fp16 max
                          65519.996f,       // just below fp16's overflow threshold
                          65520.0f,         // rounds to inf in fp16
                          6e-8f,            // fp16 subnormal
                          0x1p-25f,         // fp16 tie to zero
                          0x1.8p-25f,       // above the tie: rounds to 2^-24
                          0x1.002p0f,       // fp16 tie, even below
                          0x1.006p0f,       // fp16 tie, even above
                          0x1.01p0f,        // bf16 tie, even below
                          0x1.03p0f,        // bf16 tie, even above
                          0x1.fffffep127f,  // bf16 rounds to inf
                          3.0e38f};
  TestRng rng(91);
  for (int i = 0; i < (1 << 20); ++i) {
    v.push_back(BitsToFloat(static_cast<uint32_t>(rng.Next())));  // every exponent, NaNs too
  }
  for (int i = 0; i < (1 << 16); ++i) {
    // Ordinary magnitudes, where training values live.
    v.push_back(rng.Uniform(-1.0f, 1.0f) * std::ldexp(1.0f, static_cast<int>(rng.Int(50)) - 30));
  }
  return v;
}

TYPED_TEST(ElementwiseKernelsTest, ConvertFromFloatMatchesHostConversion) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  using T = TypeParam;
  const std::vector<float> in = ConversionProbes();
  const int64_t n = static_cast<int64_t>(in.size());
  auto d_in = UploadRaw(in);
  DeviceArray<T> d_out(n);
  OFFLOAD_ASSERT_CUDA_OK(ConvertFromFloat<T>(d_out.get(), d_in->get(), n, 0));
  OFFLOAD_ASSERT_DEVICE_OK();
  const std::vector<T> out = DownloadRaw(d_out.get(), n);
  int64_t mismatches = 0;
  for (int64_t i = 0; i < n; ++i) {
    const T want = HostFromFloat<T>(in[i]);
    const bool both_nan = std::isnan(HostToFloat<T>(out[i])) && std::isnan(HostToFloat<T>(want));
    if (SameBits(out[i], want) || both_nan) continue;
    if (++mismatches <= 5) {
      ADD_FAILURE() << "in bits 0x" << std::hex << FloatBits(in[i]) << " (" << in[i] << "): device "
                    << HostToFloat<T>(out[i]) << ", host " << HostToFloat<T>(want);
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TYPED_TEST(ElementwiseKernelsTest, ConvertToFloatMatchesHostConversion) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  using T = TypeParam;
  std::vector<T> in;
  if constexpr (std::is_same_v<T, float>) {
    in = ConversionProbes();
  } else {
    for (uint32_t bits = 0; bits < 65536; ++bits) {  // every 16-bit pattern
      const uint16_t b16 = static_cast<uint16_t>(bits);
      T x;
      std::memcpy(static_cast<void*>(&x), &b16, sizeof(x));
      in.push_back(x);
    }
  }
  const int64_t n = static_cast<int64_t>(in.size());
  auto d_in = UploadRaw(in);
  DeviceArray<float> d_out(n);
  OFFLOAD_ASSERT_CUDA_OK(ConvertToFloat<T>(d_out.get(), d_in->get(), n, 0));
  OFFLOAD_ASSERT_DEVICE_OK();
  const std::vector<float> out = DownloadRaw(d_out.get(), n);
  int64_t mismatches = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float want = HostToFloat<T>(in[i]);
    if (FloatBits(out[i]) == FloatBits(want) || (std::isnan(out[i]) && std::isnan(want))) continue;
    if (++mismatches <= 5) ADD_FAILURE() << "element " << i << ": " << out[i] << " vs " << want;
  }
  EXPECT_EQ(mismatches, 0);
}

// ---------------------------------------------------------------------------------------------
// Gradient norm.

double HostSumSquares(const std::vector<float>& values) {
  double sum = 0.0;
  for (float x : values) sum += double{x} * double{x};
  return sum;
}

GradNormResult ReadResult(const GradNormResult* device) {
  GradNormResult host{};
  cudaDeviceSynchronize();
  cudaMemcpy(&host, device, sizeof(host), cudaMemcpyDeviceToHost);
  return host;
}

// Accumulation is in double, so far tighter than fp32 summation would allow.
constexpr double kNormTolerance = 1e-9;

TYPED_TEST(ElementwiseKernelsTest, GradNormAccumulatesRangesIntoOneResult) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  using T = TypeParam;
  // Sizes below one block, odd, and above the grid cap (1024 blocks x 256), so threads loop.
  const std::vector<int64_t> sizes = {5, 10007, 300007};
  // Gradients still multiplied by a loss scale: magnitudes up to 100.
  std::vector<std::vector<float>> ranges;
  std::vector<std::unique_ptr<DeviceArray<T>>> device_ranges;
  double want = 0.0;
  for (size_t r = 0; r < sizes.size(); ++r) {
    ranges.push_back(RoundTo<T>(RandomVector(sizes[r], 101 + r, 100.0f)));
    device_ranges.push_back(Upload<T>(ranges.back()));
    want += HostSumSquares(ranges.back());
  }
  DeviceArray<GradNormResult> result(1);
  DeviceArray<double> scratch(GradNormScratchDoubles());
  const auto accumulate_all = [&] {
    cudaMemset(result.get(), 0, sizeof(GradNormResult));
    for (size_t r = 0; r < sizes.size(); ++r) {
      const cudaError_t e =
          GradNormAccumulate<T>(result.get(), scratch.get(), device_ranges[r]->get(), sizes[r], 0);
      if (e != cudaSuccess) return e;
    }
    return cudaDeviceSynchronize();
  };
  OFFLOAD_ASSERT_CUDA_OK(accumulate_all());
  const GradNormResult got = ReadResult(result.get());
  EXPECT_EQ(got.nonfinite, 0);
  EXPECT_NEAR(got.sum_squares, want, kNormTolerance * want);

  OFFLOAD_ASSERT_CUDA_OK(accumulate_all());
  const GradNormResult again = ReadResult(result.get());
  EXPECT_TRUE(SameBits(again.sum_squares, got.sum_squares)) << "not deterministic";
}

TYPED_TEST(ElementwiseKernelsTest, GradNormFlagsNanAndInf) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  using T = TypeParam;
  const int64_t n = 70001;
  const std::vector<float> clean = RoundTo<T>(RandomVector(n, 111));
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity()}) {
    for (const int64_t where : {int64_t{0}, n / 2 + 3, n - 1}) {
      SCOPED_TRACE(::testing::Message() << bad << " at " << where);
      std::vector<float> dirty = clean;
      dirty[where] = bad;
      auto d_clean = Upload<T>(clean);
      auto d_dirty = Upload<T>(dirty);
      DeviceArray<GradNormResult> result(1);
      DeviceArray<double> scratch(GradNormScratchDoubles());
      // A clean range, the bad one, a clean one again: the flag must survive the later range.
      OFFLOAD_ASSERT_CUDA_OK(
          GradNormAccumulate<T>(result.get(), scratch.get(), d_clean->get(), n, 0));
      EXPECT_EQ(ReadResult(result.get()).nonfinite, 0);
      OFFLOAD_ASSERT_CUDA_OK(
          GradNormAccumulate<T>(result.get(), scratch.get(), d_dirty->get(), n, 0));
      OFFLOAD_ASSERT_CUDA_OK(
          GradNormAccumulate<T>(result.get(), scratch.get(), d_clean->get(), n, 0));
      OFFLOAD_ASSERT_DEVICE_OK();
      const GradNormResult got = ReadResult(result.get());
      EXPECT_EQ(got.nonfinite, 1);
    }
  }
  // The largest finite values square to large but finite sums: not flagged.
  float big = std::numeric_limits<float>::max();
  if constexpr (std::is_same_v<T, __half>) big = 65504.0f;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) big = BitsToFloat(0x7f7f0000u);
  const std::vector<float> large(1000, big);
  auto d_large = Upload<T>(RoundTo<T>(large));
  DeviceArray<GradNormResult> result(1);
  DeviceArray<double> scratch(GradNormScratchDoubles());
  OFFLOAD_ASSERT_CUDA_OK(
      GradNormAccumulate<T>(result.get(), scratch.get(), d_large->get(), 1000, 0));
  const GradNormResult got = ReadResult(result.get());
  EXPECT_EQ(got.nonfinite, 0);
  EXPECT_TRUE(std::isfinite(got.sum_squares));
}

// Element indices beyond 2^31: one fp16 value everywhere (memset), a different one last.
TEST(GradNormLargeTest, CountsElementsBeyondTwoToThe31) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  const int64_t n = (int64_t{1} << 31) + 12345;
  __half* x = nullptr;
  if (cudaMalloc(&x, static_cast<size_t>(n) * sizeof(__half)) != cudaSuccess) {
    cudaGetLastError();
    GTEST_SKIP() << "cannot allocate " << n * sizeof(__half) << " bytes";
  }
  ASSERT_EQ(cudaMemset(x, 0x3c, static_cast<size_t>(n) * sizeof(__half)), cudaSuccess);
  const __half last = HostFromFloat<__half>(3.0f);
  ASSERT_EQ(cudaMemcpy(x + n - 1, &last, sizeof(last), cudaMemcpyHostToDevice), cudaSuccess);
  uint16_t fill_bits = 0x3c3c;
  __half fill;
  std::memcpy(static_cast<void*>(&fill), &fill_bits, sizeof(fill));
  const double v = HostToFloat(fill);
  const double want = static_cast<double>(n - 1) * v * v + 9.0;

  DeviceArray<GradNormResult> result(1);
  DeviceArray<double> scratch(GradNormScratchDoubles());
  const cudaError_t e = GradNormAccumulate<__half>(result.get(), scratch.get(), x, n, 0);
  const GradNormResult got = ReadResult(result.get());
  cudaFree(x);
  ASSERT_EQ(e, cudaSuccess) << cudaGetErrorString(e);
  EXPECT_EQ(got.nonfinite, 0);
  EXPECT_NEAR(got.sum_squares, want, 1e-12 * want);
}

// ---------------------------------------------------------------------------------------------
// AdamW: bit for bit against the CPU scalar reference, over several steps.

struct AdamCase {
  const char* name;
  AdamHyperParams hp;
  float grad_multiplier;
  bool with_out;
};

std::vector<AdamCase> AdamCases() {
  AdamHyperParams adamw;
  adamw.lr = 1e-3f;
  adamw.weight_decay = 0.1f;
  adamw.adamw = true;
  AdamHyperParams adam_l2;
  adam_l2.lr = 2e-3f;
  adam_l2.weight_decay = 0.01f;
  adam_l2.adamw = false;
  AdamHyperParams plain;
  plain.lr = 3e-4f;
  plain.weight_decay = 0.0f;
  plain.bias_correction = false;
  return {{"adamw", adamw, 1.0f, true},
          {"adam_l2_loss_scaled", adam_l2, 1.0f / 1024.0f, true},
          {"no_decay_no_bias_correction_no_out", plain, 0.5f, false}};
}

// Gradients over many binades, from 2^-64, whose (1 - beta2) g^2 is an fp32 subnormal: a
// flushed denormal on either side would break bit equality.
std::vector<float> AdamGradients(int64_t n, uint64_t seed) {
  TestRng rng(seed);
  std::vector<float> g(n);
  for (float& x : g) {
    x = rng.Uniform(-1.0f, 1.0f) * std::ldexp(1.0f, static_cast<int>(rng.Int(72)) - 64);
  }
  g[0] = 0.0f;
  return g;
}

TYPED_TEST(ElementwiseKernelsTest, AdamWEqualsCpuScalarReferenceBitForBit) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  using T = TypeParam;
  constexpr bool kIsFloat = std::is_same_v<T, float>;
  const int64_t n = 10007;
  for (const AdamCase& c : AdamCases()) {
    SCOPED_TRACE(c.name);
    std::vector<float> param = RandomVector(n, 121);
    std::vector<float> exp_avg(n, 0.0f), exp_avg_sq(n, 0.0f);
    std::vector<uint16_t> out16(n, 0);
    auto d_param = UploadRaw(param);
    auto d_exp_avg = UploadRaw(exp_avg);
    auto d_exp_avg_sq = UploadRaw(exp_avg_sq);
    DeviceArray<T> d_out(n);
    for (int t = 1; t <= 4; ++t) {
      SCOPED_TRACE(::testing::Message() << "step " << t);
      const std::vector<T> grad = ToStorage<T>(AdamGradients(n, 130 + t));
      const float lr = c.hp.lr * (1.0f - 0.1f * t);  // lr may change per step
      const AdamStepScalars s = ComputeAdamStepScalars(c.hp, lr, t, c.grad_multiplier);

      AdamSpan span;
      span.grad = grad.data();
      span.grad_dtype = StorageDType<T>();
      span.param = param.data();
      span.exp_avg = exp_avg.data();
      span.exp_avg_sq = exp_avg_sq.data();
      span.out = !kIsFloat && c.with_out ? out16.data() : nullptr;
      span.out_dtype = kIsFloat ? DType::kFp16 : StorageDType<T>();
      span.n = n;
      internal::AdamScalar(s, span);

      auto d_grad = UploadRaw(grad);
      OFFLOAD_ASSERT_CUDA_OK(AdamWUpdate<T>(s, d_grad->get(), d_param->get(), d_exp_avg->get(),
                                            d_exp_avg_sq->get(), c.with_out ? d_out.get() : nullptr,
                                            n, 0));
      OFFLOAD_ASSERT_DEVICE_OK();
      const std::vector<float> got_param = DownloadRaw(d_param->get(), n);
      ASSERT_EQ(FirstBitDifference(got_param, param), -1) << "param";
      ASSERT_EQ(FirstBitDifference(DownloadRaw(d_exp_avg->get(), n), exp_avg), -1) << "exp_avg";
      ASSERT_EQ(FirstBitDifference(DownloadRaw(d_exp_avg_sq->get(), n), exp_avg_sq), -1)
          << "exp_avg_sq";
      if (!c.with_out) continue;
      const std::vector<T> got_out = DownloadRaw(d_out.get(), n);
      if constexpr (kIsFloat) {
        ASSERT_EQ(FirstBitDifference(got_out, got_param), -1) << "fp32 out is not the param";
      } else {
        std::vector<uint16_t> got_bits(n);
        std::memcpy(got_bits.data(), got_out.data(), n * sizeof(uint16_t));
        ASSERT_EQ(FirstBitDifference(got_bits, out16), -1) << "16-bit out";
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launch handling: empty inputs succeed without launching a 0-block grid (which would fail) but
// still produce the outputs an empty reduction defines; a launch error is returned, not
// swallowed.

TYPED_TEST(ElementwiseKernelsTest, EmptyInputsSucceedAndDefineOverwrittenOutputs) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  using T = TypeParam;
  EXPECT_EQ(EncoderForward<T>(nullptr, nullptr, nullptr, nullptr, 0, 4, 8, 0), cudaSuccess);
  EXPECT_EQ(LayerNormForward<T>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 8, 0),
            cudaSuccess);
  EXPECT_EQ(GeluForward<T>(nullptr, nullptr, 0, 0), cudaSuccess);
  EXPECT_EQ(GeluBackward<T>(nullptr, nullptr, nullptr, 0, 0), cudaSuccess);
  EXPECT_EQ(ResidualForward<T>(nullptr, nullptr, nullptr, 0, 0), cudaSuccess);
  EXPECT_EQ(ConvertFromFloat<T>(nullptr, nullptr, 0, 0), cudaSuccess);
  EXPECT_EQ(ConvertToFloat<T>(nullptr, nullptr, 0, 0), cudaSuccess);
  EXPECT_EQ(AdamWUpdate<T>(AdamStepScalars{}, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0),
            cudaSuccess);
  EXPECT_EQ(BiasGrad<T>(nullptr, nullptr, nullptr, 0, 0, 0), cudaSuccess);
  EXPECT_EQ(LayerNormBackward<T>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                 nullptr, nullptr, 4, 0, 0),
            cudaSuccess);

  DeviceArray<GradNormResult> result(1);
  const GradNormResult seeded{2.5, 0};
  cudaMemcpy(result.get(), &seeded, sizeof(seeded), cudaMemcpyHostToDevice);
  EXPECT_EQ(GradNormAccumulate<T>(result.get(), nullptr, nullptr, 0, 0), cudaSuccess);
  EXPECT_EQ(ReadResult(result.get()).sum_squares, 2.5);

  // Sums over no rows are zero, and these outputs are overwritten.
  const int C = 37, maxT = 6;
  auto d_dweight = Upload<T>(RandomVector(C, 141, 5.0f));
  auto d_dbias = Upload<T>(RandomVector(C, 142, 5.0f));
  EXPECT_EQ(LayerNormBackward<T>(nullptr, d_dweight->get(), d_dbias->get(), nullptr, nullptr,
                                 nullptr, nullptr, nullptr, nullptr, 0, C, 0),
            cudaSuccess);
  auto d_bias_grad = Upload<T>(RandomVector(C, 143, 5.0f));
  EXPECT_EQ(BiasGrad<T>(d_bias_grad->get(), nullptr, nullptr, 0, C, 0), cudaSuccess);
  auto d_dwpe = Upload<T>(RandomVector(int64_t{maxT} * C, 144, 5.0f));
  EXPECT_EQ(EncoderBackward<T>(nullptr, d_dwpe->get(), nullptr, nullptr, nullptr, nullptr, 0, 0, 4,
                               maxT, C, 0),
            cudaSuccess);
  OFFLOAD_ASSERT_DEVICE_OK();
  const std::vector<float> zeros(C, 0.0f);
  EXPECT_EQ(Download(d_dweight->get(), C), zeros);
  EXPECT_EQ(Download(d_dbias->get(), C), zeros);
  EXPECT_EQ(Download(d_bias_grad->get(), C), zeros);
  EXPECT_EQ(Download(d_dwpe->get(), int64_t{maxT} * C),
            std::vector<float>(int64_t{maxT} * C, 0.0f));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TYPED_TEST(ElementwiseKernelsTest, LaunchErrorIsReturned) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  using T = TypeParam;
  // 10^7 channels need more than the 65535 channel tiles grid.y allows: the launch fails before
  // the kernel runs (so no memory is touched) and the launcher must say so.
  const int C = 10000000;
  EXPECT_NE(
      EncoderBackward<T>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 1, 1, 1, 0, C, 0),
      cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the launcher should have consumed the error";
}

}  // namespace
}  // namespace offload
