#include "gpu_trainer/cuda/runtime/cuda_check.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace offload {
namespace {

absl::string_view BaseName(absl::string_view path) {
  const size_t slash = path.rfind('/');
  return slash == absl::string_view::npos ? path : path.substr(slash + 1);
}

}  // namespace

absl::Status CudaErrorStatus(cudaError_t error, const char* expr, const char* file, int line) {
  std::string message = absl::StrCat(expr, " at ", BaseName(file), ":", line, ": ",
                                     cudaGetErrorName(error), ": ", cudaGetErrorString(error));
  if (error == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

absl::Status CublasErrorStatus(cublasStatus_t status, const char* expr, const char* file,
                               int line) {
  std::string message =
      absl::StrCat(expr, " at ", BaseName(file), ":", line, ": ", cublasGetStatusName(status), ": ",
                   cublasGetStatusString(status));
  if (status == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(message);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) return absl::UnimplementedError(message);
  return absl::InternalError(message);
}

}  // namespace offload
