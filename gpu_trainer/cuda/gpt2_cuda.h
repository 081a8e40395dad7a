// GPT-2 on the GPU (ARCHITECTURE.md sections 1, 5 and 6): 16-bit weights and activations with fp32
// accumulation (or fp32 throughout, the parity-test mode), the same flat parameter layout and
// the same forward and backward as the CPU backend (model/gpt2.h), which is its reference.
//
// Parameters, gradients and activations live in three device allocations carved into views in
// the order memory_planner.h lists them, so the planner's numbers are this model's.
// Gradients leave through the pinned staging ring on a device-to-host stream as each layer's
// backward finishes; weights arrive through the host-to-device ring before the next forward.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_GPT2_CUDA_H_
#define OFFLOAD_GPU_TRAINER_CUDA_GPT2_CUDA_H_

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "gpu_trainer/collectives/collectives.h"
#include "gpu_trainer/cuda/cudnn/attention_kind.h"
#include "gpu_trainer/cuda/runtime/pinned_staging.h"
#include "model_spec/gpt2_config.h"

namespace offload {

struct CudaModelOptions {
  DType dtype = DType::kBf16;  // storage of weights, gradients and activations
  int device = 0;
  StagingOptions staging;  // per direction
  // As Gpt2Cpu's: keep each block's input only, recompute the block's forward in backward.
  bool activation_checkpointing = false;
  // The MLP's first product with cuBLASLt's GELU epilogue (fch and fch_gelu from one call), the
  // GELU's backward and fc's bias gradient from c_proj's dinp product, and the other bias
  // gradients from their weight-gradient products (blas/matmul.h). 16-bit modes only, where
  // cuBLASLt offers them; false, or fp32, runs the separate GELU and bias-gradient kernels.
  bool fused_epilogues = true;
  // Causal attention through cuDNN's fused flash attention (loaded at run time; 16-bit only)
  // or the reference of blas/attention.h. kAuto: cuDNN where it loads and takes the model's
  // shape, else the reference; Create logs one line saying which and why (attention_path()).
  AttentionKind attention = AttentionKind::kAuto;
  // The gradients on the device (zero/device_gradient_buckets.h): 0 keeps one for every
  // parameter (the GPU-resident optimizer reads them; CopyGradsToHost); >= 1 holds buckets of at
  // least that many elements (1: each unit its own), the embeddings' and two more, each copied
  // out (and with W NCCL ranks reduce-scattered first) as backward completes it. 16-bit only, and
  // Backward then needs host_grads16.
  int64_t gradient_bucket_elements = 0;
  // ZeRO-3 (zero/device_param_window.h): 0 keeps every weight on the device; >= 1 holds a window
  // of that many blocks plus the embeddings and ln_f, filled before each use from the host model
  // (SetHostWeights16) or, with W NCCL ranks, all-gathered from the ranks' partitions
  // (UploadPartition16). 16-bit only.
  int param_window_layers = 0;
  // NCCL ranks (nccl/nccl_collectives.h; not owned; one rank's too, the same bits as none): the
  // buckets are reduce-scattered on the device and the updated weights all-gathered there
  // (UploadPartition16). Requires gradient_bucket_elements >= 1. padded_length: the partition
  // map's flat length.
  Collectives* collectives = nullptr;
  int64_t padded_length = 0;
};

// What leaves with the gradients: computed on the GPU over the 16-bit values that are sent.
// Told of the offload step's transfers, for the trace, on the host's clock: "d2h_gradients" as
// each gradient range lands (index: the range, transfer_schedule.h's order; from when it was
// queued), "d2h_exposed" once per backward (from when the GPU finished computing to when the last
// range landed: what backward did not hide), and after a Forward that waited for an upload,
// "h2d_weights" (the upload on the GPU, first unit queued to last landed) and "forward_gpu" (that
// forward on the GPU), index -1, from CUDA timing events. Runs on the copy thread or the calling
// thread: it must be quick and call no CUDA function.
using TransferObserver =
    std::function<void(const char* what, int index, std::chrono::steady_clock::time_point queued,
                       std::chrono::steady_clock::time_point landed)>;

struct CudaGradStats {
  double sum_squares = 0;  // still multiplied by the loss scale
  bool nonfinite = false;
};

class Gpt2Cuda {
 public:
  // InvalidArgument for a bad config or size (channels must be a multiple of 8, so every
  // parameter tensor, bias included, starts 16-byte aligned for cuBLASLt), Unavailable without a
  // GPU, ResourceExhausted when the model does not fit in the GPU's memory (the message says how
  // much it needed).
  static absl::StatusOr<std::unique_ptr<Gpt2Cuda>> Create(const Gpt2Config& config, int max_batch,
                                                          int max_seq,
                                                          const CudaModelOptions& options);
  ~Gpt2Cuda();

  const Gpt2Config& config() const { return config_; }
  int64_t num_params() const { return num_params_; }
  DType dtype() const { return options_.dtype; }
  int64_t device_bytes() const;  // everything this model allocated on the GPU

  // params (num_params,) fp32 in layout order, rounded to the storage type on the GPU.
  absl::Status SetParams(const float* params);
  // w16 (num_params,) in the model's 16-bit dtype, through the host-to-device ring (or straight
  // from w16 where it is registered memory), unit by unit in the order the forward reads them
  // (transfer_schedule.h); the next Forward waits for each unit on the GPU just before its first
  // kernel that reads it, not on the host, so the upload overlaps the forward. Call it between a
  // Backward and the next Forward, never between a Forward and its Backward. w16 must not change
  // until that Forward returns. FailedPrecondition in fp32 mode.
  absl::Status UploadWeights16(const uint16_t* w16);
  // ZeRO-3 with one rank: w16 (num_params,) the whole 16-bit model in host memory (register it
  // for direct copies), from which each unit is copied into the window just before its use, in
  // every step until the next call. It must not change while a Forward or Backward runs.
  absl::Status SetHostWeights16(const uint16_t* w16);
  // W NCCL ranks: this rank's partition (padded_length / W,) of the 16-bit weights. Stage 2: it
  // is all-gathered on the device into every weight now; ZeRO-3: it is kept on the device, and
  // each unit is all-gathered from the ranks' partitions into the window before its use.
  absl::Status UploadPartition16(const uint16_t* partition16);
  // w16 (num_params,) := the 16-bit weights on the device (every weight there: not ZeRO-3), e.g.
  // those NCCL ranks gathered, for a checkpoint. FailedPrecondition with a window or in fp32.
  absl::Status DownloadWeights16(uint16_t* w16);

  // Page-locks [p, p + bytes) of host memory (cudaHostRegister) so that transfers to and from it
  // skip the pinned ring: the trainer's weight and gradient buffers, a shared-memory segment's
  // gradient area. An error (the memory cannot be locked) changes nothing and the transfers keep
  // using the ring. Unregister before the memory goes away; the model unregisters what is left
  // when it is destroyed.
  absl::Status RegisterHostMemory(void* p, int64_t bytes);
  absl::Status UnregisterHostMemory(void* p);
  bool IsRegisteredHostMemory(const void* p, int64_t bytes) const;
  void set_transfer_observer(TransferObserver observer);
  // Tests: each later UploadWeights16 holds its units after the first for `delay` on the H2D
  // stream, so a forward that did not wait for each unit would compute on stale weights.
  void set_upload_delay_for_testing(std::chrono::milliseconds delay);

  // inputs, targets (B, T) on the host, as Gpt2Cpu::Forward; returns the mean loss (0 without
  // targets). Token ids out of range -> InvalidArgument, nothing computed.
  absl::StatusOr<float> Forward(const int32_t* inputs, const int32_t* targets, int B, int T);

  // Gradients of loss * loss_scale into the device gradient buffer (storage type). When
  // host_grads16 (num_params,) is given (16-bit modes), each finished range also goes to it
  // through the pinned ring while backward goes on, and on_ready(offset, n) runs on the copy
  // thread once the range is there, in the ranges and order of Gpt2Cpu::Backward. Without
  // host_grads16, on_ready runs on the calling thread when the range's kernels are queued, not
  // computed. Returns after every range has arrived, with the statistics of the gradients.
  // place(offset, n), when given, may name another destination of a range (n,) than
  // host_grads16 + offset (a shared-memory segment's gradient area, so nothing is copied again on
  // the host), or return null for host_grads16; a registered destination is written directly.
  // With gradient buckets the ranges are the buckets (model_spec/gradient_buckets.h: consecutive
  // units in backward order, the embeddings' last, which may hold blocks too), and with NCCL
  // ranks only this rank's piece of each (the mean over ranks); the padding above num_params is
  // never one of them.
  absl::StatusOr<CudaGradStats> Backward(
      float loss_scale, uint16_t* host_grads16,
      const std::function<void(int64_t offset, int64_t n)>& on_ready,
      const std::function<uint16_t*(int64_t offset, int64_t n)>& place = nullptr);

  // grads (num_params,) fp32 widened from the device gradients (tests).
  absl::Status CopyGradsToHost(float* grads);
  // logits (V,) of position (b, t) of the last Forward (a Backward overwrites them).
  absl::Status CopyLogitsToHost(int b, int t, float* logits);

  // For the GPU-resident optimizer: the device parameter and gradient buffers (num_params,) in
  // the storage type, and the stream every kernel of the model runs on.
  void* device_params() const;
  void* device_grads() const;
  cudaStream_t compute_stream() const;
  // The attention Create chose: "cudnn" or "reference".
  const char* attention_path() const;
  // ZeRO-3: units copied or gathered into the window so far (0 without a window).
  int64_t window_fills() const;
  // Gradient buckets that left the device in the last Backward (0 without buckets).
  int64_t buckets_sent() const;

  class Impl;  // per storage type, in gpt2_cuda.cc

 private:
  Gpt2Cuda(const Gpt2Config& config, const CudaModelOptions& options);

  const Gpt2Config config_;
  const CudaModelOptions options_;
  int64_t num_params_ = 0;
  std::unique_ptr<Impl> impl_;
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_GPT2_CUDA_H_
