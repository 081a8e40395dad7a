// Element types on the wire and in the kernels, and scalar conversions between fp32 and the
// 16-bit formats. The conversions are the reference the SIMD paths are tested against:
// round-to-nearest-even, overflow saturates to +-inf as IEEE says, NaN stays NaN (quieted),
// subnormals are kept, not flushed.
#ifndef OFFLOAD_BASE_DTYPE_H_
#define OFFLOAD_BASE_DTYPE_H_

#include <cstdint>
#include <cstring>

#include "absl/strings/string_view.h"

namespace offload {

enum class DType : uint8_t { kFp32, kFp16, kBf16 };

inline int DTypeSize(DType d) { return d == DType::kFp32 ? 4 : 2; }

inline absl::string_view DTypeName(DType d) {
  switch (d) {
    case DType::kFp32:
      return "fp32";
    case DType::kFp16:
      return "fp16";
    case DType::kBf16:
      return "bf16";
  }
  return "?";
}

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float Bf16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even; carries into the exponent, up to inf
  return static_cast<uint16_t>(u >> 16);
}

inline float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp != 0) return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return BitsToFloat(sign);
  // Subnormal: value = mant * 2^-24, exact in fp32.
  float f = static_cast<float>(mant) * 5.9604644775390625e-8f;
  return sign ? -f : f;
}

inline uint16_t FloatToFp16(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u | static_cast<uint16_t>((abs >> 13) & 0x3ffu);
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: overflow to inf
  if (abs < 0x38800000u) {
    // Subnormal (or zero) in fp16: the value in units of 2^-24, rounded to nearest even.
    if (abs < 0x33000000u) return sign;  // < 2^-25: rounds to zero (ties to even: 2^-25 -> 0)
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exp;  // 14 ..24: bits dropped to land at 2^-24 units
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return sign | static_cast<uint16_t>(q);
  }
  // Normal: rebias exponent, round mantissa from 23 to 10 bits (carry may bump the exponent).
  uint32_t r = abs - 0x38000000u;  // exponent bias 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return sign | static_cast<uint16_t>(r >> 13);
}

// (n,) fp32 -> (n,) dtype.
inline void ConvertFromFloat(const float* src, int64_t n, DType dtype, void* dst) {
  if (dtype == DType::kFp32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  uint16_t* out = static_cast<uint16_t*>(dst);
  if (dtype == DType::kFp16) {
    for (int64_t i = 0; i < n; ++i) out[i] = FloatToFp16(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = FloatToBf16(src[i]);
  }
}

// dst (n,) fp32 += src (n,) in dtype.
inline void AddAsFloat(const void* src, DType dtype, int64_t n, float* dst) {
  if (dtype == DType::kFp32) {
    const float* in = static_cast<const float*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] += in[i];
    return;
  }
  const uint16_t* in = static_cast<const uint16_t*>(src);
  if (dtype == DType::kFp16) {
    for (int64_t i = 0; i < n; ++i) dst[i] += Fp16ToFloat(in[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] += Bf16ToFloat(in[i]);
  }
}

// Whether any of (n,) values in dtype is inf or NaN: exponent bits all ones.
inline bool HasNonFinite(const void* data, DType dtype, int64_t n) {
  if (dtype == DType::kFp32) {
    const uint32_t* in = static_cast<const uint32_t*>(data);
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; ++i) bad |= ((in[i] & 0x7f800000u) == 0x7f800000u);
    return bad != 0;
  }
  const uint16_t mask = dtype == DType::kFp16 ? 0x7c00u : 0x7f80u;
  const uint16_t* in = static_cast<const uint16_t*>(data);
  uint32_t bad = 0;  // branch-free so the loop vectorizes
  for (int64_t i = 0; i < n; ++i) bad |= ((in[i] & mask) == mask);
  return bad != 0;
}

}  // namespace offload

#endif  // OFFLOAD_BASE_DTYPE_H_
