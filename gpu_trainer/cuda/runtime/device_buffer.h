// One cudaMalloc carved into typed views, as llm.c does for parameters and activations: one
// allocation per purpose, every tensor a pointer into it, nothing freed until the end.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_DEVICE_BUFFER_H_
#define OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_DEVICE_BUFFER_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace offload {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Frees what was held, then allocates `bytes` on the current device. ResourceExhausted names
  // the size and what the device has free.
  absl::Status Allocate(size_t bytes, const char* what);
  void Reset();

  void* data() const { return data_; }
  size_t size() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Hands out 256-byte aligned views of a region in order. Used twice: once with base nullptr to
// measure the total, once over the real allocation, so the two can never disagree.
class BufferCarver {
 public:
  explicit BufferCarver(void* base) : base_(static_cast<char*>(base)) {}
  template <typename T>
  T* Take(int64_t count) {
    offset_ = (offset_ + 255) / 256 * 256;
    T* p = base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + offset_);
    offset_ += static_cast<size_t>(count) * sizeof(T);
    return p;
  }
  size_t bytes() const { return (offset_ + 255) / 256 * 256; }

 private:
  char* base_;
  size_t offset_ = 0;
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_DEVICE_BUFFER_H_
