// The three storage types of the CUDA backend and their conversions to and from fp32, the type
// every kernel computes in. float is the parity-test mode; __half and __nv_bfloat16 train.
// Conversions round to nearest even; fp16 overflow saturates to +-inf and NaN stays NaN, as the
// host conversions of base/dtype.h, so the device and host agree bit for bit.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_CUDA_DTYPE_CUH_
#define OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_CUDA_DTYPE_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace offload {

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Sum over the 32 lanes of a warp; every lane gets the total.
__device__ __forceinline__ float WarpSum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ __forceinline__ float WarpMax(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

inline int CeilDiv(long long a, long long b) { return static_cast<int>((a + b - 1) / b); }

}  // namespace offload

// Explicit instantiation of a launcher template for the three storage types, at the end of each
// kernel file: INSTANTIATE_FOR_STORAGE_TYPES(INSTANTIATE_LAYERNORM) with a macro of one type.
#define OFFLOAD_INSTANTIATE_FOR_STORAGE_TYPES(MACRO) \
  MACRO(float)                                       \
  MACRO(__half)                                      \
  MACRO(__nv_bfloat16)

#endif  // OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_CUDA_DTYPE_CUH_
