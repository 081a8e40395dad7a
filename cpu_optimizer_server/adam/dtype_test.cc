// dtype.h's scalar conversions against independent double-precision references, and the SIMD
// paths' vector conversions against dtype.h, bit for bit.
#include "base/dtype.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu_optimizer_server/adam/adam_kernel.h"
#include "cpu_optimizer_server/adam/adam_kernel_internal.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

bool Fp16IsNan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }
bool Bf16IsNan(uint16_t h) { return (h & 0x7f80u) == 0x7f80u && (h & 0x7fu) != 0; }

std::string Hex(uint32_t u) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", u);
  return buf;
}

// Round |f| to a binary format with `mant_bits` stored mantissa bits, smallest normal exponent
// `min_exp`, largest finite value `max_finite`, in double: the quantum at f's binade (or the
// subnormal quantum), then nearbyint (ties to even in the default rounding mode). Returns the
// rounded magnitude, or +inf on overflow.
double RoundToFormat(double a, int mant_bits, int min_exp, double max_finite) {
  if (a == 0.0) return 0.0;
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1): leading bit at 2^(e-1)
  const int quantum_exp = std::max(e - 1, min_exp) - mant_bits;
  const double r = std::nearbyint(std::ldexp(a, -quantum_exp)) * std::ldexp(1.0, quantum_exp);
  return r > max_finite ? std::numeric_limits<double>::infinity() : r;
}

// Encodes a value that RoundToFormat produced as fp16 bits.
uint16_t EncodeFp16(double v, bool negative) {
  const uint16_t sign = negative ? 0x8000 : 0;
  if (std::isinf(v)) return sign | 0x7c00;
  if (v < std::ldexp(1.0, -14)) return sign | static_cast<uint16_t>(std::ldexp(v, 24));
  int e;
  std::frexp(v, &e);
  const int exp = e - 1;  // v in [2^exp, 2^(exp+1))
  const int mant = static_cast<int>(std::ldexp(v, 10 - exp)) - 1024;
  return sign | static_cast<uint16_t>(((exp + 15) << 10) | mant);
}

uint16_t ReferenceFp16(float f) {
  const double a = std::fabs(static_cast<double>(f));
  return EncodeFp16(RoundToFormat(a, 10, -14, 65504.0), std::signbit(f));
}

uint16_t ReferenceBf16(float f) {
  const double a = std::fabs(static_cast<double>(f));
  const double max_bf16 = std::ldexp(255.0, 120);  // (2 - 2^-7) * 2^127
  const double r = RoundToFormat(a, 7, -126, max_bf16);
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isinf(r)) return sign | 0x7f80;
  // r has at most 8 significant bits and is in fp32 range: the cast is exact.
  return sign | static_cast<uint16_t>(FloatBits(static_cast<float>(r)) >> 16);
}

// Hand-picked values at every boundary of both formats, both signs.
std::vector<float> EdgeFloats() {
  std::vector<uint32_t> bits = {
      0x00000000, 0x00000001, 0x00000002, 0x007fffff, 0x00800000,  // zero, fp32 subnormals
      0x7f7fffff, 0x7f800000, 0x7f800001, 0x7fbfffff, 0x7fc00000,  // max, inf, sNaN, qNaN
      0x7fc01234, 0x7fffffff, 0x7f7f7fff, 0x7f7f8000, 0x7f7f8001,  // NaN payloads, bf16 max/ties
      0x7f7effff, 0x7f7e8000, 0x3f808000, 0x3f818000, 0x3f80ffff,  // bf16 ties to even
      0x00008000, 0x00018000, 0x00007fff, 0x0000ffff, 0x007f8000,  // bf16 subnormal ties
  };
  const std::vector<double> values = {
      65504.0,  // fp16 max
      65519.0,
      65519.99,
      65520.0,  // just below and at the overflow tie
      65536.0,
      1e5,
      1e30,                     // overflow
      std::ldexp(1.0, -24),     // smallest fp16 subnormal
      std::ldexp(1.0, -25),     // tie between 0 and the smallest subnormal -> 0
      std::ldexp(3.0, -25),     // tie between 1 and 2 units -> 2 units (even)
      std::ldexp(5.0, -26),     // 1.25 units -> 1
      std::ldexp(1.0, -26),     // rounds to 0
      std::ldexp(1023.0, -24),  // largest fp16 subnormal
      std::ldexp(2047.0, -25),  // tie between largest subnormal and min normal -> normal
      std::ldexp(1.0, -14),     // smallest fp16 normal
      1.0,
      1.0 + std::ldexp(1.0, -11),  // tie -> 1.0 (even)
      1.0 + std::ldexp(3.0, -11),  // tie -> up (even)
      2048.0 + 1.0,
      2048.0 + 3.0,  // ties at unit quantum 2
      0.1,
      1.0 / 3.0,
      3.14159265358979,
      1e-8,
      6e-8,
      2.9e-8,
  };
  for (double v : values) bits.push_back(FloatBits(static_cast<float>(v)));
  bits.push_back(FloatBits(std::nextafter(65520.0f, 0.0f)));
  bits.push_back(FloatBits(std::nextafter(std::ldexp(1.0f, -25), 1.0f)));  // just above tie -> 1
  std::vector<float> out;
  for (uint32_t u : bits) {
    out.push_back(BitsToFloat(u));
    out.push_back(BitsToFloat(u | 0x80000000u));
  }
  return out;
}

// Random floats: raw bit patterns (every class), values in and around the fp16 range, and exact
// halfway points of both formats.
std::vector<float> RandomFloats(uint64_t seed, int count) {
  std::mt19937_64 rng(seed);
  std::vector<float> out;
  for (int i = 0; i < count; ++i) {
    const uint32_t r = static_cast<uint32_t>(rng());
    switch (i % 4) {
      case 0:
        out.push_back(BitsToFloat(r));
        break;
      case 1: {  // exponents 2^-30 .. 2^17 cover fp16's subnormals, normals and overflow
        const uint32_t exp = 97 + (r >> 8) % 48;
        out.push_back(BitsToFloat((r & 0x807fffffu) | (exp << 23)));
        break;
      }
      case 2: {  // fp16 halfway point: a finite fp16 plus half its quantum
        const uint16_t h = static_cast<uint16_t>(r % 0x7bffu);  // finite, below the max
        const double lo = Fp16ToFloat(h);
        const double q =
            (h & 0x7c00u) == 0 ? std::ldexp(1.0, -24) : std::ldexp(1.0, ((h >> 10) & 0x1f) - 25);
        const float tie = static_cast<float>(lo + q / 2);  // exact: needs at most 12 bits
        out.push_back((r >> 31) ? -tie : tie);
        break;
      }
      case 3:  // bf16 halfway point
        out.push_back(BitsToFloat((r & 0xffff0000u) | 0x8000u));
        break;
    }
  }
  return out;
}

TEST(DTypeTest, Fp16RoundTripIsExactForAllValues) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = Fp16ToFloat(static_cast<uint16_t>(h));
    const uint16_t back = FloatToFp16(f);
    if (Fp16IsNan(static_cast<uint16_t>(h))) {
      ASSERT_TRUE(std::isnan(f)) << Hex(h);
      // NaN stays NaN, quieted, sign and the payload's top bits kept.
      ASSERT_EQ(back, h | 0x0200u) << Hex(h);
    } else {
      ASSERT_EQ(back, h) << Hex(h) << " -> " << f;
    }
  }
}

TEST(DTypeTest, Fp16ToFloatMatchesDefinition) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    const float f = Fp16ToFloat(static_cast<uint16_t>(h));
    if (exp == 0x1f) {
      ASSERT_EQ(std::isnan(f), mant != 0) << Hex(h);
      if (mant == 0) {
        ASSERT_TRUE(std::isinf(f)) << Hex(h);
      }
      continue;
    }
    const double mag = exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024.0 + mant, exp - 25);
    const double expected = (h & 0x8000) ? -mag : mag;
    ASSERT_EQ(static_cast<double>(f), expected) << Hex(h);
    ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << Hex(h);
  }
}

TEST(DTypeTest, Bf16RoundTripIsExactForAllValues) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(h));
    ASSERT_EQ(FloatBits(f), h << 16);
    const uint16_t back = FloatToBf16(f);
    if (Bf16IsNan(static_cast<uint16_t>(h))) {
      ASSERT_EQ(back, h | 0x0040u) << Hex(h);
    } else {
      ASSERT_EQ(back, h) << Hex(h);
    }
  }
}

void ExpectConversionsMatchReference(const std::vector<float>& values, uint64_t seed) {
  for (float f : values) {
    const uint32_t u = FloatBits(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(Fp16IsNan(FloatToFp16(f))) << Hex(u) << " seed=" << seed;
      EXPECT_TRUE(Bf16IsNan(FloatToBf16(f))) << Hex(u) << " seed=" << seed;
      EXPECT_EQ(FloatToFp16(f) & 0x8000, (u >> 16) & 0x8000) << Hex(u);
      continue;
    }
    EXPECT_EQ(FloatToFp16(f), ReferenceFp16(f)) << Hex(u) << " = " << f << " seed=" << seed;
    EXPECT_EQ(FloatToBf16(f), ReferenceBf16(f)) << Hex(u) << " = " << f << " seed=" << seed;
  }
}

TEST(DTypeTest, EdgeValuesRoundLikeDoubleReference) {
  ExpectConversionsMatchReference(EdgeFloats(), 0);
  // Spot checks spelled out, so a shared mistake of code and reference cannot hide them.
  EXPECT_EQ(FloatToFp16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToFp16(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToFp16(-65520.0f), 0xfc00);
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(FloatToFp16(std::ldexp(3.0f, -25)), 0x0002);
  EXPECT_EQ(FloatToFp16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToFp16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(FloatToBf16(BitsToFloat(0x7f7f8000)), 0x7f80);  // tie above max -> inf
  EXPECT_EQ(FloatToBf16(BitsToFloat(0x7f7e8000)), 0x7f7e);  // tie -> even
  EXPECT_EQ(FloatToBf16(BitsToFloat(0x00018000)), 0x0002);  // subnormal tie -> even
  EXPECT_EQ(FloatToBf16(BitsToFloat(0x00008000)), 0x0000);
  EXPECT_EQ(FloatToBf16(BitsToFloat(0x7f800001)), 0x7fc0);  // sNaN -> qNaN
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
}

TEST(DTypeTest, RandomValuesRoundLikeDoubleReference) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed=" << seed);
  ExpectConversionsMatchReference(RandomFloats(seed, 1 << 20), seed);
}

// The SIMD paths' conversions (the ones the kernel's out16 and grad loads use) against dtype.h.
class SimdConversionTest : public testing::TestWithParam<SimdPath> {
 protected:
  void SetUp() override {
    if (!SimdPathSupported(GetParam())) {
      GTEST_SKIP() << "this CPU does not support " << SimdPathName(GetParam());
    }
  }
};

TEST_P(SimdConversionTest, FloatToHalfMatchesDtypeBitForBit) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed=" << seed);
  std::vector<float> values = EdgeFloats();
  const std::vector<float> random = RandomFloats(seed, 1 << 20);
  values.insert(values.end(), random.begin(), random.end());
  // A sweep over all bit patterns with an odd stride touches every exponent and sign.
  for (uint64_t u = 0; u <= 0xffffffffu; u += 0x1003) values.push_back(BitsToFloat(u));
  const internal::FloatToHalfFn convert = internal::GetFloatToHalf(GetParam());
  ASSERT_NE(convert, nullptr);
  for (DType dtype : {DType::kFp16, DType::kBf16}) {
    std::vector<uint16_t> half(values.size());
    // Odd length and an offset pointer: the vector body, the tail and unaligned access.
    convert(values.data() + 1, dtype, half.data() + 1, static_cast<int64_t>(values.size()) - 1);
    for (size_t i = 1; i < values.size(); ++i) {
      const uint16_t expected =
          dtype == DType::kFp16 ? FloatToFp16(values[i]) : FloatToBf16(values[i]);
      ASSERT_EQ(half[i], expected) << DTypeName(dtype) << " of " << Hex(FloatBits(values[i]));
    }
  }
}

TEST_P(SimdConversionTest, HalfToFloatMatchesDtypeForAllValues) {
  const internal::HalfToFloatFn convert = internal::GetHalfToFloat(GetParam());
  ASSERT_NE(convert, nullptr);
  std::vector<uint16_t> all(65536 + 1);
  for (uint32_t h = 0; h <= 0xffff; ++h) all[h + 1] = static_cast<uint16_t>(h);
  for (DType dtype : {DType::kFp16, DType::kBf16}) {
    std::vector<float> out(all.size());
    convert(all.data() + 1, dtype, out.data() + 1, 65536);
    for (uint32_t h = 0; h <= 0xffff; ++h) {
      const float expected = dtype == DType::kFp16 ? Fp16ToFloat(h) : Bf16ToFloat(h);
      if (std::isnan(expected)) {
        // F16C quiets signalling NaNs where dtype.h keeps the bits: both are NaN with the same
        // sign, and the next arithmetic operation quiets dtype.h's anyway.
        ASSERT_TRUE(std::isnan(out[h + 1])) << Hex(h);
        ASSERT_EQ(std::signbit(out[h + 1]), std::signbit(expected)) << Hex(h);
      } else {
        ASSERT_EQ(FloatBits(out[h + 1]), FloatBits(expected)) << DTypeName(dtype) << " " << Hex(h);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, SimdConversionTest,
                         testing::Values(SimdPath::kAvx2, SimdPath::kAvx512),
                         [](const testing::TestParamInfo<SimdPath>& info) {
                           return std::string(SimdPathName(info.param));
                         });

}  // namespace
}  // namespace offload
