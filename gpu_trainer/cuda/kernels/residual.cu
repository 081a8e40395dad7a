// The residual add: fp32 sum of the two branches, rounded once. Each thread reads both inputs of
// an element (of a 16-byte vector of them) before writing it, so out may alias either input.
#include <cstdint>

#include "gpu_trainer/cuda/kernels/elementwise_grid.cuh"
#include "gpu_trainer/cuda/kernels/residual.h"
#include "gpu_trainer/cuda/kernels/vector_access.h"
#include "gpu_trainer/cuda/runtime/cuda_dtype.cuh"

namespace offload {
namespace {

// 16-byte vectors where all three pointers are aligned, single elements for the tail
// (vector_access.h); the same fp32 sum per element either way.
template <typename T>
__global__ void ResidualForwardKernel(T* out, const T* a, const T* b, int64_t n) {
  namespace va = vector_access;
  const va::VectorSplit split = va::SplitVectors(
      n, Packed128<T>::kSize, va::IsAligned16(out) && va::IsAligned16(a) && va::IsAligned16(b));
  va::ForEachShare(
      split, n, va::GridStride(blockIdx.x, blockDim.x, gridDim.x, threadIdx.x),
      [&](int64_t i) {
        const Packed128<T> x = Packed128<T>::Load(a + i);
        const Packed128<T> y = Packed128<T>::Load(b + i);
        Packed128<T> sum;
#pragma unroll
        for (int j = 0; j < Packed128<T>::kSize; ++j) {
          sum[j] = FromFloat<T>(ToFloat(x[j]) + ToFloat(y[j]));
        }
        sum.Store(out + i);
      },
      [&](int64_t i) { out[i] = FromFloat<T>(ToFloat(a[i]) + ToFloat(b[i])); });
}

}  // namespace

template <typename T>
cudaError_t ResidualForward(T* out, const T* a, const T* b, int64_t n, cudaStream_t stream) {
  namespace va = vector_access;
  if (n == 0) return cudaSuccess;
  const bool aligned = va::IsAligned16(out) && va::IsAligned16(a) && va::IsAligned16(b);
  const int grid = ElementwiseGrid(
      va::ThreadsWanted(va::SplitVectors(n, va::VectorWidth(sizeof(T)), aligned), n));
  ResidualForwardKernel<T><<<grid, kElementwiseBlock, 0, stream>>>(out, a, b, n);
  return cudaGetLastError();
}

#define OFFLOAD_INSTANTIATE_RESIDUAL(T) \
  template cudaError_t ResidualForward<T>(T*, const T*, const T*, int64_t, cudaStream_t);
OFFLOAD_INSTANTIATE_FOR_STORAGE_TYPES(OFFLOAD_INSTANTIATE_RESIDUAL)

}  // namespace offload
