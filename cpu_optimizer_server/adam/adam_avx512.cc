// AVX-512 instantiation of the Adam template (16 fp32 lanes). Compiled with
// -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c: reached only through the dispatcher,
// after SimdPathSupported(kAvx512).
#include <immintrin.h>

#include <cstdint>

#include "cpu_optimizer_server/adam/adam_kernel_internal.h"
#include "cpu_optimizer_server/adam/adam_simd.h"

namespace offload {
namespace internal {
namespace {

struct Avx512Traits {
  using V = __m512;
  static constexpr int kWidth = 16;
  static constexpr int kUnroll = 4;

  static V Set1(float x) { return _mm512_set1_ps(x); }
  static V Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static void Stream(float* p, V x) { _mm512_stream_ps(p, x); }  // p 64-byte aligned
  static void Fence() { _mm_sfence(); }

  static V LoadFp16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V LoadBf16(const uint16_t* p) {
    const __m512i h =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
  }
  // F16C rounds to nearest even, saturates to inf and keeps subnormals: IEEE, like dtype.h.
  static void StoreFp16(uint16_t* p, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // Integer round-to-nearest-even, as dtype.h's FloatToBf16. Not vcvtneps2bf16: it flushes
  // subnormals to zero.
  static void StoreBf16(uint16_t* p, V x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));  // quiet NaN, same payload
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static void StoreHigh16(uint16_t* p, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
  }

  using VI = __m512i;
  // murmur3's finalizer of (element + lane) xor key in each lane, as StochasticRoundingBits.
  static VI RandomBits(uint32_t key, int64_t element) {
    __m512i x =
        _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(element)),
                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    x = _mm512_xor_si512(x, _mm512_set1_epi32(static_cast<int32_t>(key)));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int32_t>(0x85ebca6bu)));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int32_t>(0xc2b2ae35u)));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  }
  static VI High16(VI x) { return _mm512_srli_epi32(x, 16); }
  // As FloatToBf16Stochastic: add the lane's low 16 random bits, keep the high half; a NaN as
  // StoreBf16.
  static void StoreBf16Stochastic(uint16_t* p, V x, VI random) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i add = _mm512_and_si512(random, _mm512_set1_epi32(0xffff));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, add), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }

  static V Add(V a, V b) { return _mm512_add_ps(a, b); }
  static V Sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V Div(V a, V b) { return _mm512_div_ps(a, b); }
  static V Sqrt(V a) { return _mm512_sqrt_ps(a); }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
};

}  // namespace

void AdamAvx512(const AdamStepScalars& s, const AdamSpan& span) {
  simd::AdamSpanAny<Avx512Traits>(s, span);
}

void RooflineAvx512(const AdamSpan& span) { simd::RooflineSpanAny<Avx512Traits>(span); }

void FloatToHalfAvx512(const float* in, DType dtype, uint16_t* half, int64_t n) {
  simd::FloatToHalfAny<Avx512Traits>(in, dtype, half, n);
}

void HalfToFloatAvx512(const uint16_t* half, DType dtype, float* out, int64_t n) {
  simd::HalfToFloatAny<Avx512Traits>(half, dtype, out, n);
}

}  // namespace internal
}  // namespace offload
