#include "model_spec/param_layout.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/splitmix64.h"
#include "model_spec/gpt2_config.h"

namespace offload {
namespace {

// Elements of one transformer block: 2 LayerNorms, c_attn, attn.c_proj, c_fc, mlp.c_proj.
int64_t LayerNumel(int64_t C) {
  return 4 * C + (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C);
}

int64_t EmbeddingNumel(const Gpt2Config& c) {
  return int64_t{c.vocab_size} * c.channels + int64_t{c.context_length} * c.channels;
}

class Xoshiro256 {
 public:
  explicit Xoshiro256(uint64_t seed) {
    for (uint64_t& word : s_) word = SplitMix64(&seed);
  }
  uint64_t Next() {
    const uint64_t result = Rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = Rotl(s_[3], 45);
    return result;
  }
  // Uniform in [-1, 1) on a 2^-52 grid: exact in double.
  double NextSigned() { return static_cast<double>(Next() >> 11) * 0x1.0p-52 - 1.0; }

 private:
  static uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

// Natural log of x in (0, 1] from + - * / and exact scaling only, so every IEEE-754 platform
// gets the same bits (libm's log need not be correctly rounded). Error ~1e-16 relative.
double PortableLog(double x) {
  int e = 0;
  double m = std::frexp(x, &e);   // x = m * 2^e, m in [0.5, 1): exact
  if (m < 0.70710678118654752) {  // centre m on 1 so the series below converges fast
    m *= 2.0;
    e -= 1;
  }
  // log(m) = 2 atanh(s) = 2 (s + s^3/3 + s^5/5 + ...), s = (m-1)/(m+1), |s| < 0.172.
  const double s = (m - 1.0) / (m + 1.0);
  const double s2 = s * s;
  double sum = 0.0;
  for (int k = 21; k >= 1; k -= 2) sum = sum * s2 + 1.0 / k;
  return 2.0 * s * sum + e * 0.69314718055994531;
}

class NormalSampler {
 public:
  explicit NormalSampler(uint64_t seed) : rng_(seed) {}
  // Marsaglia's polar method: two normals per accepted pair, the second kept for the next call.
  double Next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    double u, v, s;
    do {
      u = rng_.NextSigned();
      v = rng_.NextSigned();
      s = u * u + v * v;
    } while (s >= 1.0 || s == 0.0);
    const double f = std::sqrt(-2.0 * PortableLog(s) / s);  // sqrt is correctly rounded (IEEE)
    spare_ = v * f;
    has_spare_ = true;
    return u * f;
  }

 private:
  Xoshiro256 rng_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

bool EndsWith(absl::string_view s, absl::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace

std::vector<ParamTensor> Gpt2ParamLayout(const Gpt2Config& c) {
  const int64_t V = c.vocab_size, maxT = c.context_length, C = c.channels;
  std::vector<ParamTensor> layout;
  int64_t offset = 0;
  auto add = [&](std::string name, std::vector<int64_t> shape) {
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    layout.push_back(ParamTensor{std::move(name), std::move(shape), offset, numel});
    offset += numel;
  };
  add("wte.weight", {V, C});
  add("wpe.weight", {maxT, C});
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string h = absl::StrCat("h.", l, ".");
    add(h + "ln_1.weight", {C});
    add(h + "ln_1.bias", {C});
    add(h + "attn.c_attn.weight", {C, 3 * C});
    add(h + "attn.c_attn.bias", {3 * C});
    add(h + "attn.c_proj.weight", {C, C});
    add(h + "attn.c_proj.bias", {C});
    add(h + "ln_2.weight", {C});
    add(h + "ln_2.bias", {C});
    add(h + "mlp.c_fc.weight", {C, 4 * C});
    add(h + "mlp.c_fc.bias", {4 * C});
    add(h + "mlp.c_proj.weight", {4 * C, C});
    add(h + "mlp.c_proj.bias", {C});
  }
  add("ln_f.weight", {C});
  add("ln_f.bias", {C});
  return layout;
}

int64_t Gpt2LayerOffset(const Gpt2Config& c, int l) {
  return EmbeddingNumel(c) + l * LayerNumel(c.channels);
}

int64_t Gpt2NumParams(const Gpt2Config& c) {
  return Gpt2LayerOffset(c, c.num_layers) + 2 * int64_t{c.channels};
}

ParamRange Gpt2UnitRange(const Gpt2Config& c, int unit) {
  if (unit == 0) return {0, Gpt2LayerOffset(c, 0)};
  if (unit <= c.num_layers) return {Gpt2LayerOffset(c, unit - 1), Gpt2LayerOffset(c, unit)};
  return {Gpt2LayerOffset(c, c.num_layers), Gpt2NumParams(c)};
}

void InitGpt2Params(const Gpt2Config& c, uint64_t seed, float* params) {
  NormalSampler normal(seed);
  const double std_default = 0.02;
  // GPT-2 scales the projections that write into the residual stream by 1/sqrt(number of
  // residual additions) so the stream's variance does not grow with depth.
  const double std_residual = 0.02 / std::sqrt(2.0 * c.num_layers);
  for (const ParamTensor& t : Gpt2ParamLayout(c)) {
    float* p = params + t.offset;
    const absl::string_view name = t.name;
    const bool layernorm = name.find("ln_") != absl::string_view::npos;
    if (EndsWith(name, ".bias")) {
      for (int64_t i = 0; i < t.numel; ++i) p[i] = 0.0f;
    } else if (layernorm) {
      for (int64_t i = 0; i < t.numel; ++i) p[i] = 1.0f;
    } else {
      const double std = EndsWith(name, "c_proj.weight") ? std_residual : std_default;
      for (int64_t i = 0; i < t.numel; ++i) p[i] = static_cast<float>(std * normal.Next());
    }
  }
}

}  // namespace offload
