// GELU with GPT-2's tanh approximation, in fp32 with the CPU reference's expression order
// (model/layers_naive.cc). Grid-stride, one 16-byte vector (or one tail element) per thread per
// step: every element is read before it is written by the same thread, which is what makes the
// in-place calls safe.
#include <cstdint>

#include "gpu_trainer/cuda/kernels/elementwise_grid.cuh"
#include "gpu_trainer/cuda/kernels/gelu.h"
#include "gpu_trainer/cuda/kernels/vector_access.h"
#include "gpu_trainer/cuda/runtime/cuda_dtype.cuh"

namespace offload {
namespace {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)

__device__ __forceinline__ float Gelu(float x) {
  const float cube = 0.044715f * x * x * x;
  return 0.5f * x * (1.0f + tanhf(kGeluScale * (x + cube)));
}

__device__ __forceinline__ float GeluGrad(float x, float dout) {
  const float cube = 0.044715f * x * x * x;
  const float tanh_arg = kGeluScale * (x + cube);
  const float tanh_out = tanhf(tanh_arg);
  const float cosh_out = coshf(tanh_arg);
  // cosh overflows to inf for |tanh_arg| > ~89, making sech 0: the right limit, as on the CPU.
  const float sech_out = 1.0f / (cosh_out * cosh_out);
  const float local_grad = 0.5f * (1.0f + tanh_out) +
                           x * 0.5f * sech_out * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
  return local_grad * dout;
}

// 16-byte vectors where out and inp are aligned, single elements for the tail
// (vector_access.h); the same arithmetic per element either way, so the same bits.
template <typename T>
__global__ void GeluForwardKernel(T* out, const T* inp, int64_t n) {
  namespace va = vector_access;
  const va::VectorSplit split =
      va::SplitVectors(n, Packed128<T>::kSize, va::IsAligned16(out) && va::IsAligned16(inp));
  va::ForEachShare(
      split, n, va::GridStride(blockIdx.x, blockDim.x, gridDim.x, threadIdx.x),
      [&](int64_t i) {
        const Packed128<T> x = Packed128<T>::Load(inp + i);
        Packed128<T> y;
#pragma unroll
        for (int j = 0; j < Packed128<T>::kSize; ++j) y[j] = FromFloat<T>(Gelu(ToFloat(x[j])));
        y.Store(out + i);
      },
      [&](int64_t i) { out[i] = FromFloat<T>(Gelu(ToFloat(inp[i]))); });
}

template <typename T>
__global__ void GeluBackwardKernel(T* dinp, const T* inp, const T* dout, int64_t n) {
  namespace va = vector_access;
  const va::VectorSplit split =
      va::SplitVectors(n, Packed128<T>::kSize,
                       va::IsAligned16(dinp) && va::IsAligned16(inp) && va::IsAligned16(dout));
  va::ForEachShare(
      split, n, va::GridStride(blockIdx.x, blockDim.x, gridDim.x, threadIdx.x),
      [&](int64_t i) {
        const Packed128<T> x = Packed128<T>::Load(inp + i);
        const Packed128<T> d = Packed128<T>::Load(dout + i);
        Packed128<T> g;
#pragma unroll
        for (int j = 0; j < Packed128<T>::kSize; ++j) {
          g[j] = FromFloat<T>(GeluGrad(ToFloat(x[j]), ToFloat(d[j])));
        }
        g.Store(dinp + i);
      },
      [&](int64_t i) { dinp[i] = FromFloat<T>(GeluGrad(ToFloat(inp[i]), ToFloat(dout[i]))); });
}

// The grid for n elements at these pointers: enough threads for the longer of the vector and
// tail loops.
template <typename T>
int GeluGrid(int64_t n, bool aligned) {
  namespace va = vector_access;
  return ElementwiseGrid(
      va::ThreadsWanted(va::SplitVectors(n, va::VectorWidth(sizeof(T)), aligned), n));
}

}  // namespace

template <typename T>
cudaError_t GeluForward(T* out, const T* inp, int64_t n, cudaStream_t stream) {
  namespace va = vector_access;
  if (n == 0) return cudaSuccess;
  const int grid = GeluGrid<T>(n, va::IsAligned16(out) && va::IsAligned16(inp));
  GeluForwardKernel<T><<<grid, kElementwiseBlock, 0, stream>>>(out, inp, n);
  return cudaGetLastError();
}

template <typename T>
cudaError_t GeluBackward(T* dinp, const T* inp, const T* dout, int64_t n, cudaStream_t stream) {
  namespace va = vector_access;
  if (n == 0) return cudaSuccess;
  const int grid =
      GeluGrid<T>(n, va::IsAligned16(dinp) && va::IsAligned16(inp) && va::IsAligned16(dout));
  GeluBackwardKernel<T><<<grid, kElementwiseBlock, 0, stream>>>(dinp, inp, dout, n);
  return cudaGetLastError();
}

#define OFFLOAD_INSTANTIATE_GELU(T)                                         \
  template cudaError_t GeluForward<T>(T*, const T*, int64_t, cudaStream_t); \
  template cudaError_t GeluBackward<T>(T*, const T*, const T*, int64_t, cudaStream_t);
OFFLOAD_INSTANTIATE_FOR_STORAGE_TYPES(OFFLOAD_INSTANTIATE_GELU)

}  // namespace offload
