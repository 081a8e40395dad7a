// The residual add: fp32 sum of the two branches, rounded once. Each thread reads both inputs of
// an element before writing it, so out may alias either input.
#include <cstdint>

#include "gpu_trainer/cuda/kernels/elementwise_grid.cuh"
#include "gpu_trainer/cuda/kernels/residual.h"
#include "gpu_trainer/cuda/runtime/cuda_dtype.cuh"

namespace offload {
namespace {

template <typename T>
__global__ void ResidualForwardKernel(T* out, const T* a, const T* b, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = FromFloat<T>(ToFloat(a[i]) + ToFloat(b[i]));
  }
}

}  // namespace

template <typename T>
cudaError_t ResidualForward(T* out, const T* a, const T* b, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  ResidualForwardKernel<T><<<ElementwiseGrid(n), kElementwiseBlock, 0, stream>>>(out, a, b, n);
  return cudaGetLastError();
}

#define OFFLOAD_INSTANTIATE_RESIDUAL(T) \
  template cudaError_t ResidualForward<T>(T*, const T*, const T*, int64_t, cudaStream_t);
OFFLOAD_INSTANTIATE_FOR_STORAGE_TYPES(OFFLOAD_INSTANTIATE_RESIDUAL)

}  // namespace offload
