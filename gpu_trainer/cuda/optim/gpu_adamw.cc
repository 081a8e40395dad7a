#include "gpu_trainer/cuda/optim/gpu_adamw.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "gpu_trainer/cuda/optim/adamw.h"
#include "gpu_trainer/cuda/runtime/cuda_check.h"
#include "gpu_trainer/cuda/runtime/cuda_device.h"
#include "gpu_trainer/cuda/runtime/storage_type.h"

namespace offload {
namespace {

// Master weights, then exp_avg, then exp_avg_sq, each 256-byte aligned. Carved once over
// nullptr to size the allocation and once over it, so the two cannot disagree.
void Carve(BufferCarver& carver, int64_t n, float** master, float** exp_avg, float** exp_avg_sq) {
  *master = carver.Take<float>(n);
  *exp_avg = carver.Take<float>(n);
  *exp_avg_sq = carver.Take<float>(n);
}

}  // namespace

GpuAdamW::GpuAdamW(int64_t n, DType storage, const AdamHyperParams& hp, cudaStream_t stream)
    : n_(n), storage_(storage), hp_(hp), stream_(stream) {}

absl::StatusOr<std::unique_ptr<GpuAdamW>> GpuAdamW::Create(int64_t n, DType storage,
                                                           const AdamHyperParams& hp,
                                                           cudaStream_t stream) {
  if (n <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("GpuAdamW: the parameter count must be positive, got ", n));
  }
  // Before any allocation: without a device, the caller gets the driver's reason as
  // Unavailable rather than an allocation failure.
  OFFLOAD_RETURN_IF_ERROR(CudaDeviceAvailable());
  auto adamw = std::unique_ptr<GpuAdamW>(new GpuAdamW(n, storage, hp, stream));
  float* unused[3];
  BufferCarver measure(nullptr);
  Carve(measure, n, &unused[0], &unused[1], &unused[2]);
  OFFLOAD_RETURN_IF_ERROR(adamw->buffer_.Allocate(measure.bytes(), "GPU AdamW state"));
  BufferCarver carver(adamw->buffer_.data());
  Carve(carver, n, &adamw->master_, &adamw->exp_avg_, &adamw->exp_avg_sq_);
  return adamw;
}

absl::Status GpuAdamW::Init(const float* host_master) {
  const size_t bytes = static_cast<size_t>(n_) * sizeof(float);
  OFFLOAD_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(master_, host_master, bytes, cudaMemcpyHostToDevice, stream_));
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(exp_avg_, 0, bytes, stream_));
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(exp_avg_sq_, 0, bytes, stream_));
  // From pinned memory the copy is truly asynchronous, and the caller may free host_master as
  // soon as we return: wait for it.
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  step_ = 0;
  return absl::OkStatus();
}

absl::Status GpuAdamW::Step(float lr, float grad_multiplier, bool skip, const void* device_grads,
                            void* device_params) {
  // An overflowed step is dropped whole, as the CPU shards drop it: the bias corrections of
  // later steps count applied updates only.
  if (skip) return absl::OkStatus();
  if (device_grads == nullptr || device_params == nullptr) {
    return absl::InvalidArgumentError("GpuAdamW::Step: null gradient or parameter buffer");
  }
  const int64_t t = step_ + 1;
  const AdamStepScalars scalars = ComputeAdamStepScalars(hp_, lr, t, grad_multiplier);
  const cudaError_t launched = DispatchStorageType(storage_, [&](auto zero) {
    using T = decltype(zero);
    return AdamWUpdate<T>(scalars, static_cast<const T*>(device_grads), master_, exp_avg_,
                          exp_avg_sq_, static_cast<T*>(device_params), n_, stream_);
  });
  OFFLOAD_CUDA_RETURN_IF_ERROR(launched);
  step_ = t;
  return absl::OkStatus();
}

absl::Status GpuAdamW::CopyMasterToHost(float* host_master) {
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_master, master_,
                                               static_cast<size_t>(n_) * sizeof(float),
                                               cudaMemcpyDeviceToHost, stream_));
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

}  // namespace offload
