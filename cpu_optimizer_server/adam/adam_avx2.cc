// AVX2 + FMA + F16C instantiation of the Adam template (8 fp32 lanes). Compiled with
// -mavx2 -mfma -mf16c: reached only through the dispatcher, after SimdPathSupported(kAvx2).
#include <immintrin.h>

#include <cstdint>

#include "cpu_optimizer_server/adam/adam_kernel_internal.h"
#include "cpu_optimizer_server/adam/adam_simd.h"

namespace offload {
namespace internal {
namespace {

struct Avx2Traits {
  using V = __m256;
  static constexpr int kWidth = 8;
  static constexpr int kUnroll = 4;

  static V Set1(float x) { return _mm256_set1_ps(x); }
  static V Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static void Stream(float* p, V x) { _mm256_stream_ps(p, x); }  // p 64-byte aligned
  static void Fence() { _mm_sfence(); }

  static V LoadFp16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V LoadBf16(const uint16_t* p) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  }
  // The high 16 bits of each of 8 x u32 -> 8 x u16: a byte shuffle within each 128-bit lane,
  // then a cross-lane permute puts the two lanes' results next to each other.
  static __m128i PackHigh16(__m256i x) {
    const __m256i pick =
        _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7, 10,
                         11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(x, pick), 0x08));
  }
  // F16C rounds to nearest even, saturates to inf and keeps subnormals: IEEE, like dtype.h.
  static void StoreFp16(uint16_t* p, V x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // Integer round-to-nearest-even, as dtype.h's FloatToBf16: add 0x7fff plus the lowest kept bit,
  // keep the high half. A NaN instead keeps its high half with the quiet bit set.
  static void StoreBf16(uint16_t* p, V x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
    r = _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), PackHigh16(r));
  }
  static void StoreHigh16(uint16_t* p, V x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), PackHigh16(_mm256_castps_si256(x)));
  }

  using VI = __m256i;
  // murmur3's finalizer of (element + lane) xor key in each lane, as StochasticRoundingBits.
  static VI RandomBits(uint32_t key, int64_t element) {
    __m256i x = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(element)),
                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    x = _mm256_xor_si256(x, _mm256_set1_epi32(static_cast<int32_t>(key)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0x85ebca6bu)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 13));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0xc2b2ae35u)));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  }
  static VI High16(VI x) { return _mm256_srli_epi32(x, 16); }
  // As FloatToBf16Stochastic: add the lane's low 16 random bits, keep the high half; a NaN as
  // StoreBf16.
  static void StoreBf16Stochastic(uint16_t* p, V x, VI random) {
    const __m256i u = _mm256_castps_si256(x);
    __m256i r = _mm256_add_epi32(u, _mm256_and_si256(random, _mm256_set1_epi32(0xffff)));
    const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
    r = _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), PackHigh16(r));
  }

  static V Add(V a, V b) { return _mm256_add_ps(a, b); }
  static V Sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V Div(V a, V b) { return _mm256_div_ps(a, b); }
  static V Sqrt(V a) { return _mm256_sqrt_ps(a); }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
};

}  // namespace

void AdamAvx2(const AdamStepScalars& s, const AdamSpan& span) {
  simd::AdamSpanAny<Avx2Traits>(s, span);
}

void RooflineAvx2(const AdamSpan& span) { simd::RooflineSpanAny<Avx2Traits>(span); }

void FloatToHalfAvx2(const float* in, DType dtype, uint16_t* half, int64_t n) {
  simd::FloatToHalfAny<Avx2Traits>(in, dtype, half, n);
}

void HalfToFloatAvx2(const uint16_t* half, DType dtype, float* out, int64_t n) {
  simd::HalfToFloatAny<Avx2Traits>(half, dtype, out, n);
}

}  // namespace internal
}  // namespace offload
