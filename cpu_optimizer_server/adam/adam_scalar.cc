// The scalar reference of the fused Adam pass: the numerics contract in code. Compiled with
// -ffp-contract=off, so every operation below rounds exactly where it is written; the only
// fused multiply-adds are the explicit std::fma calls.
//
// Operation order follows torch 1.13's _single_tensor_adam on CPU, op by op. Torch's vectorized
// CPU kernels (AVX2 capability, which Debian's build selects on any AVX2 machine) compute
//   grad.add(param, alpha=wd)              as fma(param, wd, grad)
//   exp_avg.mul_(b1).add_(grad, alpha=1-b1) as fma(grad, 1-b1, exp_avg * b1)
//   exp_avg_sq.mul_(b2).addcmul_(g, g, value=1-b2)  as fma((1-b2) * g, g, exp_avg_sq * b2)
//   param.addcdiv_(exp_avg, denom, value=-step_size) as param + (-step_size * exp_avg) / denom
// (checked bit for bit against torch with testdata/make_adam_fixtures.py). Torch 2.x moves the
// first moment with exp_avg.lerp_(grad, w = 1-b1) instead (AdamForm::kLerp), which its CPU kernel
// computes, vectorized and in the scalar tail alike (measured on torch 2.13, AVX512 capability,
// sizes 1..70 and 100003), as
//   |w| < 0.5 ? fma(w, grad - exp_avg, exp_avg) : fma(w - 1, grad - exp_avg, grad)
// with w - 1 rounded in fp32. The other operations are the same in both forms. Following that order
// exactly makes this reference equal torch per element, and the SIMD paths, which do the same
// correctly rounded operations in the same order, equal this reference bit for bit.
#include <cmath>
#include <cstdint>

#include "base/dtype.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"
#include "cpu_optimizer_server/adam/adam_kernel_internal.h"

namespace offload {
namespace internal {
namespace {

inline float LoadGrad(const void* grad, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFp32:
      return static_cast<const float*>(grad)[i];
    case DType::kFp16:
      return Fp16ToFloat(static_cast<const uint16_t*>(grad)[i]);
    case DType::kBf16:
      return Bf16ToFloat(static_cast<const uint16_t*>(grad)[i]);
  }
  return 0.0f;
}

inline uint16_t ToHalf(float x, DType dtype) {
  return dtype == DType::kBf16 ? FloatToBf16(x) : FloatToFp16(x);
}

// The moments of a span, fp32 or bf16 (AdamSpan::state_dtype), read in and written out.
class Moments {
 public:
  explicit Moments(const AdamSpan& span)
      : bf16_(span.state_dtype == DType::kBf16),
        stochastic_(span.rounding == StateRounding::kStochastic),
        key_(span.rounding_key),
        first_(span.first_element),
        exp_avg_(span.exp_avg),
        exp_avg_sq_(span.exp_avg_sq),
        exp_avg_in_(span.exp_avg_in != nullptr ? span.exp_avg_in : span.exp_avg),
        exp_avg_sq_in_(span.exp_avg_sq_in != nullptr ? span.exp_avg_sq_in : span.exp_avg_sq) {}

  float exp_avg(int64_t i) const { return Load(exp_avg_in_, i); }
  float exp_avg_sq(int64_t i) const { return Load(exp_avg_sq_in_, i); }
  void Store(int64_t i, float m, float v) const {
    if (!bf16_) {
      static_cast<float*>(exp_avg_)[i] = m;
      static_cast<float*>(exp_avg_sq_)[i] = v;
    } else if (stochastic_) {
      const uint32_t bits = StochasticRoundingBits(key_, first_ + i);
      static_cast<uint16_t*>(exp_avg_)[i] = FloatToBf16Stochastic(m, bits);
      static_cast<uint16_t*>(exp_avg_sq_)[i] = FloatToBf16Stochastic(v, bits >> 16);
    } else {
      static_cast<uint16_t*>(exp_avg_)[i] = FloatToBf16(m);
      static_cast<uint16_t*>(exp_avg_sq_)[i] = FloatToBf16(v);
    }
  }

 private:
  float Load(const void* p, int64_t i) const {
    return bf16_ ? Bf16ToFloat(static_cast<const uint16_t*>(p)[i])
                 : static_cast<const float*>(p)[i];
  }
  const bool bf16_, stochastic_;
  const uint32_t key_;
  const int64_t first_;
  void* const exp_avg_;
  void* const exp_avg_sq_;
  const void* const exp_avg_in_;
  const void* const exp_avg_sq_in_;
};

}  // namespace

void AdamScalar(const AdamStepScalars& s, const AdamSpan& span) {
  const float neg_step_size = -s.step_size;  // torch: addcdiv_(..., value=-step_size)
  float* const param = span.param;           // (n,)
  const float* const param_in = span.param_in != nullptr ? span.param_in : param;
  const Moments moments(span);
  uint16_t* const out = static_cast<uint16_t*>(span.out);  // (n,) or nullptr
  const bool lerp = s.form == AdamForm::kLerp;
  const float w = s.one_minus_beta1;
  const bool lerp_from_exp_avg = w < 0.5f && w > -0.5f;
  const float lerp_coeff = lerp_from_exp_avg ? w : w - 1.0f;
  for (int64_t i = 0; i < span.n; ++i) {
    float p = param_in[i];
    float g = LoadGrad(span.grad, span.grad_dtype, i) * s.grad_multiplier;
    // torch only adds the L2 term when weight_decay != 0; fma(p, 0, g) would turn an inf or NaN
    // weight into a NaN gradient that torch does not produce.
    if (s.l2_weight_decay != 0.0f) g = std::fma(p, s.l2_weight_decay, g);
    p = p * s.decoupled_decay;
    float m = moments.exp_avg(i);
    if (!lerp) {
      m = std::fma(g, s.one_minus_beta1, m * s.beta1);
    } else {
      m = std::fma(lerp_coeff, g - m, lerp_from_exp_avg ? m : g);
    }
    const float v = std::fma(s.one_minus_beta2 * g, g, moments.exp_avg_sq(i) * s.beta2);
    const float denom = std::sqrt(v) / s.bias_correction2_sqrt + s.eps;
    p = p + (neg_step_size * m) / denom;
    param[i] = p;
    // The moments are rounded only where they are stored: this step's update uses them in fp32.
    moments.Store(i, m, v);
    if (out != nullptr) out[i] = ToHalf(p, span.out_dtype);
  }
}

void RooflineScalar(const AdamSpan& span) {
  float* const param = span.param;
  const float* const param_in = span.param_in != nullptr ? span.param_in : param;
  AdamSpan nearest = span;  // the roofline's stores round the cheapest way
  nearest.rounding = StateRounding::kNearest;
  const Moments moments(nearest);
  uint16_t* const out = static_cast<uint16_t*>(span.out);
  for (int64_t i = 0; i < span.n; ++i) {
    // All loads, then all stores, as in AdamScalar (see RooflineVector in adam_simd.h).
    const float g = LoadGrad(span.grad, span.grad_dtype, i);
    const float p = param_in[i] + g;
    const float m = moments.exp_avg(i) + g;
    const float v = moments.exp_avg_sq(i) + g;
    param[i] = p;
    moments.Store(i, m, v);
    // The cheapest store with the same traffic: the high half of the fp32 bits.
    if (out != nullptr) out[i] = static_cast<uint16_t>(FloatBits(p) >> 16);
  }
}

}  // namespace internal
}  // namespace offload
