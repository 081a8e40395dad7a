// Entry points of the per-instruction-set translation units, for the dispatcher (adam_kernel.cc)
// and the tests. The AVX2 and AVX-512 functions live in files compiled with those instruction
// sets: call them only after SimdPathSupported() said yes.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_ADAM_ADAM_KERNEL_INTERNAL_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_ADAM_ADAM_KERNEL_INTERNAL_H_

#include <cstdint>

#include "base/dtype.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"

namespace offload {
namespace internal {

// Vector-level conversions exposed so tests can check them bit for bit against dtype.h.
// `dtype` is kFp16 or kBf16; `half` holds n 16-bit values.
using FloatToHalfFn = void (*)(const float* in, DType dtype, uint16_t* half, int64_t n);
using HalfToFloatFn = void (*)(const uint16_t* half, DType dtype, float* out, int64_t n);

void AdamScalar(const AdamStepScalars& s, const AdamSpan& span);
void RooflineScalar(const AdamSpan& span);

void AdamAvx2(const AdamStepScalars& s, const AdamSpan& span);
void RooflineAvx2(const AdamSpan& span);
void FloatToHalfAvx2(const float* in, DType dtype, uint16_t* half, int64_t n);
void HalfToFloatAvx2(const uint16_t* half, DType dtype, float* out, int64_t n);

void AdamAvx512(const AdamStepScalars& s, const AdamSpan& span);
void RooflineAvx512(const AdamSpan& span);
void FloatToHalfAvx512(const float* in, DType dtype, uint16_t* half, int64_t n);
void HalfToFloatAvx512(const uint16_t* half, DType dtype, float* out, int64_t n);

// The conversions of a SIMD path (nullptr for kScalar, whose conversions are dtype.h's).
FloatToHalfFn GetFloatToHalf(SimdPath path);
HalfToFloatFn GetHalfToFloat(SimdPath path);

}  // namespace internal
}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_ADAM_ADAM_KERNEL_INTERNAL_H_
