#include "gpu_trainer/cuda/runtime/cuda_device.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "gpu_trainer/cuda/runtime/cuda_check.h"
#include "gpu_trainer/cuda/runtime/peak_flops.h"

namespace offload {

absl::Status CudaDeviceAvailable() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return absl::UnavailableError(absl::StrCat("no CUDA device: ", cudaGetErrorString(error)));
  }
  if (count == 0) return absl::UnavailableError("no CUDA device: the driver reports none");
  int major = 0;
  OFFLOAD_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major < 8) {
    return absl::UnavailableError(absl::StrCat("no usable CUDA device: compute capability ", major,
                                               ".x is below 8.0 (bf16 kernels "
                                               "need Ampere or newer)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CudaDeviceInfo> UseCudaDevice(int ordinal) {
  OFFLOAD_RETURN_IF_ERROR(CudaDeviceAvailable());
  int count = 0;
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  if (ordinal < 0 || ordinal >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", ordinal, " does not exist (", count, " present)"));
  }
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal));
  CudaDeviceInfo info;
  info.ordinal = ordinal;
  cudaDeviceProp prop;
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, ordinal));
  info.name = prop.name;
  info.compute_major = prop.major;
  info.compute_minor = prop.minor;
  info.sm_count = prop.multiProcessorCount;
  int clock_khz = 0;
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, ordinal));
  info.clock_khz = clock_khz;
  size_t free_bytes = 0, total_bytes = 0;
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  info.free_bytes = static_cast<int64_t>(free_bytes);
  info.total_bytes = static_cast<int64_t>(total_bytes);
  const PeakFlops peak =
      Bf16PeakFlops(info.name, prop.major, prop.minor, info.sm_count, info.clock_khz);
  info.peak_bf16_flops = peak.flops;
  info.peak_source = peak.source;
  return info;
}

std::string DescribeCudaDevice(const CudaDeviceInfo& info) {
  return absl::StrFormat("%s (sm_%d%d, %d SMs, %.0f MHz, %.1f GiB, peak bf16 %.0f TFLOP/s, %s)",
                         info.name, info.compute_major, info.compute_minor, info.sm_count,
                         info.clock_khz / 1e3, info.total_bytes / 1073741824.0,
                         info.peak_bf16_flops / 1e12, info.peak_source);
}

}  // namespace offload
