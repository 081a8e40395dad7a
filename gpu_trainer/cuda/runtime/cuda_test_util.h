// What the CUDA tests share: the skip when there is no GPU, host <-> device copies that convert
// between fp32 test data and each storage type on the host (with the project's reference
// conversions), and the tolerance each storage type is held to (ARCHITECTURE.md section 5).
#ifndef OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_CUDA_TEST_UTIL_H_
#define OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_CUDA_TEST_UTIL_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "base/dtype.h"
#include "gpu_trainer/cuda/runtime/cuda_device.h"
#include "gpu_trainer/cuda/runtime/storage_type.h"
#include "gtest/gtest.h"

// At the top of every GPU test: skips (not passes) with the driver's reason when there is no GPU.
#define OFFLOAD_SKIP_WITHOUT_CUDA()                                                \
  do {                                                                             \
    const absl::Status offload_cuda_available_ = ::offload::CudaDeviceAvailable(); \
    if (!offload_cuda_available_.ok()) {                                           \
      GTEST_SKIP() << offload_cuda_available_.message();                           \
    }                                                                              \
  } while (0)

#define OFFLOAD_ASSERT_CUDA_OK(expr)                                                        \
  do {                                                                                      \
    const cudaError_t offload_test_error_ = (expr);                                         \
    ASSERT_EQ(offload_test_error_, cudaSuccess) << cudaGetErrorString(offload_test_error_); \
  } while (0)

namespace offload {
namespace testing_util {

// A device array for tests; freed on scope exit.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(int64_t n) : n_(n) {
    if (cudaMalloc(&data_, static_cast<size_t>(n) * sizeof(T)) != cudaSuccess) data_ = nullptr;
    if (data_ != nullptr) cudaMemset(data_, 0, static_cast<size_t>(n) * sizeof(T));
    // cudaMemset is asynchronous and on the legacy stream, which non-blocking streams do not
    // wait for: finish it before any test work is queued elsewhere.
    cudaDeviceSynchronize();
  }
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return data_; }
  int64_t size() const { return n_; }

 private:
  T* data_ = nullptr;
  int64_t n_ = 0;
};

// Rounds `values` to T on the host and copies them to a new device array.
template <typename T>
std::unique_ptr<DeviceArray<T>> Upload(const std::vector<float>& values) {
  auto array = std::make_unique<DeviceArray<T>>(static_cast<int64_t>(values.size()));
  std::vector<T> host(values.size());
  for (size_t i = 0; i < values.size(); ++i) host[i] = HostFromFloat<T>(values[i]);
  cudaMemcpy(array->get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  // From pageable memory cudaMemcpy may return before the DMA lands; non-blocking streams would
  // not wait for it.
  cudaDeviceSynchronize();
  return array;
}

template <typename T>
std::vector<float> Download(const T* device, int64_t n) {
  std::vector<T> host(static_cast<size_t>(n));
  cudaDeviceSynchronize();
  cudaMemcpy(host.data(), device, host.size() * sizeof(T), cudaMemcpyDeviceToHost);
  std::vector<float> out(host.size());
  for (size_t i = 0; i < host.size(); ++i) out[i] = HostToFloat<T>(host[i]);
  return out;
}

// The same values as T would hold them: what the CPU reference is fed, so a test measures the
// kernel's arithmetic, not the rounding of its inputs.
template <typename T>
std::vector<float> RoundTo(const std::vector<float>& values) {
  std::vector<float> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = HostToFloat<T>(HostFromFloat<T>(values[i]));
  return out;
}

// Max relative error (max |a - b| / max |b|, model_test_util.h's MaxRelError) allowed for a
// kernel's output in storage type T against the fp32 CPU reference on the same rounded inputs:
// fp32 tight; 16-bit a few units of its last place, since outputs are rounded to T once and
// intermediates stay fp32.
template <typename T>
constexpr double KernelTolerance() {
  if constexpr (std::is_same_v<T, float>) {
    return 1e-5;
  } else if constexpr (std::is_same_v<T, __half>) {
    return 2e-3;
  } else {
    return 1.6e-2;
  }
}

}  // namespace testing_util
}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_CUDA_TEST_UTIL_H_
