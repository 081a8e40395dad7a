// Errors from the CUDA runtime and cuBLAS(Lt) as absl::Status, naming the call, file and line,
// so a failure deep in a kernel launch reads like "cudaMemcpyAsync(...) at gpt2_cuda.cc:212:
// invalid argument" and crosses the API as a Status, never as an abort.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_CUDA_CHECK_H_
#define OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_CUDA_CHECK_H_

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "base/status_macros.h"

namespace offload {

// cudaErrorMemoryAllocation -> ResourceExhausted, everything else -> Internal.
absl::Status CudaErrorStatus(cudaError_t error, const char* expr, const char* file, int line);
absl::Status CublasErrorStatus(cublasStatus_t status, const char* expr, const char* file, int line);

}  // namespace offload

#define OFFLOAD_CUDA_RETURN_IF_ERROR(expr)                                               \
  do {                                                                                   \
    const cudaError_t offload_cuda_error_ = (expr);                                      \
    if (offload_cuda_error_ != cudaSuccess) {                                            \
      return ::offload::CudaErrorStatus(offload_cuda_error_, #expr, __FILE__, __LINE__); \
    }                                                                                    \
  } while (0)

#define OFFLOAD_CUBLAS_RETURN_IF_ERROR(expr)                                                  \
  do {                                                                                        \
    const cublasStatus_t offload_cublas_status_ = (expr);                                     \
    if (offload_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                                    \
      return ::offload::CublasErrorStatus(offload_cublas_status_, #expr, __FILE__, __LINE__); \
    }                                                                                         \
  } while (0)

#endif  // OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_CUDA_CHECK_H_
