// The GPU-resident optimizer: fp32 master weights and both Adam moments in device memory, updated
// in place by the fused AdamW kernel (adamw.h), which also writes the storage-type weights the
// model computes with. This is the no-offload baseline of ARCHITECTURE.md section 9: what the same
// model costs per step, and how large it can be, when the 12 bytes of optimizer state per parameter
// stay on the GPU. Its arithmetic is the CPU shards' (ARCHITECTURE.md section 5), bit for bit.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_OPTIM_GPU_ADAMW_H_
#define OFFLOAD_GPU_TRAINER_CUDA_OPTIM_GPU_ADAMW_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/adam/adam_math.h"
#include "base/dtype.h"
#include "gpu_trainer/cuda/runtime/device_buffer.h"

namespace offload {

class GpuAdamW {
 public:
  // n parameters whose weights and gradients are `storage` (kFp32, kFp16 or kBf16) on the
  // device; one allocation of 12 * n bytes (plus alignment) on the current device. Every kernel
  // and copy runs on `stream` (the model's compute stream, so an update is ordered after the
  // backward that produced its gradients and before the next forward). InvalidArgument for
  // n <= 0, Unavailable without a GPU, ResourceExhausted when the state does not fit.
  static absl::StatusOr<std::unique_ptr<GpuAdamW>> Create(int64_t n, DType storage,
                                                          const AdamHyperParams& hp,
                                                          cudaStream_t stream);

  // host_master (n,) fp32: the initial master weights; both moments become zero and the step
  // count 0. Returns once the copy is done, so host_master may be freed.
  absl::Status Init(const float* host_master);

  // One optimizer step over device_grads (n,) in the storage type, which the model has already
  // multiplied by its loss scale: g = grad * grad_multiplier. skip (an overflow): nothing
  // changes and the step count stays. Otherwise the count advances, and master, moments and
  // device_params (n,) in the storage type are updated. Asynchronous on the stream.
  absl::Status Step(float lr, float grad_multiplier, bool skip, const void* device_grads,
                    void* device_params);

  // Applied (not skipped) updates so far.
  int64_t step() const { return step_; }
  int64_t size() const { return n_; }
  DType storage() const { return storage_; }

  // host_master (n,) fp32 after every queued update (tests).
  absl::Status CopyMasterToHost(float* host_master);

  int64_t device_bytes() const { return static_cast<int64_t>(buffer_.size()); }

 private:
  GpuAdamW(int64_t n, DType storage, const AdamHyperParams& hp, cudaStream_t stream);

  const int64_t n_;
  const DType storage_;
  const AdamHyperParams hp_;
  const cudaStream_t stream_;
  DeviceBuffer buffer_;
  float* master_ = nullptr;      // (n,) fp32 master weights
  float* exp_avg_ = nullptr;     // (n,) first moment
  float* exp_avg_sq_ = nullptr;  // (n,) second moment
  int64_t step_ = 0;
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_OPTIM_GPU_ADAMW_H_
