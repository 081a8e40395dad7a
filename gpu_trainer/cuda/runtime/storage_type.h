// Host-side view of the CUDA backend's storage types: the DType of each, and a dispatch from a
// run-time DType to code templated on the storage type. Includable from plain C++.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_STORAGE_TYPE_H_
#define OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_STORAGE_TYPE_H_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>
#include <type_traits>
#include <utility>

#include "base/dtype.h"

namespace offload {

template <typename T>
constexpr DType StorageDType();
template <>
constexpr DType StorageDType<float>() {
  return DType::kFp32;
}
template <>
constexpr DType StorageDType<__half>() {
  return DType::kFp16;
}
template <>
constexpr DType StorageDType<__nv_bfloat16>() {
  return DType::kBf16;
}

// The storage value nearest x, and back, on the host, with the project's reference conversions.
template <typename T>
T HostFromFloat(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    const uint16_t bits = StorageDType<T>() == DType::kFp16 ? FloatToFp16(x) : FloatToBf16(x);
    T out;
    std::memcpy(static_cast<void*>(&out), &bits, sizeof(out));
    return out;
  }
}

template <typename T>
float HostToFloat(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    uint16_t bits;
    std::memcpy(&bits, static_cast<const void*>(&x), sizeof(bits));
    return StorageDType<T>() == DType::kFp16 ? Fp16ToFloat(bits) : Bf16ToFloat(bits);
  }
}

// Calls fn(T{}) with T the storage type of `dtype`, returning what fn returns.
template <typename Fn>
auto DispatchStorageType(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFp16:
      return fn(__half{});
    case DType::kBf16:
      return fn(__nv_bfloat16{});
    case DType::kFp32:
      break;
  }
  return fn(float{});
}

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_STORAGE_TYPE_H_
