// GELU, tanh approximation (GPT-2's), elementwise in fp32.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_KERNELS_GELU_H_
#define OFFLOAD_GPU_TRAINER_CUDA_KERNELS_GELU_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace offload {

// out (n,) = gelu(inp (n,)); out may alias inp.
template <typename T>
cudaError_t GeluForward(T* out, const T* inp, int64_t n, cudaStream_t stream);

// dinp (n,) = gelu'(inp) * dout, overwritten; dinp may alias dout.
template <typename T>
cudaError_t GeluBackward(T* dinp, const T* inp, const T* dout, int64_t n, cudaStream_t stream);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_KERNELS_GELU_H_
