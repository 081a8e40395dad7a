// cuDNN's fused causal attention (cudnn_attention.h) against the CPU naive kernels, in fp16 and
// bf16, on awkward shapes (odd T, head sizes 16, 32 and 64, several heads and batches), with
// the bound taken from a noise floor measured in the same test: the error of the reference CUDA
// attention (blas/attention.h) against the same CPU result. Outputs start as NaN, so anything
// cuDNN leaves unwritten fails. Also: the softmax statistics it saves, the plan cache, a
// workspace too small and shapes its engines do not take. Every test skips without a GPU, and
// without cuDNN (saying why); the names hold "Cudnn" so `--gtest_filter=*Cudnn*` runs them all.
#include "gpu_trainer/cuda/cudnn/cudnn_attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu_trainer/cuda/blas/attention.h"
#include "gpu_trainer/cuda/blas/gemm.h"
#include "gpu_trainer/cuda/runtime/cuda_test_util.h"
#include "gpu_trainer/model/layers_naive.h"
#include "gpu_trainer/model/model_test_util.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

using testing_util::DeviceArray;
using testing_util::Download;
using testing_util::KernelTolerance;
using testing_util::MaxRelError;
using testing_util::RandomVector;
using testing_util::RoundTo;
using testing_util::Upload;

std::vector<float> Nans(int64_t n) { return std::vector<float>(n, NAN); }

struct Shape {
  int B, T, C, NH;
};

// hs 32 with T over two warps' worth; hs 16, three heads, odd T (the model tests' shape); hs 64
// (GPT-2's) with T = 70.
constexpr Shape kShapes[] = {{2, 37, 96, 3}, {3, 17, 48, 3}, {1, 70, 128, 2}};

// The bound on cuDNN's error: twice the reference's own error on the same data, and never below
// one kernel tolerance (one rounding of each output to T plus fp32 reordering), so a floor that
// happens to be small cannot demand better than the format holds. Both paths round P (the
// softmax weights) to T before the second product and the output once; the reference rounds
// the scores too, cuDNN keeps them in fp32, so cuDNN is expected at or below the floor. A wrong
// stride, scale, mask or statistic is off by O(1), hundreds of floors.
double Bound(double floor, double tolerance) { return std::max(2.0 * floor, tolerance); }

template <typename T>
class CudnnAttentionTest : public ::testing::Test {
 protected:
  // After OFFLOAD_SKIP_WITHOUT_CUDA(); sets skip_ with the reason when there is no cuDNN.
  void Init() {
    absl::StatusOr<std::unique_ptr<CublasLt>> lt = CublasLt::Create();
    ASSERT_TRUE(lt.ok()) << lt.status();
    lt_ = std::move(*lt);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    absl::StatusOr<std::unique_ptr<CudnnAttention>> cudnn =
        CudnnAttention::Create(StorageDType<T>());
    if (!cudnn.ok()) {
      ASSERT_EQ(cudnn.status().code(), absl::StatusCode::kUnavailable) << cudnn.status();
      skip_ = std::string(cudnn.status().message());
      return;
    }
    cudnn_ = std::move(*cudnn);
    std::printf("cuDNN %lld\n", static_cast<long long>(cudnn_->version()));
  }
  // Plans for the shape and a workspace that holds them.
  void PrepareShape(const Shape& s) {
    absl::StatusOr<int64_t> need = cudnn_->Prepare(s.B, s.T, s.C, s.NH);
    ASSERT_TRUE(need.ok()) << need.status();
    workspace_ = std::make_unique<DeviceArray<uint8_t>>(std::max<int64_t>(*need, 256));
    cudnn_->SetWorkspace(workspace_->get(), *need);
    std::printf("B=%d T=%d C=%d NH=%d: workspace %lld bytes\n", s.B, s.T, s.C, s.NH,
                static_cast<long long>(*need));
  }
  void TearDown() override {
    cudnn_.reset();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  void Sync() { ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess); }

  std::unique_ptr<CublasLt> lt_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<CudnnAttention> cudnn_;
  std::unique_ptr<DeviceArray<uint8_t>> workspace_;
  std::string skip_;
};

class SixteenBitNames {
 public:
  template <typename T>
  static std::string GetName(int) {
    return std::is_same_v<T, __half> ? "fp16" : "bf16";
  }
};

using SixteenBitTypes = ::testing::Types<__half, __nv_bfloat16>;
TYPED_TEST_SUITE(CudnnAttentionTest, SixteenBitTypes, SixteenBitNames);

#define OFFLOAD_INIT_CUDNN_OR_SKIP()     \
  OFFLOAD_SKIP_WITHOUT_CUDA();           \
  ASSERT_NO_FATAL_FAILURE(this->Init()); \
  if (this->cudnn_ == nullptr) GTEST_SKIP() << this->skip_

// The statistics a row's softmax is max + log(sum(exp)) of: of the scaled scores q . k / sqrt(hs)
// over keys 0..t, in double from the same rounded inputs.
std::vector<double> CpuStats(const std::vector<float>& qkv, const Shape& s) {
  const int hs = s.C / s.NH;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  std::vector<double> stats(static_cast<size_t>(s.B) * s.NH * s.T);
  for (int b = 0; b < s.B; ++b) {
    for (int h = 0; h < s.NH; ++h) {
      for (int t = 0; t < s.T; ++t) {
        const float* q = &qkv[(static_cast<size_t>(b) * s.T + t) * 3 * s.C + h * hs];
        std::vector<double> scores(t + 1);
        double max_score = -INFINITY;
        for (int t2 = 0; t2 <= t; ++t2) {
          const float* k = &qkv[(static_cast<size_t>(b) * s.T + t2) * 3 * s.C + s.C + h * hs];
          double dot = 0;
          for (int i = 0; i < hs; ++i) dot += double{q[i]} * k[i];
          scores[t2] = dot * scale;
          max_score = std::max(max_score, scores[t2]);
        }
        double sum = 0;
        for (double x : scores) sum += std::exp(x - max_score);
        stats[(static_cast<size_t>(b) * s.NH + h) * s.T + t] = max_score + std::log(sum);
      }
    }
  }
  return stats;
}

TYPED_TEST(CudnnAttentionTest, CudnnForwardMatchesCpu) {
  using T = TypeParam;
  OFFLOAD_INIT_CUDNN_OR_SKIP();
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(::testing::Message()
                 << "B=" << s.B << " T=" << s.T << " C=" << s.C << " NH=" << s.NH);
    ASSERT_NO_FATAL_FAILURE(this->PrepareShape(s));
    const int64_t btc = static_cast<int64_t>(s.B) * s.T * s.C;
    const int64_t att_size = static_cast<int64_t>(s.B) * s.NH * s.T * s.T;
    const int64_t rows = static_cast<int64_t>(s.B) * s.NH * s.T;
    const std::vector<float> qkv = RoundTo<T>(RandomVector(3 * btc, 1));
    auto d_qkv = Upload<T>(qkv);
    auto d_out = Upload<T>(Nans(btc));
    auto d_stats = Upload<float>(Nans(rows));
    absl::Status status = this->cudnn_->Forward(d_out->get(), d_stats->get(), d_qkv->get(), s.B,
                                                s.T, s.C, s.NH, this->stream_);
    ASSERT_TRUE(status.ok()) << status;
    ASSERT_NO_FATAL_FAILURE(this->Sync());

    // The reference CUDA attention on the same input: the floor.
    auto r_out = Upload<T>(Nans(btc));
    auto r_att = Upload<T>(Nans(att_size));
    auto r_scratch = Upload<T>(Nans(AttentionScratchElems(s.B, s.T, s.C, s.NH)));
    status = AttentionForward<T>(*this->lt_, r_out->get(), r_att->get(), r_scratch->get(),
                                 d_qkv->get(), s.B, s.T, s.C, s.NH, this->stream_);
    ASSERT_TRUE(status.ok()) << status;
    ASSERT_NO_FATAL_FAILURE(this->Sync());

    std::vector<float> out(btc), preatt(att_size), att(att_size);
    NaiveKernels().attention_forward(out.data(), preatt.data(), att.data(), qkv.data(), s.B, s.T,
                                     s.C, s.NH);
    const double err = MaxRelError(Download<T>(d_out->get(), btc), out);
    const double floor = MaxRelError(Download<T>(r_out->get(), btc), out);
    std::printf("margin forward out err=%.3e floor=%.3e bound=%.3e\n", err, floor,
                Bound(floor, KernelTolerance<T>()));
    EXPECT_LE(err, Bound(floor, KernelTolerance<T>())) << "out";

    // The statistics: fp32 from fp32 scores, so near the double reference whatever T is; a row
    // in the wrong place, a missing scale or a log in another base is off by O(1).
    const std::vector<float> stats = Download<float>(d_stats->get(), rows);
    const std::vector<double> want = CpuStats(qkv, s);
    double stats_err = 0;
    for (int64_t r = 0; r < rows; ++r) {
      ASSERT_TRUE(std::isfinite(stats[r])) << "row " << r;
      stats_err = std::max(stats_err, std::fabs(stats[r] - want[r]) / (1.0 + std::fabs(want[r])));
    }
    std::printf("margin forward stats err=%.3e\n", stats_err);
    EXPECT_LE(stats_err, 1e-3);
  }
}

TYPED_TEST(CudnnAttentionTest, CudnnBackwardMatchesCpu) {
  using T = TypeParam;
  OFFLOAD_INIT_CUDNN_OR_SKIP();
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(::testing::Message()
                 << "B=" << s.B << " T=" << s.T << " C=" << s.C << " NH=" << s.NH);
    ASSERT_NO_FATAL_FAILURE(this->PrepareShape(s));
    const int64_t btc = static_cast<int64_t>(s.B) * s.T * s.C;
    const int64_t att_size = static_cast<int64_t>(s.B) * s.NH * s.T * s.T;
    const int64_t rows = static_cast<int64_t>(s.B) * s.NH * s.T;
    const std::vector<float> qkv = RoundTo<T>(RandomVector(3 * btc, 1));
    const std::vector<float> dout = RoundTo<T>(RandomVector(btc, 2));
    auto d_qkv = Upload<T>(qkv);
    auto d_dout = Upload<T>(dout);

    // Each GPU path runs its own forward and hands its own saved state to its backward, as the
    // model does: cuDNN its output and statistics, the reference its softmax.
    auto d_out = Upload<T>(Nans(btc));
    auto d_stats = Upload<float>(Nans(rows));
    auto d_dqkv = Upload<T>(Nans(3 * btc));
    absl::Status status = this->cudnn_->Forward(d_out->get(), d_stats->get(), d_qkv->get(), s.B,
                                                s.T, s.C, s.NH, this->stream_);
    ASSERT_TRUE(status.ok()) << status;
    status = this->cudnn_->Backward(d_dqkv->get(), d_dout->get(), d_qkv->get(), d_out->get(),
                                    d_stats->get(), s.B, s.T, s.C, s.NH, this->stream_);
    ASSERT_TRUE(status.ok()) << status;
    ASSERT_NO_FATAL_FAILURE(this->Sync());

    auto r_out = Upload<T>(Nans(btc));
    auto r_att = Upload<T>(Nans(att_size));
    auto r_dqkv = Upload<T>(Nans(3 * btc));
    auto r_scratch = Upload<T>(Nans(AttentionScratchElems(s.B, s.T, s.C, s.NH)));
    status = AttentionForward<T>(*this->lt_, r_out->get(), r_att->get(), r_scratch->get(),
                                 d_qkv->get(), s.B, s.T, s.C, s.NH, this->stream_);
    ASSERT_TRUE(status.ok()) << status;
    status = AttentionBackward<T>(*this->lt_, r_dqkv->get(), r_scratch->get(), d_dout->get(),
                                  d_qkv->get(), r_att->get(), s.B, s.T, s.C, s.NH, this->stream_);
    ASSERT_TRUE(status.ok()) << status;
    ASSERT_NO_FATAL_FAILURE(this->Sync());

    std::vector<float> out(btc), preatt(att_size), att(att_size);
    NaiveKernels().attention_forward(out.data(), preatt.data(), att.data(), qkv.data(), s.B, s.T,
                                     s.C, s.NH);
    std::vector<float> dqkv(3 * btc), dpreatt(att_size), datt(att_size);
    NaiveKernels().attention_backward(dqkv.data(), dpreatt.data(), datt.data(), dout.data(),
                                      qkv.data(), att.data(), s.B, s.T, s.C, s.NH);
    const std::vector<float> got = Download<T>(d_dqkv->get(), 3 * btc);
    const std::vector<float> ref = Download<T>(r_dqkv->get(), 3 * btc);
    // dq, dk and dv apart: their scales differ, and one wrong must not hide behind another.
    const char* kNames[] = {"dq", "dk", "dv"};
    for (int part = 0; part < 3; ++part) {
      std::vector<float> got_part, ref_part, want_part;
      for (int64_t bt = 0; bt < static_cast<int64_t>(s.B) * s.T; ++bt) {
        for (int i = 0; i < s.C; ++i) {
          const int64_t at = bt * 3 * s.C + part * s.C + i;
          got_part.push_back(got[at]);
          ref_part.push_back(ref[at]);
          want_part.push_back(dqkv[at]);
        }
      }
      const double err = MaxRelError(got_part, want_part);
      const double floor = MaxRelError(ref_part, want_part);
      std::printf("margin backward %s err=%.3e floor=%.3e bound=%.3e\n", kNames[part], err, floor,
                  Bound(floor, KernelTolerance<T>()));
      EXPECT_LE(err, Bound(floor, KernelTolerance<T>())) << kNames[part];
    }
  }
}

TYPED_TEST(CudnnAttentionTest, CudnnPlansAreBuiltOncePerShape) {
  using T = TypeParam;
  OFFLOAD_INIT_CUDNN_OR_SKIP();
  const Shape s = kShapes[1];
  EXPECT_EQ(this->cudnn_->plans_built(), 0);
  ASSERT_NO_FATAL_FAILURE(this->PrepareShape(s));
  EXPECT_EQ(this->cudnn_->plans_built(), 2);  // forward and backward
  const int64_t btc = static_cast<int64_t>(s.B) * s.T * s.C;
  const std::vector<float> qkv = RoundTo<T>(RandomVector(3 * btc, 3));
  auto d_qkv = Upload<T>(qkv);
  auto d_out = Upload<T>(Nans(btc));
  auto d_stats = Upload<float>(Nans(int64_t{s.B} * s.NH * s.T));
  for (int call = 0; call < 3; ++call) {
    ASSERT_TRUE(this->cudnn_->Prepare(s.B, s.T, s.C, s.NH).ok());
    const absl::Status status = this->cudnn_->Forward(d_out->get(), d_stats->get(), d_qkv->get(),
                                                      s.B, s.T, s.C, s.NH, this->stream_);
    ASSERT_TRUE(status.ok()) << status;
  }
  ASSERT_NO_FATAL_FAILURE(this->Sync());
  EXPECT_EQ(this->cudnn_->plans_built(), 2) << "the same shape must not build again";
  // Another shape is another pair of plans.
  ASSERT_TRUE(this->cudnn_->Prepare(s.B, s.T - 4, s.C, s.NH).ok());
  EXPECT_EQ(this->cudnn_->plans_built(), 4);
}

TYPED_TEST(CudnnAttentionTest, CudnnRefusesWhatItCannotRun) {
  using T = TypeParam;
  OFFLOAD_INIT_CUDNN_OR_SKIP();
  // A head size of 12 and a single token are outside the engines: Unimplemented, no plan built,
  // and Supports says no (the model then runs the reference).
  EXPECT_EQ(this->cudnn_->Prepare(1, 16, 48, 4).status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(this->cudnn_->Prepare(2, 1, 48, 3).status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_FALSE(this->cudnn_->Supports(1, 16, 48, 4));
  EXPECT_EQ(this->cudnn_->plans_built(), 0);
  // A workspace smaller than the plans need: Supports says no and Forward refuses.
  const Shape s = kShapes[1];
  absl::StatusOr<int64_t> need = this->cudnn_->Prepare(s.B, s.T, s.C, s.NH);
  ASSERT_TRUE(need.ok()) << need.status();
  ASSERT_GT(*need, 0) << "backward's fp32 accumulators alone are more than nothing";
  auto workspace = std::make_unique<DeviceArray<uint8_t>>(*need);
  this->cudnn_->SetWorkspace(workspace->get(), *need - 256);
  EXPECT_FALSE(this->cudnn_->Supports(s.B, s.T, s.C, s.NH));
  const int64_t btc = static_cast<int64_t>(s.B) * s.T * s.C;
  auto d_qkv = Upload<T>(std::vector<float>(3 * btc, 0.5f));
  auto d_out = Upload<T>(Nans(btc));
  auto d_stats = Upload<float>(Nans(int64_t{s.B} * s.NH * s.T));
  EXPECT_EQ(
      this->cudnn_
          ->Forward(d_out->get(), d_stats->get(), d_qkv->get(), s.B, s.T, s.C, s.NH, this->stream_)
          .code(),
      absl::StatusCode::kFailedPrecondition);
  this->cudnn_->SetWorkspace(workspace->get(), *need);
  EXPECT_TRUE(this->cudnn_->Supports(s.B, s.T, s.C, s.NH));
}

TEST(CudnnAttention, CudnnRefusesFp32) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  EXPECT_EQ(CudnnAttention::Create(DType::kFp32).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace offload
