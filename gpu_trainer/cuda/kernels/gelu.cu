// GELU with GPT-2's tanh approximation, in fp32 with the CPU reference's expression order
// (model/layers_naive.cc). Grid-stride, one element per thread per step: every element is read
// before it is written by the same thread, which is what makes the in-place calls safe.
#include <cstdint>

#include "gpu_trainer/cuda/kernels/elementwise_grid.cuh"
#include "gpu_trainer/cuda/kernels/gelu.h"
#include "gpu_trainer/cuda/runtime/cuda_dtype.cuh"

namespace offload {
namespace {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)

template <typename T>
__global__ void GeluForwardKernel(T* out, const T* inp, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float x = ToFloat(inp[i]);
    const float cube = 0.044715f * x * x * x;
    out[i] = FromFloat<T>(0.5f * x * (1.0f + tanhf(kGeluScale * (x + cube))));
  }
}

template <typename T>
__global__ void GeluBackwardKernel(T* dinp, const T* inp, const T* dout, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float x = ToFloat(inp[i]);
    const float cube = 0.044715f * x * x * x;
    const float tanh_arg = kGeluScale * (x + cube);
    const float tanh_out = tanhf(tanh_arg);
    const float cosh_out = coshf(tanh_arg);
    // cosh overflows to inf for |tanh_arg| > ~89, making sech 0: the right limit, as on the CPU.
    const float sech_out = 1.0f / (cosh_out * cosh_out);
    const float local_grad = 0.5f * (1.0f + tanh_out) +
                             x * 0.5f * sech_out * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] = FromFloat<T>(local_grad * ToFloat(dout[i]));
  }
}

}  // namespace

template <typename T>
cudaError_t GeluForward(T* out, const T* inp, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  GeluForwardKernel<T><<<ElementwiseGrid(n), kElementwiseBlock, 0, stream>>>(out, inp, n);
  return cudaGetLastError();
}

template <typename T>
cudaError_t GeluBackward(T* dinp, const T* inp, const T* dout, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  GeluBackwardKernel<T><<<ElementwiseGrid(n), kElementwiseBlock, 0, stream>>>(dinp, inp, dout, n);
  return cudaGetLastError();
}

#define OFFLOAD_INSTANTIATE_GELU(T)                                         \
  template cudaError_t GeluForward<T>(T*, const T*, int64_t, cudaStream_t); \
  template cudaError_t GeluBackward<T>(T*, const T*, const T*, int64_t, cudaStream_t);
OFFLOAD_INSTANTIATE_FOR_STORAGE_TYPES(OFFLOAD_INSTANTIATE_GELU)

}  // namespace offload
