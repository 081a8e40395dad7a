// Which causal attention the CUDA GPT-2 runs (CudaModelOptions::attention), cuDNN's fused flash
// attention (cudnn_attention.h) or the reference of blas/attention.h, which saves the whole
// (B, NH, T, T) softmax for backward, and what each takes of the activation allocation. A header
// of its own because the model's options, its carve (gpt2_cuda_buffers.h) and the memory planner
// all name these, and none of them needs cuDNN to.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_CUDNN_ATTENTION_KIND_H_
#define OFFLOAD_GPU_TRAINER_CUDA_CUDNN_ATTENTION_KIND_H_

#include <cstdint>

namespace offload {

enum class AttentionKind : int {
  // cuDNN when the library loads, the storage type is 16-bit, the head size suits it and both
  // plans build for (max_batch, max_seq); the reference otherwise. Decided once, at Create.
  kAuto = 0,
  // cuDNN or Create fails, saying why.
  kCudnn = 1,
  // The reference, always.
  kReference = 2,
};

inline const char* AttentionKindName(AttentionKind kind) {
  switch (kind) {
    case AttentionKind::kAuto:
      return "auto";
    case AttentionKind::kCudnn:
      return "cudnn";
    case AttentionKind::kReference:
      return "reference";
  }
  return "?";
}

// The attention's share of the activation carve (CarveGpt2CudaActivations).
//   fused:     the softmax statistics, (L, B, NH, T) fp32 (one layer's under checkpointing),
//              and cuDNN's workspace; no (B, NH, T, T) matrix anywhere.
//   reference: the softmax weights, (L, B, NH, T, T) in the storage type, and the permute
//              scratch (AttentionScratchElems).
// The planner's default is fused: it is what the H100 runs.
struct AttentionMemory {
  bool fused = true;
  // cuDNN's workspace in bytes: the larger of the forward and backward plans' needs at the
  // carve's (B, T), which the model asks the plans for before it carves. -1: the planner's figure
  // without a GPU to ask, backward's fp32 dQ accumulator and row sums
  // (SdpaLayout::BackwardWorkspace) with no engine workspace beyond them.
  int64_t cudnn_workspace_bytes = -1;
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_CUDNN_ATTENTION_KIND_H_
