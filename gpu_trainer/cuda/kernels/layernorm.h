// LayerNorm over the last dimension, eps 1e-5 (GPT-2's), statistics and sums in fp32.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_KERNELS_LAYERNORM_H_
#define OFFLOAD_GPU_TRAINER_CUDA_KERNELS_LAYERNORM_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace offload {

// out (N, C); mean, rstd (N,) fp32, saved for backward; inp (N, C); weight, bias (C).
template <typename T>
cudaError_t LayerNormForward(T* out, float* mean, float* rstd, const T* inp, const T* weight,
                             const T* bias, int N, int C, cudaStream_t stream);

// Floats of scratch LayerNormBackward needs for (N, C).
int64_t LayerNormBackwardScratchFloats(int N, int C);

// dinp (N, C) += (ACCUMULATED: in a pre-LN model it is the residual stream's gradient, which
// already holds the skip connection's share; see model/layer_kernels.h); dweight, dbias (C) =
// (overwritten), reduced over rows deterministically. dout, inp (N, C); weight (C);
// mean, rstd (N,).
template <typename T>
cudaError_t LayerNormBackward(T* dinp, T* dweight, T* dbias, float* scratch, const T* dout,
                              const T* inp, const T* weight, const float* mean, const float* rstd,
                              int N, int C, cudaStream_t stream);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_KERNELS_LAYERNORM_H_
