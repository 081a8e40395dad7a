// fp32 <-> storage type on the device, through cuda_dtype.cuh's conversions (round to nearest
// even, overflow to inf, NaN kept), which agree with the host ones in base/dtype.h.
#include <cstdint>

#include "gpu_trainer/cuda/kernels/convert.h"
#include "gpu_trainer/cuda/kernels/elementwise_grid.cuh"
#include "gpu_trainer/cuda/runtime/cuda_dtype.cuh"

namespace offload {
namespace {

template <typename T>
__global__ void ConvertFromFloatKernel(T* out, const float* in, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = FromFloat<T>(in[i]);
  }
}

template <typename T>
__global__ void ConvertFromFloatScaledKernel(T* out, const float* in, float scale, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = FromFloat<T>(in[i] * scale);
  }
}

template <typename T>
__global__ void ConvertToFloatKernel(float* out, const T* in, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = ToFloat(in[i]);
  }
}

}  // namespace

template <typename T>
cudaError_t ConvertFromFloat(T* out, const float* in, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  ConvertFromFloatKernel<T><<<ElementwiseGrid(n), kElementwiseBlock, 0, stream>>>(out, in, n);
  return cudaGetLastError();
}

template <typename T>
cudaError_t ConvertFromFloatScaled(T* out, const float* in, float scale, int64_t n,
                                   cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  ConvertFromFloatScaledKernel<T>
      <<<ElementwiseGrid(n), kElementwiseBlock, 0, stream>>>(out, in, scale, n);
  return cudaGetLastError();
}

template <typename T>
cudaError_t ConvertToFloat(float* out, const T* in, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  ConvertToFloatKernel<T><<<ElementwiseGrid(n), kElementwiseBlock, 0, stream>>>(out, in, n);
  return cudaGetLastError();
}

#define OFFLOAD_INSTANTIATE_CONVERT(T)                                                            \
  template cudaError_t ConvertFromFloat<T>(T*, const float*, int64_t, cudaStream_t);              \
  template cudaError_t ConvertFromFloatScaled<T>(T*, const float*, float, int64_t, cudaStream_t); \
  template cudaError_t ConvertToFloat<T>(float*, const T*, int64_t, cudaStream_t);
OFFLOAD_INSTANTIATE_FOR_STORAGE_TYPES(OFFLOAD_INSTANTIATE_CONVERT)

}  // namespace offload
