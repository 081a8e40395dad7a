// Which GPU this process computes on, and whether there is one at all. Every GPU test and the
// trainer's --device=cuda ask CudaDeviceAvailable() first, so a machine without a GPU (or
// without a driver) gets one clear sentence instead of a failure deep inside a kernel.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_CUDA_DEVICE_H_
#define OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_CUDA_DEVICE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace offload {

struct CudaDeviceInfo {
  int ordinal = 0;
  std::string name;
  int compute_major = 0;
  int compute_minor = 0;
  int sm_count = 0;
  int64_t clock_khz = 0;  // peak SM clock
  int64_t total_bytes = 0;
  int64_t free_bytes = 0;
  // Dense 16-bit tensor-core peak (peak_flops.h): the datasheet's for a part it names, else
  // estimated from SM count, clock and architecture; 0 when unknown. MFU is measured against it
  // unless the user passes another.
  double peak_bf16_flops = 0;
  std::string peak_source;
};

// OK when a CUDA device can run our kernels; Unavailable with the driver's reason otherwise
// ("no CUDA device: CUDA driver version is insufficient ...").
absl::Status CudaDeviceAvailable();

// Selects `ordinal` for the calling thread and describes it.
absl::StatusOr<CudaDeviceInfo> UseCudaDevice(int ordinal);

std::string DescribeCudaDevice(const CudaDeviceInfo& info);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_CUDA_DEVICE_H_
