#include "optimizer_client/precision/grad_stats.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace offload {

GradStats RoundGradients(const float* grads, int64_t n, DType dtype, uint16_t* out, float scale) {
  double sum = 0;
  bool nonfinite = false;
  const bool fp16 = dtype == DType::kFp16;
#pragma omp parallel for reduction(+ : sum) reduction(|| : nonfinite) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float g = grads[i] * scale;
    const uint16_t h = fp16 ? FloatToFp16(g) : FloatToBf16(g);
    out[i] = h;
    const float v = fp16 ? Fp16ToFloat(h) : Bf16ToFloat(h);
    nonfinite = nonfinite || !std::isfinite(v);
    sum += static_cast<double>(v) * v;
  }
  return GradStats{sum, nonfinite};
}

namespace {

// Per 16-bit type: the square of a finite value, exact in double, and whether the value is inf
// (1) or NaN (2); branch-free so that the loop below vectorizes (the scalar dtype.h conversions
// branch on the exponent, which kept this a scalar loop at a quarter of the memory rate).
struct Bf16Squares {
  static int Special(uint16_t h) { return (h & 0x7f80u) != 0x7f80u ? 0 : (h & 0x7fu) != 0 ? 2 : 1; }
  static double Square(uint16_t h) {
    const double v = Bf16ToFloat(static_cast<uint16_t>((h & 0x7f80u) == 0x7f80u ? 0 : h));
    return v * v;
  }
};

struct Fp16Squares {
  static int Special(uint16_t h) {
    return (h & 0x7c00u) != 0x7c00u ? 0 : (h & 0x3ffu) != 0 ? 2 : 1;
  }
  static double Square(uint16_t h) {
    const int32_t exp = (h >> 10) & 0x1f;
    // |value| = m * 2^(e - 25): the implicit bit for normals, e = 1 for subnormals (inf and NaN
    // give some finite number: Special flags them). Both factors and the product are exact in
    // fp32. Signed: SSE2 converts only signed integers to floats in vectors.
    const int32_t m = exp != 0 ? (h & 0x3ff) | 0x400 : h & 0x3ff;
    const int32_t e = exp == 0 ? 1 : exp == 0x1f ? 25 : exp;
    const double v = static_cast<float>(m) * BitsToFloat(static_cast<uint32_t>(e + 102) << 23);
    return v * v;
  }
};

// The statistics of n 16-bit values. An inf or NaN makes the sum what a plain sum would be (NaN
// if any NaN, else inf), so the norm reported for a skipped step is torch's.
template <class Squares>
GradStats Measure16(const uint16_t* g, int64_t n) {
  double sum = 0;
  int specials = 0;
#pragma omp parallel for simd reduction(+ : sum) reduction(| : specials) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    sum += Squares::Square(g[i]);
    specials |= Squares::Special(g[i]);
  }
  if (specials & 2) {
    sum = std::numeric_limits<double>::quiet_NaN();
  } else if (specials & 1) {
    sum = std::numeric_limits<double>::infinity();
  }
  return GradStats{sum, specials != 0};
}

}  // namespace

GradStats MeasureGradients16(const uint16_t* g, int64_t n, DType dtype) {
  return dtype == DType::kFp16 ? Measure16<Fp16Squares>(g, n) : Measure16<Bf16Squares>(g, n);
}

GradStats MeasureGradients32(const float* g, int64_t n) {
  double sum = 0;
  bool nonfinite = false;
#pragma omp parallel for reduction(+ : sum) reduction(|| : nonfinite) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    nonfinite = nonfinite || !std::isfinite(g[i]);
    sum += static_cast<double>(g[i]) * g[i];
  }
  return GradStats{sum, nonfinite};
}

float ClipCoefficient(double global_norm, float max_norm) {
  if (max_norm <= 0) return 1.0f;
  const double coef = max_norm / (global_norm + 1e-6);
  return static_cast<float>(std::min(1.0, coef));
}

}  // namespace offload
