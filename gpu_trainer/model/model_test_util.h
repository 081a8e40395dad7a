// Helpers shared by the model's tests: seeded random data and the error measure they report.
#ifndef OFFLOAD_GPU_TRAINER_MODEL_MODEL_TEST_UTIL_H_
#define OFFLOAD_GPU_TRAINER_MODEL_MODEL_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "model_spec/gpt2_config.h"
#include "model_spec/param_layout.h"

namespace offload {
namespace testing_util {

// splitmix64: the same data on every platform (std:: distributions are implementation-defined).
class TestRng {
 public:
  explicit TestRng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float Uniform(float lo, float hi) {  // [lo, hi)
    return lo + (hi - lo) * static_cast<float>(Next() >> 40) * 0x1.0p-24f;
  }
  int32_t Int(int32_t n) { return static_cast<int32_t>(Next() % static_cast<uint64_t>(n)); }

 private:
  uint64_t state_;
};

inline std::vector<float> RandomVector(int64_t n, uint64_t seed, float scale = 1.0f) {
  TestRng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = rng.Uniform(-scale, scale);
  return v;
}

inline std::vector<int32_t> RandomTokens(int64_t n, int32_t vocab, uint64_t seed) {
  TestRng rng(seed);
  std::vector<int32_t> v(n);
  for (int32_t& x : v) x = rng.Int(vocab);
  return v;
}

// The error every comparison in these tests uses: max_i |a_i - b_i| / max_i |b_i|, b being the
// reference. Relative to the tensor's scale rather than per element, so entries that happen to
// sit near zero (where summation order dominates) do not make a correct kernel look wrong.
inline double MaxRelError(const float* a, const float* b, int64_t n) {
  double max_diff = 0.0, max_ref = 0.0;
  for (int64_t i = 0; i < n; i++) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;  // std::max drops NaN
    max_diff = std::max(max_diff, std::fabs(double{a[i]} - double{b[i]}));
    max_ref = std::max(max_ref, std::fabs(double{b[i]}));
  }
  return max_ref > 0.0 ? max_diff / max_ref : max_diff;
}
inline double MaxRelError(const std::vector<float>& a, const std::vector<float>& b) {
  return MaxRelError(a.data(), b.data(), static_cast<int64_t>(b.size()));
}

// "1.23e-07": errors as test properties (std::to_string would print 0.000000).
inline std::string Sci(double x) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2e", x);
  return buf;
}

// GPT-2's initialisation plus noise on everything, LayerNorms and biases included, so that
// every gradient is non-trivial.
inline std::vector<float> PerturbedParams(const Gpt2Config& c, uint64_t seed) {
  std::vector<float> params(Gpt2NumParams(c));
  InitGpt2Params(c, seed, params.data());
  TestRng rng(seed ^ 0x5eed);
  for (float& p : params) p += rng.Uniform(-0.1f, 0.1f);
  return params;
}

}  // namespace testing_util
}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_MODEL_MODEL_TEST_UTIL_H_
