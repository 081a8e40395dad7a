#include "gpu_trainer/cuda/runtime/device_buffer.h"

#include <cuda_runtime.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gpu_trainer/cuda/runtime/cuda_check.h"

namespace offload {

DeviceBuffer::~DeviceBuffer() { Reset(); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void DeviceBuffer::Reset() {
  if (data_ != nullptr) cudaFree(data_);
  data_ = nullptr;
  bytes_ = 0;
}

absl::Status DeviceBuffer::Allocate(size_t bytes, const char* what) {
  Reset();
  if (bytes == 0) return absl::OkStatus();
  const cudaError_t error = cudaMalloc(&data_, bytes);
  if (error != cudaSuccess) {
    cudaGetLastError();
    data_ = nullptr;
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    return absl::ResourceExhaustedError(absl::StrFormat(
        "cannot allocate %.2f GiB on the GPU for %s (%.2f GiB of %.2f GiB free): %s",
        bytes / 1073741824.0, what, free_bytes / 1073741824.0, total_bytes / 1073741824.0,
        cudaGetErrorString(error)));
  }
  bytes_ = bytes;
  return absl::OkStatus();
}

}  // namespace offload
