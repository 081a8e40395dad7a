#include "optimizer_client/precision/grad_stats.h"

#include <algorithm>
#include <cmath>

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

GradStats MeasureGradients16(const uint16_t* g, int64_t n, DType dtype) {
  double sum = 0;
  bool nonfinite = false;
  const bool fp16 = dtype == DType::kFp16;
#pragma omp parallel for reduction(+ : sum) reduction(|| : nonfinite) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float v = fp16 ? Fp16ToFloat(g[i]) : Bf16ToFloat(g[i]);
    nonfinite = nonfinite || !std::isfinite(v);
    sum += static_cast<double>(v) * v;
  }
  return GradStats{sum, nonfinite};
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
