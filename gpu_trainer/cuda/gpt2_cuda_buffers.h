// The device buffers of the CUDA GPT-2 and the one function that carves them, shared by the model
// (over its real allocation) and the memory planner (over nullptr, to measure), so the planner's
// numbers are the model's by construction.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_GPT2_CUDA_BUFFERS_H_
#define OFFLOAD_GPU_TRAINER_CUDA_GPT2_CUDA_BUFFERS_H_

#include <algorithm>
#include <cstdint>

#include "gpu_trainer/cuda/blas/attention.h"
#include "gpu_trainer/cuda/blas/matmul.h"
#include "gpu_trainer/cuda/cudnn/attention_kind.h"
#include "gpu_trainer/cuda/cudnn/sdpa_graph.h"
#include "gpu_trainer/cuda/kernels/grad_norm.h"
#include "gpu_trainer/cuda/kernels/layernorm.h"
#include "gpu_trainer/cuda/runtime/device_buffer.h"
#include "model_spec/gpt2_config.h"

namespace offload {

// Logit rows padded to a multiple of 64 elements, so every row of a 16-bit (N, V) matrix starts
// 16-byte aligned (cuBLASLt's fast paths need it; GPT-2's V = 50257 is odd).
inline int64_t PaddedVocab(int V) { return (int64_t{V} + 63) / 64 * 64; }

// What Forward saves for Backward (per layer, leading (L); with activation checkpointing (1), but
// residual3, the blocks' inputs, which keeps (L)) and one layer's worth of scratch and activation
// gradients, sized for (max_batch B, max_seq T). Same names as Gpt2Cpu's.
template <typename T>
struct Gpt2CudaActivations {
  T* encoded;       // (B, T, C)
  T* ln1;           // (L, B, T, C)
  float* ln1_mean;  // (L, B, T)
  float* ln1_rstd;  // (L, B, T)
  T* qkv;           // (L, B, T, 3C)
  T* atty;          // (L, B, T, C)
  T* att;           // (L, B, NH, T, T) reference attention only, else null
  float* att_lse;   // (L, SdpaStatsLayerFloats) cuDNN's softmax statistics only, else null
  T* residual2;     // (L, B, T, C)
  T* ln2;           // (L, B, T, C)
  float* ln2_mean;  // (L, B, T)
  float* ln2_rstd;  // (L, B, T)
  T* fch;           // (L, B, T, 4C) also the GELU epilogue's aux (T, ld 4C)
  T* fch_gelu;      // (L, B, T, 4C) c_proj's input: kept when fused too
  T* residual3;     // (L, B, T, C)
  T* lnf;           // (B, T, C)
  float* lnf_mean;  // (B, T)
  float* lnf_rstd;  // (B, T)
  T* logits;        // (B, T, Vp) overwritten by their gradient in Backward
  float* losses;    // (B, T)
  float* lse;       // (B, T) log-sum-exp of each logit row
  // Scratch and activation gradients, one layer's worth (Backward walks a layer at a time).
  T* proj;                    // (B, T, C) a c_proj output before its residual add
  T* attn_scratch;            // AttentionScratchElems, reference attention only
  void* cudnn_workspace;      // cudnn_bytes, cuDNN attention only
  int64_t cudnn_bytes;        // of cudnn_workspace, the plans' need at (max_batch, max_seq)
  T* dresidual;               // (B, T, C)
  T* dln;                     // (B, T, C) dlnf, dln2, dln1 in turn
  T* dqkv;                    // (B, T, 3C)
  T* datty;                   // (B, T, C)
  T* dfch;                    // (B, T, 4C) d fch (unfused: d fch_gelu first, in place)
  float* fscratch;            // the largest reduction scratch of the backward kernels
  double* norm_scratch;       // GradNormScratchDoubles
  GradNormResult* norm;       // (1,)
  int32_t* inputs;            // (B, T)
  int32_t* targets;           // (B, T)
  int32_t* bucket_tokens;     // (B * T,)
  int32_t* bucket_offsets;    // (B * T + 1,)
  int32_t* bucket_positions;  // (B * T,)
};

template <typename T>
void CarveGpt2CudaActivations(const Gpt2Config& c, int B, int Tn, BufferCarver& carver,
                              Gpt2CudaActivations<T>* a, bool activation_checkpointing = false,
                              const AttentionMemory& attention = {}) {
  const int64_t L = c.num_layers, C = c.channels, NH = c.num_heads;
  const int64_t Ls = activation_checkpointing ? 1 : L;  // layers of saved activations
  const int64_t BT = int64_t{B} * Tn;
  a->encoded = carver.Take<T>(BT * C);
  a->ln1 = carver.Take<T>(Ls * BT * C);
  a->ln1_mean = carver.Take<float>(Ls * BT);
  a->ln1_rstd = carver.Take<float>(Ls * BT);
  a->qkv = carver.Take<T>(Ls * BT * 3 * C);
  a->atty = carver.Take<T>(Ls * BT * C);
  a->att = attention.fused ? nullptr : carver.Take<T>(Ls * B * NH * Tn * Tn);
  a->att_lse =
      attention.fused ? carver.Take<float>(Ls * SdpaStatsLayerFloats(B, c.num_heads, Tn)) : nullptr;
  a->residual2 = carver.Take<T>(Ls * BT * C);
  a->ln2 = carver.Take<T>(Ls * BT * C);
  a->ln2_mean = carver.Take<float>(Ls * BT);
  a->ln2_rstd = carver.Take<float>(Ls * BT);
  a->fch = carver.Take<T>(Ls * BT * 4 * C);
  a->fch_gelu = carver.Take<T>(Ls * BT * 4 * C);
  a->residual3 = carver.Take<T>(L * BT * C);
  a->lnf = carver.Take<T>(BT * C);
  a->lnf_mean = carver.Take<float>(BT);
  a->lnf_rstd = carver.Take<float>(BT);
  a->logits = carver.Take<T>(BT * PaddedVocab(c.vocab_size));
  a->losses = carver.Take<float>(BT);
  a->lse = carver.Take<float>(BT);
  a->proj = carver.Take<T>(BT * C);
  a->attn_scratch = attention.fused
                        ? nullptr
                        : carver.Take<T>(AttentionScratchElems(B, Tn, c.channels, c.num_heads));
  a->cudnn_bytes = 0;
  if (attention.fused) {
    a->cudnn_bytes =
        attention.cudnn_workspace_bytes >= 0
            ? attention.cudnn_workspace_bytes
            : SdpaLayout(B, Tn, c.channels, c.num_heads).BackwardWorkspace(0).total_bytes;
  }
  a->cudnn_workspace = attention.fused ? carver.Take<char>(a->cudnn_bytes) : nullptr;
  a->dresidual = carver.Take<T>(BT * C);
  a->dln = carver.Take<T>(BT * C);
  a->dqkv = carver.Take<T>(BT * 3 * C);
  a->datty = carver.Take<T>(BT * C);
  a->dfch = carver.Take<T>(BT * 4 * C);
  const int N = static_cast<int>(BT);
  a->fscratch = carver.Take<float>(std::max({LayerNormBackwardScratchFloats(N, c.channels),
                                             MatmulBackwardScratchFloats(N, 4 * c.channels),
                                             MatmulBackwardScratchFloats(N, 3 * c.channels)}));
  a->norm_scratch = carver.Take<double>(GradNormScratchDoubles());
  a->norm = carver.Take<GradNormResult>(1);
  a->inputs = carver.Take<int32_t>(BT);
  a->targets = carver.Take<int32_t>(BT);
  a->bucket_tokens = carver.Take<int32_t>(BT);
  a->bucket_offsets = carver.Take<int32_t>(BT + 1);
  a->bucket_positions = carver.Take<int32_t>(BT);
}

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_GPT2_CUDA_BUFFERS_H_
