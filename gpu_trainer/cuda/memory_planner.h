// How much GPU memory the CUDA GPT-2 needs, and the largest GPT-2-shaped model that trains on a
// GPU of a given size with offload (16-bit weights and gradients on the GPU, fp32 master weights
// and Adam moments on the CPU shards) and without (those 12 bytes per parameter on the GPU too).
// Each number is what the model allocates: the activations from the carve the model itself uses
// (gpt2_cuda_buffers.h), the gradients' bucket slots (zero/bucket_slots.h), the parameter window
// of ZeRO-3 (zero/param_window.h); the model checks its plan against free memory before it
// allocates anything.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_MEMORY_PLANNER_H_
#define OFFLOAD_GPU_TRAINER_CUDA_MEMORY_PLANNER_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "gpu_trainer/cuda/cudnn/attention_kind.h"
#include "model_spec/gpt2_config.h"

namespace offload {

// cuBLASLt's workspace, allocated once per model.
inline constexpr int64_t kCublasWorkspaceBytes = int64_t{32} << 20;
// What the CUDA context, cuBLAS's kernels and allocator slack take on a device before the model
// allocates anything: not ours to plan, so held back.
inline constexpr int64_t kCudaReservedBytes = int64_t{1} << 30;

struct CudaMemoryPlan {
  int64_t params_bytes = 0;      // storage-type weights
  int64_t grads_bytes = 0;       // storage-type gradients
  int64_t activation_bytes = 0;  // saved activations, scratch, activation gradients
  int64_t optimizer_bytes = 0;  // fp32 master, exp_avg, exp_avg_sq when the optimizer is on the GPU
  // fp32 scratch of the reduce-scatter over W > 1 ranks (NCCL): the largest bucket slot besides
  // the embeddings'. 0 with one rank or without buckets.
  int64_t reduce_scratch_bytes = 0;
  int64_t workspace_bytes = 0;  // cuBLASLt
  int64_t reserved_bytes = 0;   // kCudaReservedBytes
  int64_t total_bytes() const {
    return params_bytes + grads_bytes + activation_bytes + optimizer_bytes + reduce_scratch_bytes +
           workspace_bytes + reserved_bytes;
  }
};

// Which 16-bit weights the device holds. W > 1 ranks are one GPU each over NCCL, the flat space
// padded as the partition map pads it (model_spec/partition.h). Stage 2 (the default): all of
// them (the padded length with W > 1). ZeRO-3 (ARCHITECTURE.md section 10): the parameter window
// (zero/param_window.h: the embeddings, ln_f and window_layers blocks, each slot aligned) plus,
// with W > 1, this rank's padded partition; with one rank the partition stays in pinned host
// memory and the device holds only the window (parameter offload).
struct ParamPlacement {
  int zero_stage = 2;
  int world_size = 1;
  int window_layers = 2;
};

// Elements of the 16-bit weights the device holds under `placement`.
int64_t DeviceParamElements(const Gpt2Config& config, const ParamPlacement& placement);

// Micro-batch B, sequence T. gpu_optimizer: the fused GPU AdamW (the no-offload baseline) instead
// of the CPU shards.
// activation_checkpointing: the activations of a model that keeps only each block's input.
// gradient_bucket_elements: 0, the device holds a gradient for every parameter; otherwise the
// gradients leave backward in buckets of at least that many (model_spec/gradient_buckets.h; 1:
// each unit a bucket of its own, what one rank uses), and the device holds the bucket slots of
// zero/bucket_slots.h: the embeddings' bucket and two others at once (DeviceGradientElements).
// The GPU optimizer needs every gradient at once, so it ignores the buckets.
// attention: which attention's buffers the activations hold (attention_kind.h); by default
// cuDNN's fused attention with the workspace estimated from the shape, what a 16-bit model runs
// on the H100. The model passes the attention it chose and its plans' real workspace.
CudaMemoryPlan PlanGpt2CudaMemory(const Gpt2Config& config, int B, int T, DType dtype,
                                  bool gpu_optimizer, const ParamPlacement& placement = {},
                                  bool activation_checkpointing = false,
                                  int64_t gradient_bucket_elements = 0,
                                  const AttentionMemory& attention = {});

// What the host holds for a job on one GPU. With offload: the shards' fp32 master weights and both
// Adam moments (12 bytes a parameter), the trainer's 16-bit host copies of the weights it uploads
// and the gradients it sends (2 + 2; with a parameter window the weights' copy is the pinned host
// model the window is fed from), and the pinned staging rings, one per direction. GPU-only: the
// 16-bit copy of the weights it uploads (2). Not counted: a micro-batch accumulator on the shards
// (4 more with micro-batches), the delayed update's second weight copy (2 more with DPU), and
// whatever else runs on the host.
struct HostMemoryPlan {
  int64_t optimizer_state_bytes = 0;
  int64_t trainer_bytes = 0;
  int64_t staging_bytes = 0;
  int64_t total_bytes() const { return optimizer_state_bytes + trainer_bytes + staging_bytes; }
};
// pinned_staging_bytes: per direction (gpu_trainer --pinned_staging_mb).
HostMemoryPlan PlanHostMemory(const Gpt2Config& config, DType dtype, bool gpu_optimizer,
                              int64_t pinned_staging_bytes);
inline constexpr int64_t kDefaultPinnedStagingBytes = int64_t{64} << 20;

struct LargestTrainable {
  Gpt2Config config;
  int64_t num_params = 0;
  CudaMemoryPlan plan;
  HostMemoryPlan host;
  // What stops one more layer of the same width: "gpu", "host" or "both".
  std::string binds;
};

// The GPT-2-shaped model (vocab 50257, context T, head size 64 up to 1280 channels and 128 above,
// widths of the GPT-2 and GPT-3 families, as many layers as fit) with the most parameters whose
// plan fits in device_bytes. NotFound when not even one layer of the narrowest width fits.
// host_bytes: the host memory the plan must fit too; 0 for no limit.
absl::StatusOr<LargestTrainable> LargestTrainableGpt2(int64_t device_bytes, int B, int T,
                                                      DType dtype, bool gpu_optimizer,
                                                      const ParamPlacement& placement = {},
                                                      bool activation_checkpointing = false,
                                                      int64_t host_bytes = 0,
                                                      int64_t gradient_bucket_elements = 0);

std::string DescribeConfig(const Gpt2Config& config);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_MEMORY_PLANNER_H_
