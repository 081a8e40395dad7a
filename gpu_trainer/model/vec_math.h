// Vectorisable exp and tanh for the fast kernels. libm's expf and tanhf are scalar calls the
// compiler cannot vectorise without -ffast-math, and GELU alone evaluates a tanh for every one of
// the B*T*4C hidden activations of every layer, forward and backward: with scalar libm those
// loops cost about as much as all of a step's BLAS products at the benchmark's size.
//
// These are straight-line float code that GCC/Clang vectorise inside plain loops (`omp simd`
// where a loop also reduces; GCC needs -fno-trapping-math to if-convert the clamps, which
// layers_fast.cc is built with). Accuracy: VecExp within 2 ulp of exp on [-87, 88]
// (Cephes' expf polynomial after a Cody-Waite reduction); tested against libm in layers_test.cc.
#ifndef OFFLOAD_GPU_TRAINER_MODEL_VEC_MATH_H_
#define OFFLOAD_GPU_TRAINER_MODEL_VEC_MATH_H_

#include <cmath>
#include <cstdint>
#include <cstring>

namespace offload {

// exp(x), clamped to [exp(-87), exp(88)] (finite and normal: softmax and GELU need no more).
inline float VecExp(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  // exp(x) = 2^n * exp(r), n = round(x / ln 2), |r| <= ln(2) / 2. Adding and subtracting 1.5 *
  // 2^23 rounds to the nearest integer without a call (round-to-nearest mode, no fast-math).
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  // r = x - n ln 2 with ln 2 split in two so n * 0.693359375 is exact.
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// tanh(u) and its derivative 1 - tanh(u)^2 = sech(u)^2, both from one exp, to ~1e-7 absolute
// (GELU adds tanh to 1, so absolute error is what matters; near 0 the relative error is larger).
// With y = 2 / (exp(2|u|) + 1) = 1 - tanh|u|, sech^2 = y (2 - y) keeps full relative precision
// where tanh saturates, which 1 - tanh^2 would lose to cancellation.
struct TanhSech2 {
  float tanh;
  float sech2;
};
inline TanhSech2 VecTanhSech2(float u) {
  const float y = 2.0f / (VecExp(2.0f * std::fabs(u)) + 1.0f);
  return {std::copysign(1.0f - y, u), y * (2.0f - y)};
}

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_MODEL_VEC_MATH_H_
