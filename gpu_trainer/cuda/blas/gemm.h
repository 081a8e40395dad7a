// Every matrix product of the CUDA backend goes through one cuBLASLt call with fp32 compute and
// fp32 scale (CUBLAS_COMPUTE_32F: no TF32 shortcut, so the fp32 mode is a true fp32 reference),
// storage type T for A, B and C, an optional bias epilogue, and strided batches.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_BLAS_GEMM_H_
#define OFFLOAD_GPU_TRAINER_CUDA_BLAS_GEMM_H_

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace offload {

// A cuBLASLt handle and its workspace. One per stream that runs products.
class CublasLt {
 public:
  static absl::StatusOr<std::unique_ptr<CublasLt>> Create(size_t workspace_bytes = 32 << 20);
  ~CublasLt();
  CublasLt(const CublasLt&) = delete;
  CublasLt& operator=(const CublasLt&) = delete;

  cublasLtHandle_t handle() const { return handle_; }
  void* workspace() const { return workspace_; }
  size_t workspace_bytes() const { return workspace_bytes_; }

 private:
  CublasLt() = default;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
};

// C = alpha * op(A) @ op(B) + beta * C (+ bias), column-major as cuBLAS defines it: op(A) is
// (m, k), op(B) is (k, n), C is (m, n). A row-major (R, S) matrix is a column-major (S, R) one,
// which is how the row-major wrappers of matmul.h and attention.cu call this.
struct GemmSpec {
  bool trans_a = false;
  bool trans_b = false;
  int m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* c = nullptr;
  int64_t ldc = 0;
  const void* bias = nullptr;  // (m,) in T, added to every column; nullptr for none
  float alpha = 1.0f;
  float beta = 0.0f;
  int batch = 1;  // strided batches: matrix i at a + i * stride_a elements, etc.
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
};

template <typename T>
absl::Status Gemm(CublasLt& lt, const GemmSpec& spec, cudaStream_t stream);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_BLAS_GEMM_H_
