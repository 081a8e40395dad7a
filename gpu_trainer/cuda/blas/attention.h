// Causal multi-head self-attention, the simple correct way first: Q, K, V split into (B, NH, T,
// hs) by a permute kernel, the scores by a strided-batched product, a causal softmax kernel
// (fp32 inside), the weighted sum by another batched product, and a permute back. The softmax
// weights are saved for backward, as in the CPU backend.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_BLAS_ATTENTION_H_
#define OFFLOAD_GPU_TRAINER_CUDA_BLAS_ATTENTION_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "gpu_trainer/cuda/blas/gemm.h"

namespace offload {

// Elements of T scratch AttentionForward and AttentionBackward need, the larger of the two.
int64_t AttentionScratchElems(int B, int Tn, int C, int NH);

// qkv (B, T, 3C): Q, K, V side by side, head h in channels [h*hs, (h+1)*hs) of each, hs = C / NH.
// out (B, T, C) heads side by side; att (B, NH, T, T) softmax(Q K^T / sqrt(hs)) with zeros above
// the diagonal, saved for backward; scratch AttentionScratchElems(...) elements.
template <typename T>
absl::Status AttentionForward(CublasLt& lt, T* out, T* att, T* scratch, const T* qkv, int B, int Tn,
                              int C, int NH, cudaStream_t stream);

// dqkv (B, T, 3C) =; dout (B, T, C); qkv and att as saved by the forward.
template <typename T>
absl::Status AttentionBackward(CublasLt& lt, T* dqkv, T* scratch, const T* dout, const T* qkv,
                               const T* att, int B, int Tn, int C, int NH, cudaStream_t stream);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_BLAS_ATTENTION_H_
