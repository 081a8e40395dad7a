// The model's row-major products (GPT-2 Conv1D weights are (in, out)) on top of gemm.h, forward
// and backward, and the LM head tied to the token embedding. Parameter gradients are
// OVERWRITTEN here: every weight has one producer, except wte, whose embedding share the encoder
// backward adds afterwards.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_BLAS_MATMUL_H_
#define OFFLOAD_GPU_TRAINER_CUDA_BLAS_MATMUL_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "gpu_trainer/cuda/blas/gemm.h"

namespace offload {

// out (N, OC) = inp (N, C) @ weight (C, OC) + bias (OC); bias may be nullptr.
template <typename T>
absl::Status MatmulForward(CublasLt& lt, T* out, const T* inp, const T* weight, const T* bias,
                           int N, int C, int OC, cudaStream_t stream);

// Floats of scratch MatmulBackward needs (the bias reduction's).
int64_t MatmulBackwardScratchFloats(int N, int OC);

// dinp (N, C) =, dweight (C, OC) =, dbias (OC) = (may be nullptr); dout (N, OC), inp (N, C),
// weight (C, OC).
template <typename T>
absl::Status MatmulBackward(CublasLt& lt, T* dinp, T* dweight, T* dbias, float* scratch,
                            const T* dout, const T* inp, const T* weight, int N, int C, int OC,
                            cudaStream_t stream);

// logits (N, ld_logits) columns [0, V) = inp (N, C) @ wte (V, C)^T; columns [V, ld_logits) are
// not written. ld_logits >= V, padded so every row starts 16-byte aligned.
template <typename T>
absl::Status TiedHeadForward(CublasLt& lt, T* logits, int64_t ld_logits, const T* inp, const T* wte,
                             int N, int C, int V, cudaStream_t stream);

// dinp (N, C) =, dwte (V, C) =; dlogits (N, ld_logits), columns [0, V) read.
template <typename T>
absl::Status TiedHeadBackward(CublasLt& lt, T* dinp, T* dwte, const T* dlogits, int64_t ld_logits,
                              const T* inp, const T* wte, int N, int C, int V, cudaStream_t stream);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_BLAS_MATMUL_H_
