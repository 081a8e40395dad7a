// The model's row-major products (GPT-2 Conv1D weights are (in, out)) on top of gemm.h, forward
// and backward, the MLP's first product with its GELU, and the LM head tied to the token
// embedding. Parameter gradients are OVERWRITTEN here: every weight has one producer, except wte,
// whose embedding share the encoder backward adds afterwards.
//
// `fused` asks for cuBLASLt's epilogues (gemm_spec.h's GemmEpilogue) in place of separate
// kernels: GELU_AUX_BIAS (the GELU and its saved input), DGELU_BGRAD (the GELU's backward and the
// bias gradient of the product before it) and BGRADA (a bias gradient from the weight-gradient
// product). They are used for the 16-bit types only (UsesFusedEpilogues) and wherever cuBLASLt
// offers an algorithm for them; otherwise, or with fused == false, the same results come from
// the unfused kernels (gelu.h, bias_grad.h), which are the reference. The two differ by
// rounding only: the fused GELU reads its fp32 input before it is rounded to T, and the
// epilogues' bias sums run in cuBLASLt's order.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_BLAS_MATMUL_H_
#define OFFLOAD_GPU_TRAINER_CUDA_BLAS_MATMUL_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "absl/status/status.h"
#include "gpu_trainer/cuda/blas/gemm.h"

namespace offload {

// out (N, OC) = inp (N, C) @ weight (C, OC) + bias (OC); bias may be nullptr.
template <typename T>
absl::Status MatmulForward(CublasLt& lt, T* out, const T* inp, const T* weight, const T* bias,
                           int N, int C, int OC, cudaStream_t stream);

// The storage types that take the fused epilogues when asked: the 16-bit ones. fp32 is the
// parity-test mode, a true fp32 reference, and keeps the unfused kernels whatever is asked.
template <typename T>
constexpr bool UsesFusedEpilogues(bool fused) {
  return fused && !std::is_same_v<T, float>;
}

// out (N, OC) = gelu(pre), pre (N, OC) = inp (N, C) @ weight (C, OC) + bias (OC), both written
// (pre is what the backward needs). Fused: one product with the GELU_AUX_BIAS epilogue (pre is
// its aux matrix), needs a bias and OC a multiple of 8; else MatmulForward then GeluForward.
template <typename T>
absl::Status MatmulGeluForward(CublasLt& lt, T* out, T* pre, const T* inp, const T* weight,
                               const T* bias, int N, int C, int OC, bool fused,
                               cudaStream_t stream);

// Floats of scratch MatmulBackward needs (the bias reduction's).
int64_t MatmulBackwardScratchFloats(int N, int OC);
// And MatmulGeluBackward (both bias reductions', one after the other).
int64_t MatmulGeluBackwardScratchFloats(int N, int C, int OC);

// dinp (N, C) =, dweight (C, OC) =, dbias (OC) = (may be nullptr); dout (N, OC), inp (N, C),
// weight (C, OC). Fused: dbias from the BGRADA epilogue of the dweight product.
template <typename T>
absl::Status MatmulBackward(CublasLt& lt, T* dinp, T* dweight, T* dbias, float* scratch,
                            const T* dout, const T* inp, const T* weight, int N, int C, int OC,
                            cudaStream_t stream, bool fused = false);

// The backward of out = gelu(pre) @ weight + bias through the GELU as well: dpre (N, C) =
// gelu'(pre) * (dout @ weight^T) =; dpre_bias (C) = the column sums of dpre = (the bias gradient
// of the product that made pre; may be nullptr); dweight (C, OC) =, dbias (OC) = (may be
// nullptr). dout (N, OC), inp = gelu(pre) (N, C), pre (N, C), weight (C, OC). Fused (with
// dpre_bias, C a multiple of 8): the DGELU_BGRAD epilogue on the dinp product and BGRADA on the
// dweight one; else the product, GeluBackward, BiasGrad. dpre may not alias pre.
template <typename T>
absl::Status MatmulGeluBackward(CublasLt& lt, T* dpre, T* dpre_bias, T* dweight, T* dbias,
                                float* scratch, const T* dout, const T* inp, const T* pre,
                                const T* weight, int N, int C, int OC, bool fused,
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
