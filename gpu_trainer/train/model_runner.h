// The trainer's compute device behind one small interface: the CPU backend (fp32 compute on the
// 16-bit weights, gradients rounded to 16 bits as they leave) or the CUDA backend (16-bit
// weights, activations and gradients on the GPU, through pinned staging buffers). The trainer
// holds the host copies of what crosses the wire: 16-bit weights in, 16-bit gradients out.
#ifndef OFFLOAD_GPU_TRAINER_TRAIN_MODEL_RUNNER_H_
#define OFFLOAD_GPU_TRAINER_TRAIN_MODEL_RUNNER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "gpu_trainer/collectives/collectives.h"
#include "gpu_trainer/model/gpt2.h"
#include "model_spec/gpt2_config.h"
#include "optimizer_client/precision/grad_stats.h"
#include "optimizer_client/sender/phase_trace.h"

namespace offload {

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;

  virtual int64_t num_params() const = 0;
  // One line for the log: backend, kernels or GPU.
  virtual std::string Describe() const = 0;

  // w16 (num_params,) the weights the optimizer sent, in the run's 16-bit dtype. The caller keeps
  // w16 unchanged until the next Forward.
  virtual absl::Status SetWeights(const uint16_t* w16) = 0;
  // ZeRO-3: Forward and Backward take the weights unit by unit from `source` (not owned; it must
  // outlive its use) instead of a whole copy made by SetWeights, which is then not called.
  // Unimplemented where the backend cannot (CUDA, for now).
  virtual absl::Status SetParamSource(Gpt2ParamSource* source) {
    return absl::UnimplementedError(
        "ZeRO stage 3 (weights gathered layer by layer) is built for the CPU backend only");
  }
  // Where the backend holds only part of the weights itself (the CUDA backend's ZeRO-3 window, or
  // NCCL ranks that gather on the device): the trainer hands it its 16-bit partition after each
  // update instead of SetWeights or SetParamSource: with one rank the whole model, kept and read
  // unit by unit until the next call (it must not change meanwhile); with W ranks this rank's
  // partition, copied at once.
  virtual bool takes_partition_weights() const { return false; }
  virtual absl::Status SetPartitionWeights(const uint16_t* /*partition16*/) {
    return absl::UnimplementedError("this backend takes the whole 16-bit model (SetWeights)");
  }
  // w16 (num_params,) := the 16-bit weights the backend computes with, where only it holds them
  // whole (NCCL ranks gather theirs on the device): for a checkpoint.
  virtual absl::Status CopyWeights16ToHost(uint16_t* /*w16*/) {
    return absl::UnimplementedError("this backend's weights are the trainer's host copy");
  }
  // Whether Backward reduces the gradients across the ranks itself (NCCL on the device): on_ready
  // then reports only this rank's partition's pieces, already the mean over ranks, and the
  // statistics are of those pieces.
  virtual bool reduces_gradients() const { return false; }
  // As Gpt2Cpu::Forward: inputs, targets (B, T) on the host; the mean loss (0 without targets).
  virtual absl::StatusOr<float> Forward(const int32_t* inputs, const int32_t* targets, int B,
                                        int T) = 0;
  // grads16 (num_params,) := the 16-bit gradients of loss * loss_scale. on_ready(offset, n) runs
  // once each range of Gpt2Cpu::Backward's order is final in grads16, maybe on another thread.
  // Returns the statistics of the values written. place(offset, n), where given, may name
  // another destination for a range than grads16 + offset (a shared-memory segment's gradient
  // area: OptimizerBackend::GradientPlace), null for grads16; a backend that writes there calls
  // on_ready with the same (offset, n) and must be asked place again for where it went.
  virtual absl::StatusOr<GradStats> Backward(
      float loss_scale, uint16_t* grads16,
      const std::function<void(int64_t offset, int64_t n)>& on_ready,
      const std::function<uint16_t*(int64_t offset, int64_t n)>& place = nullptr) = 0;
  // Whether Backward writes ranges where `place` says (the CUDA backend), not only to grads16.
  virtual bool writes_gradient_places() const { return false; }
  // Page-locks host memory that the weights are uploaded from or the gradients land in, so the
  // transfers skip the pinned ring (the CUDA backend; elsewhere a no-op). An error changes
  // nothing: the ring still carries them. Unregister before the memory is freed.
  virtual absl::Status RegisterHostMemory(void* /*p*/, int64_t /*bytes*/) {
    return absl::OkStatus();
  }
  virtual absl::Status UnregisterHostMemory(void* /*p*/) { return absl::OkStatus(); }
  // Records each host <-> device transfer in `trace` (not owned; may be null) under the step
  // `step()` returns (the CUDA backend: "h2d_weights", "d2h_gradients" spans).
  virtual void set_trace(PhaseTrace* /*trace*/, std::function<uint64_t()> /*step*/) {}
  // Where gradients are fp32 where they are computed (the CPU backend): the fp32 gradients of
  // loss * loss_scale into `grads`, unit by unit in backward order (Gpt2GradSink). The
  // data-parallel trainer reduces them across ranks bucket by bucket before they are rounded to
  // 16 bits, so W ranks send what one rank with the whole batch would, and only the buckets on
  // their way are held. Unimplemented where gradients are 16-bit from the start (CUDA).
  virtual absl::Status BackwardFp32(float loss_scale, Gpt2GradSink& grads) {
    return absl::UnimplementedError("this backend has no fp32 gradients");
  }
  virtual bool has_fp32_gradients() const { return false; }
  // logits (V,) of position t of sequence 0 of the last Forward.
  virtual absl::Status Logits(int t, float* logits) = 0;

  // For the device memory metrics: what this runner holds on its device, and the device's size.
  struct DeviceMemory {
    std::string device;  // "cpu" or "cuda"
    int64_t used_bytes = 0;
    int64_t total_bytes = 0;
  };
  virtual DeviceMemory Memory() const = 0;
};

// dtype: the 16-bit format of weights and gradients (fp16 or bf16). activation_checkpointing: as
// Gpt2Cpu::Create's (each block's forward recomputed in backward; the same bits).
absl::StatusOr<std::unique_ptr<ModelRunner>> CreateCpuModelRunner(
    const Gpt2Config& config, int max_batch, int max_seq, CpuKernelSet kernels, DType dtype,
    bool activation_checkpointing = false);

// How the CUDA backend holds the gradients and weights at scale (Gpt2Cuda's CudaModelOptions):
// gradient buckets (1: each unit its own; 0: one gradient for every parameter), the ZeRO-3 window
// (0: every weight on the device), and NCCL ranks (not owned; null: none; with one rank the
// device path gives the single-rank bits).
struct CudaScaleOptions {
  int64_t gradient_bucket_elements = 1;
  int param_window_layers = 0;
  Collectives* collectives = nullptr;
  int64_t padded_length = 0;  // the partition map's
};

// Unavailable without a GPU; Unimplemented in a build without the CUDA backend.
// reference_attention: the reference attention even where cuDNN's fused one would run (tests that
// compare runs bit for bit: cuDNN's backward may accumulate with atomics).
absl::StatusOr<std::unique_ptr<ModelRunner>> CreateCudaModelRunner(
    const Gpt2Config& config, int max_batch, int max_seq, DType dtype, int device,
    int64_t pinned_staging_bytes, bool activation_checkpointing = false,
    bool reference_attention = false, const CudaScaleOptions& scale = {});

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_TRAIN_MODEL_RUNNER_H_
