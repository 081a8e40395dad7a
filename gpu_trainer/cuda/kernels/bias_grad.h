// The gradient of a bias: the column sums of the output gradient, in fp32, deterministic (a
// fixed two-pass reduction, no atomics), rounded once.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_KERNELS_BIAS_GRAD_H_
#define OFFLOAD_GPU_TRAINER_CUDA_KERNELS_BIAS_GRAD_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace offload {

int64_t BiasGradScratchFloats(int N, int OC);

// dbias (OC) = sum over rows of dout (N, OC), overwritten.
template <typename T>
cudaError_t BiasGrad(T* dbias, float* scratch, const T* dout, int N, int OC, cudaStream_t stream);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_KERNELS_BIAS_GRAD_H_
