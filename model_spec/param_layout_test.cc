// The flat layout (GPT-2 names, shapes, order), the config checks, the FLOP count, and the
// seeded initialisation.
#include "model_spec/param_layout.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model_spec/gpt2_config.h"

namespace offload {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(Gpt2Config, ValidateNamesTheField) {
  EXPECT_TRUE(ValidateGpt2Config(Gpt2Config{}).ok());
  Gpt2Config c;
  c.channels = 130;  // not divisible by 4 heads
  EXPECT_THAT(ValidateGpt2Config(c).message(), HasSubstr("channels"));
  EXPECT_EQ(ValidateGpt2Config(c).code(), absl::StatusCode::kInvalidArgument);
  c = Gpt2Config{};
  c.num_layers = 0;
  EXPECT_THAT(ValidateGpt2Config(c).message(), HasSubstr("num_layers"));
  c = Gpt2Config{};
  c.vocab_size = -1;
  EXPECT_THAT(ValidateGpt2Config(c).message(), HasSubstr("vocab_size"));
  c = Gpt2Config{};
  c.context_length = 1 << 30;
  EXPECT_THAT(ValidateGpt2Config(c).message(), HasSubstr("context_length"));
  c = Gpt2Config{};
  c.num_heads = 0;
  EXPECT_THAT(ValidateGpt2Config(c).message(), HasSubstr("num_heads"));
}

TEST(Gpt2ParamLayout, NamesShapesAndOrder) {
  const Gpt2Config c{/*vocab_size=*/11, /*context_length=*/5, /*num_layers=*/2, /*num_heads=*/2,
                     /*channels=*/6};
  const std::vector<ParamTensor> layout = Gpt2ParamLayout(c);
  ASSERT_EQ(layout.size(), 2u + 12u * 2u + 2u);
  std::vector<std::string> names;
  for (const ParamTensor& t : layout) names.push_back(t.name);
  EXPECT_EQ(names[0], "wte.weight");
  EXPECT_EQ(names[1], "wpe.weight");
  EXPECT_EQ(std::vector<std::string>(names.begin() + 14, names.begin() + 26),
            (std::vector<std::string>{"h.1.ln_1.weight", "h.1.ln_1.bias", "h.1.attn.c_attn.weight",
                                      "h.1.attn.c_attn.bias", "h.1.attn.c_proj.weight",
                                      "h.1.attn.c_proj.bias", "h.1.ln_2.weight", "h.1.ln_2.bias",
                                      "h.1.mlp.c_fc.weight", "h.1.mlp.c_fc.bias",
                                      "h.1.mlp.c_proj.weight", "h.1.mlp.c_proj.bias"}));
  EXPECT_EQ(names[26], "ln_f.weight");
  EXPECT_EQ(names[27], "ln_f.bias");
  EXPECT_THAT(layout[0].shape, ElementsAre(11, 6));
  EXPECT_THAT(layout[1].shape, ElementsAre(5, 6));
  EXPECT_THAT(layout[4].shape, ElementsAre(6, 18));   // c_attn (in, out)
  EXPECT_THAT(layout[10].shape, ElementsAre(6, 24));  // c_fc
  EXPECT_THAT(layout[12].shape, ElementsAre(24, 6));  // mlp.c_proj

  int64_t offset = 0;  // back to back, numel consistent with shape
  for (const ParamTensor& t : layout) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    EXPECT_EQ(t.numel, numel) << t.name;
    EXPECT_EQ(t.offset, offset) << t.name;
    offset += t.numel;
  }
  EXPECT_EQ(Gpt2NumParams(c), offset);
  EXPECT_EQ(Gpt2LayerOffset(c, 0), layout[2].offset);
  EXPECT_EQ(Gpt2LayerOffset(c, 1), layout[14].offset);
  EXPECT_EQ(Gpt2LayerOffset(c, 2), layout[26].offset);
}

TEST(Gpt2ParamLayout, Gpt2SmallHasHuggingFacesParameterCount) {
  const Gpt2Config gpt2{50257, 1024, 12, 12, 768};
  EXPECT_EQ(Gpt2NumParams(gpt2), 124439808);  // GPT2LMHeadModel, tied head counted once
}

TEST(Gpt2UnitRange, UnitsTileTheBufferAtTensorBoundaries) {
  const Gpt2Config c{97, 16, 3, 2, 8};
  const std::vector<ParamTensor> layout = Gpt2ParamLayout(c);
  ASSERT_EQ(Gpt2NumUnits(c), 5);
  int64_t at = 0;
  for (int u = 0; u < Gpt2NumUnits(c); ++u) {
    const ParamRange r = Gpt2UnitRange(c, u);
    EXPECT_EQ(r.begin, at) << u;
    EXPECT_GT(r.size(), 0) << u;
    at = r.end;
  }
  EXPECT_EQ(at, Gpt2NumParams(c));
  EXPECT_EQ(Gpt2UnitRange(c, 0).end, layout[BlockIndex(0, kLn1Weight)].offset);  // wte, wpe
  EXPECT_EQ(Gpt2UnitRange(c, 2).begin, layout[BlockIndex(1, kLn1Weight)].offset);
  EXPECT_EQ(Gpt2UnitRange(c, 4).begin, layout[LnfWeightIndex(3)].offset);
}

TEST(Gpt2Flops, SixPerMatmulWeightPlusAttention) {
  const Gpt2Config c{/*vocab_size=*/256, /*context_length=*/64, /*num_layers=*/4,
                     /*num_heads=*/4, /*channels=*/128};
  const double expected = 6.0 * (12.0 * 4 * 128 * 128 + 256.0 * 128) + 12.0 * 4 * 128 * 64;
  EXPECT_DOUBLE_EQ(Gpt2FlopsPerToken(c, 64), expected);
}

double SampleStd(const float* p, int64_t n) {
  double sum = 0.0, sum2 = 0.0;
  for (int64_t i = 0; i < n; i++) {
    sum += p[i];
    sum2 += double{p[i]} * p[i];
  }
  const double mean = sum / n;
  return std::sqrt(sum2 / n - mean * mean);
}

TEST(InitGpt2Params, DeterministicAndGpt2Statistics) {
  const Gpt2Config c{/*vocab_size=*/256, /*context_length=*/64, /*num_layers=*/4,
                     /*num_heads=*/4, /*channels=*/128};
  const int64_t n = Gpt2NumParams(c);
  std::vector<float> a(n, -7.0f), b(n, -7.0f), other(n, -7.0f);
  InitGpt2Params(c, 42, a.data());
  InitGpt2Params(c, 42, b.data());
  InitGpt2Params(c, 43, other.data());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), n * sizeof(float)), 0) << "same seed, same bits";
  int64_t differ = 0;
  for (int64_t i = 0; i < n; i++) differ += a[i] != other[i];
  EXPECT_GT(differ, n / 2) << "another seed, other weights";

  for (const ParamTensor& t : Gpt2ParamLayout(c)) {
    const float* p = a.data() + t.offset;
    const bool bias = t.name.size() > 5 && t.name.substr(t.name.size() - 5) == ".bias";
    if (bias) {
      for (int64_t i = 0; i < t.numel; i++) ASSERT_EQ(p[i], 0.0f) << t.name;
    } else if (t.name.find("ln_") != std::string::npos) {
      for (int64_t i = 0; i < t.numel; i++) ASSERT_EQ(p[i], 1.0f) << t.name;
    } else {
      const bool residual = t.name.find("c_proj.weight") != std::string::npos;
      const double expected = residual ? 0.02 / std::sqrt(2.0 * c.num_layers) : 0.02;
      // >= 16K samples per tensor: the sample std is within ~1% of the true one.
      EXPECT_NEAR(SampleStd(p, t.numel), expected, 0.03 * expected) << t.name;
    }
  }
}

// Pins the generator's output, so a change to it (which would silently change every run's
// starting weights, and break "same seed, same model" across versions) fails here.
TEST(InitGpt2Params, GoldenValues) {
  const Gpt2Config c{/*vocab_size=*/8, /*context_length=*/4, /*num_layers=*/1, /*num_heads=*/1,
                     /*channels=*/4};
  std::vector<float> p(Gpt2NumParams(c));
  InitGpt2Params(c, 1234, p.data());
  uint64_t hash = 1469598103934665603ull;  // FNV-1a over the bytes
  for (const float x : p) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    for (int i = 0; i < 4; i++) hash = (hash ^ ((bits >> (8 * i)) & 0xff)) * 1099511628211ull;
  }
  EXPECT_EQ(hash, 12921080180651393080ull) << "first value " << p[0];
}

}  // namespace
}  // namespace offload
