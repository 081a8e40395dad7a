// CudnnAttention for a build without cuDNN's headers (CMake found no cudnn_graph.h): Create says
// so, and the model runs its reference attention. Nothing else is reachable without an object.
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu_trainer/cuda/cudnn/cudnn_attention.h"

namespace offload {

class CudnnAttention::Impl {};

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(DType /*dtype*/) {
  return absl::UnavailableError(
      "cuDNN not built in: no cudnn_graph.h was found when this program was configured");
}

CudnnAttention::CudnnAttention(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudnnAttention::~CudnnAttention() = default;
int64_t CudnnAttention::version() const { return 0; }
DType CudnnAttention::dtype() const { return DType::kBf16; }
absl::StatusOr<int64_t> CudnnAttention::Prepare(int, int, int, int) {
  return absl::UnavailableError("cuDNN not built in");
}
void CudnnAttention::SetWorkspace(void*, int64_t) {}
bool CudnnAttention::Supports(int, int, int, int) { return false; }
absl::Status CudnnAttention::Forward(void*, float*, const void*, int, int, int, int, cudaStream_t) {
  return absl::UnavailableError("cuDNN not built in");
}
absl::Status CudnnAttention::Backward(void*, const void*, const void*, const void*, const float*,
                                      int, int, int, int, cudaStream_t) {
  return absl::UnavailableError("cuDNN not built in");
}
int CudnnAttention::plans_built() const { return 0; }

}  // namespace offload
