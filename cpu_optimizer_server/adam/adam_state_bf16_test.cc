// Tests of bf16 moments (AdamSpan::state_dtype): on every path, a step with bf16 moments is the
// fp32 step from the same (widened) moments with only its stored moments rounded, as
// adam_kernel.h defines the rounding; stochastic rounding is unbiased, and it is what keeps the
// second moment decaying where rounding to nearest freezes it.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

std::string PathName(const testing::TestParamInfo<SimdPath>& info) {
  return std::string(SimdPathName(info.param));
}

bool SameFloat(float a, float b) {
  return FloatBits(a) == FloatBits(b) || (std::isnan(a) && std::isnan(b));
}
bool SameBf16(uint16_t a, uint16_t b) {
  return a == b || (std::isnan(Bf16ToFloat(a)) && std::isnan(Bf16ToFloat(b)));
}

class AdamStateBf16Test : public testing::TestWithParam<SimdPath> {
 protected:
  void SetUp() override {
    if (!SimdPathSupported(GetParam())) GTEST_SKIP() << "CPU lacks this SIMD path";
    kernel_ = GetAdamKernel(GetParam());
  }
  AdamKernelFn kernel_ = nullptr;
};

// One problem: fp32 weights, bf16 moments (+1 element before and after, which nothing may touch).
struct Bf16Problem {
  Bf16Problem(int64_t n, std::mt19937_64& rng, DType grad_dtype)
      : n(n), grad_dtype(grad_dtype), grad32(n), grad16(n), param(n), m(n + 2), v(n + 2), out(n) {
    std::normal_distribution<float> normal;
    for (int64_t i = 0; i < n; ++i) {
      param[i] = normal(rng);
      m[i + 1] = FloatToBf16(0.01f * normal(rng));
      v[i + 1] = FloatToBf16(1e-4f * std::fabs(normal(rng)));
      const float g = 0.1f * normal(rng);
      grad32[i] = g;
      grad16[i] = grad_dtype == DType::kBf16 ? FloatToBf16(g) : FloatToFp16(g);
    }
    m.front() = m.back() = v.front() = v.back() = 0xa5a5;
    // Edge values: an inf and a NaN gradient, a zero second moment.
    if (n > 8) {
      grad32[3] = INFINITY;
      grad16[3] = grad_dtype == DType::kBf16 ? 0x7f80 : 0x7c00;
      grad32[5] = NAN;
      grad16[5] = grad_dtype == DType::kBf16 ? 0x7fc0 : 0x7e00;
      v[7 + 1] = 0;
    }
  }
  const void* grad() const {
    return grad_dtype == DType::kFp32 ? static_cast<const void*>(grad32.data()) : grad16.data();
  }

  int64_t n;
  DType grad_dtype;
  std::vector<float> grad32;
  std::vector<uint16_t> grad16;
  std::vector<float> param;  // (n,)
  std::vector<uint16_t> m;   // (n + 2,): element i at i + 1
  std::vector<uint16_t> v;   // (n + 2,)
  std::vector<uint16_t> out;
};

TEST_P(AdamStateBf16Test, IsTheFp32StepWithItsStoredMomentsRounded) {
  const AdamKernelFn scalar = GetAdamKernel(SimdPath::kScalar);
  const uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  struct Form {
    AdamForm form;
    double beta1;
  };
  const Form kForms[] = {
      {AdamForm::kTorch113, 0.9}, {AdamForm::kLerp, 0.9}, {AdamForm::kLerp, 0.3}};
  // The last first_element crosses 2^32, where the random bits' element index wraps.
  const int64_t kFirst[] = {0, 12345, (int64_t{1} << 32) - 40};
  for (const Form& form : kForms) {
    for (int64_t n : {1, 7, 15, 17, 33, 100003}) {
      for (DType grad_dtype : {DType::kFp32, DType::kFp16, DType::kBf16}) {
        for (StateRounding rounding : {StateRounding::kStochastic, StateRounding::kNearest}) {
          const int64_t first = kFirst[rng() % 3];
          SCOPED_TRACE(testing::Message()
                       << "seed=" << seed << " n=" << n << " grad=" << DTypeName(grad_dtype)
                       << " form=" << static_cast<int>(form.form) << " beta1=" << form.beta1
                       << " stochastic=" << (rounding == StateRounding::kStochastic)
                       << " first=" << first);
          Bf16Problem pr(n, rng, grad_dtype);
          AdamHyperParams hp;
          hp.adamw = true;
          hp.weight_decay = 0.01;
          hp.form = form.form;
          hp.beta1 = form.beta1;
          const uint64_t t = 1 + rng() % 100;
          const AdamStepScalars s = ComputeAdamStepScalars(hp, 1e-3, t, 0.5f);

          // The fp32 step (the scalar reference) from the widened moments.
          std::vector<float> p32 = pr.param, m32(n), v32(n);
          std::vector<uint16_t> out32(n);
          for (int64_t i = 0; i < n; ++i) {
            m32[i] = Bf16ToFloat(pr.m[i + 1]);
            v32[i] = Bf16ToFloat(pr.v[i + 1]);
          }
          AdamSpan a;
          a.grad = pr.grad();
          a.grad_dtype = grad_dtype;
          a.param = p32.data();
          a.exp_avg = m32.data();
          a.exp_avg_sq = v32.data();
          a.out = out32.data();
          a.out_dtype = DType::kBf16;
          a.n = n;
          scalar(s, a);

          AdamSpan b = a;
          b.param = pr.param.data();
          b.exp_avg = pr.m.data() + 1;
          b.exp_avg_sq = pr.v.data() + 1;
          b.out = pr.out.data();
          b.state_dtype = DType::kBf16;
          b.rounding = rounding;
          b.rounding_key = StochasticRoundingKey(t);
          b.first_element = first;
          kernel_(s, b);

          ASSERT_EQ(pr.m.front(), 0xa5a5);
          ASSERT_EQ(pr.m.back(), 0xa5a5);
          ASSERT_EQ(pr.v.front(), 0xa5a5);
          ASSERT_EQ(pr.v.back(), 0xa5a5);
          for (int64_t i = 0; i < n; ++i) {
            const uint32_t bits = StochasticRoundingBits(b.rounding_key, first + i);
            const bool sr = rounding == StateRounding::kStochastic;
            const uint16_t want_m = sr ? FloatToBf16Stochastic(m32[i], bits) : FloatToBf16(m32[i]);
            const uint16_t want_v =
                sr ? FloatToBf16Stochastic(v32[i], bits >> 16) : FloatToBf16(v32[i]);
            ASSERT_TRUE(SameFloat(pr.param[i], p32[i])) << "param[" << i << "]";
            ASSERT_TRUE(pr.out[i] == out32[i] || std::isnan(p32[i])) << "out[" << i << "]";
            ASSERT_TRUE(SameBf16(pr.m[i + 1], want_m))
                << "exp_avg[" << i << "]: " << pr.m[i + 1] << " vs " << want_m;
            ASSERT_TRUE(SameBf16(pr.v[i + 1], want_v))
                << "exp_avg_sq[" << i << "]: " << pr.v[i + 1] << " vs " << want_v;
          }
        }
      }
    }
  }
}

// Written elsewhere (an update during backward into the staging copy): the same bits as in place,
// and the moments it read untouched.
TEST_P(AdamStateBf16Test, OutOfPlaceEqualsInPlace) {
  std::mt19937_64 rng(7);
  for (int64_t n : {5, 64, 1001}) {
    Bf16Problem pr(n, rng, DType::kBf16);
    const std::vector<float> param0 = pr.param;
    const std::vector<uint16_t> m0 = pr.m, v0 = pr.v;
    AdamHyperParams hp;
    const AdamStepScalars s = ComputeAdamStepScalars(hp, 1e-3, 3, 1.0f);
    AdamSpan in_place;
    in_place.grad = pr.grad();
    in_place.grad_dtype = DType::kBf16;
    in_place.param = pr.param.data();
    in_place.exp_avg = pr.m.data() + 1;
    in_place.exp_avg_sq = pr.v.data() + 1;
    in_place.n = n;
    in_place.state_dtype = DType::kBf16;
    in_place.rounding_key = StochasticRoundingKey(3);
    in_place.first_element = 99;
    std::vector<float> p2(n);
    std::vector<uint16_t> m2(n), v2(n);
    AdamSpan out_of_place = in_place;
    out_of_place.param_in = param0.data();
    out_of_place.exp_avg_in = m0.data() + 1;
    out_of_place.exp_avg_sq_in = v0.data() + 1;
    out_of_place.param = p2.data();
    out_of_place.exp_avg = m2.data();
    out_of_place.exp_avg_sq = v2.data();
    std::vector<float> src_p = param0;
    std::vector<uint16_t> src_m = m0, src_v = v0;
    kernel_(s, out_of_place);
    kernel_(s, in_place);
    EXPECT_EQ(param0, src_p);
    EXPECT_EQ(m0, src_m);
    EXPECT_EQ(v0, src_v);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_TRUE(SameFloat(p2[i], pr.param[i])) << i;
      ASSERT_TRUE(SameBf16(m2[i], pr.m[i + 1])) << i;
      ASSERT_TRUE(SameBf16(v2[i], pr.v[i + 1])) << i;
    }
  }
}

// With no gradient, exp_avg_sq should fall by beta2 a step. Rounded to nearest it never moves:
// 0.999 v is within half a bf16 ulp (2^-9 v at least) of v. Stochastically rounded, the mean over
// many elements follows beta2^t: each step adds rounding noise of at most half an ulp (2^-8 v) of
// standard deviation per element, so after T steps an element is off by at most sqrt(T) 2^-8 v
// (one sigma) and the mean of K elements by sqrt(T) 2^-8 v / sqrt(K); the bound is six of those.
TEST_P(AdamStateBf16Test, StochasticRoundingKeepsTheSecondMomentDecaying) {
  constexpr int64_t kK = 4096;
  constexpr int kSteps = 500;
  const float v0 = 1.0f;  // a bf16 value
  AdamHyperParams hp;
  hp.adamw = true;
  hp.weight_decay = 0;
  std::vector<uint16_t> zero_grad(kK, 0);
  for (StateRounding rounding : {StateRounding::kNearest, StateRounding::kStochastic}) {
    std::vector<float> param(kK, 0.0f);
    std::vector<uint16_t> m(kK, 0), v(kK, FloatToBf16(v0));
    for (int t = 1; t <= kSteps; ++t) {
      AdamSpan span;
      span.grad = zero_grad.data();
      span.grad_dtype = DType::kBf16;
      span.param = param.data();
      span.exp_avg = m.data();
      span.exp_avg_sq = v.data();
      span.n = kK;
      span.state_dtype = DType::kBf16;
      span.rounding = rounding;
      span.rounding_key = StochasticRoundingKey(t);
      kernel_(ComputeAdamStepScalars(hp, 1e-3, t, 1.0f), span);
    }
    double mean = 0;
    for (uint16_t x : v) mean += Bf16ToFloat(x);
    mean /= kK;
    const double expected = v0 * std::pow(0.999, kSteps);
    if (rounding == StateRounding::kNearest) {
      EXPECT_EQ(mean, v0) << "rounding to nearest was expected to freeze exp_avg_sq";
    } else {
      const double bound = 6 * std::sqrt(double{kSteps}) * 0x1p-8 * v0 / std::sqrt(double{kK});
      EXPECT_NEAR(mean, expected, bound);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, AdamStateBf16Test,
                         testing::Values(SimdPath::kScalar, SimdPath::kAvx2, SimdPath::kAvx512),
                         PathName);

// The rounding itself: each result is one of the two neighbours, and the mean over many random
// draws is the value, within six standard deviations of a Bernoulli's (at most ulp / 2 each).
TEST(StochasticRoundingTest, IsUnbiasedAndPicksANeighbour) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal;
  constexpr int kDraws = 1 << 14;
  for (int trial = 0; trial < 200; ++trial) {
    const float x = normal(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20);
    const uint16_t down = static_cast<uint16_t>(FloatBits(x) >> 16);
    const float lo = Bf16ToFloat(down);
    const float hi = Bf16ToFloat(static_cast<uint16_t>(down + 1));
    const uint32_t key = StochasticRoundingKey(trial);
    double sum = 0;
    for (int e = 0; e < kDraws; ++e) {
      const uint16_t r = FloatToBf16Stochastic(x, StochasticRoundingBits(key, e));
      ASSERT_TRUE(r == down || r == static_cast<uint16_t>(down + 1)) << x;
      sum += Bf16ToFloat(r);
    }
    const double ulp = std::fabs(double{hi} - double{lo});
    EXPECT_NEAR(sum / kDraws, x, 6 * 0.5 * ulp / std::sqrt(double{kDraws})) << x;
  }
  // Exact values never move; inf stays inf; a NaN stays a NaN.
  for (uint32_t e = 0; e < 1000; ++e) {
    ASSERT_EQ(FloatToBf16Stochastic(1.5f, StochasticRoundingBits(1, e)), FloatToBf16(1.5f));
    ASSERT_EQ(FloatToBf16Stochastic(INFINITY, StochasticRoundingBits(1, e)), 0x7f80);
    ASSERT_TRUE(std::isnan(Bf16ToFloat(
        FloatToBf16Stochastic(BitsToFloat(0x7fffffffu), StochasticRoundingBits(1, e)))));
  }
}

}  // namespace
}  // namespace offload
