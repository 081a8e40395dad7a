// The residual add. Its backward is the identity, which the model gets by letting both branches
// add into one residual-stream gradient (model/layer_kernels.h).
#ifndef OFFLOAD_GPU_TRAINER_CUDA_KERNELS_RESIDUAL_H_
#define OFFLOAD_GPU_TRAINER_CUDA_KERNELS_RESIDUAL_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace offload {

// out (n,) = a + b, summed in fp32 and rounded once; out may alias a or b.
template <typename T>
cudaError_t ResidualForward(T* out, const T* a, const T* b, int64_t n, cudaStream_t stream);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_KERNELS_RESIDUAL_H_
