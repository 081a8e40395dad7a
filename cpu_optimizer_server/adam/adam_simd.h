// The fused Adam pass and its memory roofline as one template over a vector-traits struct, in
// the manner of DeepSpeed's cpu_adam: adam_avx2.cc and adam_avx512.cc instantiate it with their
// instruction set's traits. Include this header only from those files.
//
// A traits struct T provides:
//   using V;                          // a vector of T::kWidth floats
//   static constexpr int kWidth;
//   Set1, Load, Store (unaligned fp32), LoadFp16, LoadBf16 (16-bit -> fp32, exact),
//   StoreFp16, StoreBf16 (fp32 -> 16-bit, round to nearest even, +-inf on overflow, NaN stays a
//   quiet NaN with the top payload bits, subnormals kept: bit-identical to dtype.h),
//   StoreHigh16 (the upper 16 bits of each fp32, for the roofline), Stream (a non-temporal store
//   to 64-byte aligned fp32) and Fence (orders the streamed stores before later ones),
//   Add, Sub, Mul, Div, Sqrt (correctly rounded IEEE operations), Fma(a, b, c) = a * b + c rounded
//   once;
//   using VI (a vector of kWidth uint32), RandomBits(key, element) (StochasticRoundingBits of
//   elements element .. element + kWidth - 1), High16 (each lane >> 16) and StoreBf16Stochastic
//   (FloatToBf16Stochastic with each lane's low 16 bits), all bit-identical to adam_kernel.h.
//
// Every function here is a template on T, and each instruction set's T lives in an unnamed
// namespace of its .cc file, so every instantiation has internal linkage. That matters: code
// compiled with -mavx512f must never be emitted as a shared inline symbol that the linker could
// pick for a caller on a CPU without those instructions. For the same reason the ISA files call
// nothing inline from shared headers (dtype.h's scalar conversions included).
//
// Performance notes (measured with bench_adam on the 2-core AVX-512 dev machine, 64M params):
// - The pass is memory-bound: in L1 the AVX-512 kernel runs at ~4-6 Gparam/s per core, the
//   memory pass at ~2 Gparam/s per core, and the kernel reaches 0.97-1.06 of the roofline at 1
//   and 2 threads. The divisions and square root of 4 independent vectors per iteration overlap
//   in the out-of-order window; no loop-carried dependency exists, so no further unrolling or
//   software prefetching is needed (the hardware prefetchers follow the 5 sequential streams).
//   AVX2 reaches 0.97-1.01 with fp16 and 0.88-0.92 with bf16: 8 lanes of two divisions and a
//   square root plus the integer bf16 rounding run at ~2 Gparam/s per core even in L1, about the
//   memory rate, so there it is close to compute-bound.
// - Ordinary stores, not non-temporal ones. Streaming the 16-bit copy made both the kernel and
//   the roofline ~3% (1 thread) to ~12% (2 threads) faster in the bench, where nothing reads the
//   copy. But the server streams each tile back as soon as it is written: per-tile kernel +
//   memcpy of the tile's copy ran at 1.77 Gparam/s with ordinary stores and 1.55 with streaming
//   ones (1 thread), because the read then misses all caches. Streaming p, m and v as well gained
//   nothing over streaming the copy alone. The exception is an update written elsewhere without
//   a copy (an update during backward into the staging copy, AdamSpanOut): its destination
//   lines were never read, so an ordinary store first reads each of them (12 bytes an element
//   more), and nothing reads them before the commit.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_ADAM_ADAM_SIMD_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_ADAM_ADAM_SIMD_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "base/dtype.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"

namespace offload {
namespace simd {

// What the pass writes as the 16-bit copy of the weights.
enum class Out { kNone, kFp16, kBf16 };

// How the first moment moves: torch 1.13's mul_/add_, or torch 2.x's lerp_ from exp_avg (weight
// < 0.5) or from grad (weight >= 0.5); see adam_scalar.cc.
enum class Moment { kMulAdd, kLerpFromExpAvg, kLerpFromGrad };

// torch's is_lerp_weight_small: |w| < 0.5 (false for NaN). A template, like everything here, so
// that no ISA file emits a shared inline symbol.
template <class T>
inline bool LerpWeightSmall(float w) {
  return w < 0.5f && w > -0.5f;
}

// Per-step constants, broadcast once per call.
template <class T>
struct AdamConsts {
  explicit AdamConsts(const AdamStepScalars& s)
      : grad_multiplier(T::Set1(s.grad_multiplier)),
        beta1(T::Set1(s.beta1)),
        one_minus_beta1(T::Set1(s.one_minus_beta1)),
        beta2(T::Set1(s.beta2)),
        one_minus_beta2(T::Set1(s.one_minus_beta2)),
        eps(T::Set1(s.eps)),
        l2_weight_decay(T::Set1(s.l2_weight_decay)),
        decoupled_decay(T::Set1(s.decoupled_decay)),
        neg_step_size(T::Set1(-s.step_size)),
        bias_correction2_sqrt(T::Set1(s.bias_correction2_sqrt)),
        lerp_coeff(T::Set1(LerpWeightSmall<T>(s.one_minus_beta1) ? s.one_minus_beta1
                                                                 : s.one_minus_beta1 - 1.0f)) {}
  typename T::V grad_multiplier, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
      l2_weight_decay, decoupled_decay, neg_step_size, bias_correction2_sqrt, lerp_coeff;
};

template <class T, DType kGrad>
inline typename T::V LoadGrad(const void* grad, int64_t i) {
  if constexpr (kGrad == DType::kFp32) {
    return T::Load(static_cast<const float*>(grad) + i);
  } else if constexpr (kGrad == DType::kFp16) {
    return T::LoadFp16(static_cast<const uint16_t*>(grad) + i);
  } else {
    return T::LoadBf16(static_cast<const uint16_t*>(grad) + i);
  }
}

template <class T, Out kOut>
inline void StoreOut(void* out, int64_t i, typename T::V p) {
  if constexpr (kOut == Out::kFp16) {
    T::StoreFp16(static_cast<uint16_t*>(out) + i, p);
  } else if constexpr (kOut == Out::kBf16) {
    T::StoreBf16(static_cast<uint16_t*>(out) + i, p);
  }
}

// How the moments are stored (AdamSpan::state_dtype and rounding).
enum class State { kFp32, kBf16Nearest, kBf16Stochastic };

// The element type of the moments' views.
template <State kState>
using MomentT = std::conditional_t<kState == State::kFp32, float, uint16_t>;

template <class T, State kState>
inline typename T::V LoadMoment(const MomentT<kState>* p, int64_t i) {
  if constexpr (kState == State::kFp32) {
    return T::Load(p + i);
  } else {
    return T::LoadBf16(p + i);
  }
}

// Stores both moments of the vector at i; `element` is its first element's flat index (the
// stochastic rounding's random bits, AdamScalar's StochasticRoundingBits per lane).
template <class T, State kState, bool kStream>
inline void StoreMoments(MomentT<kState>* exp_avg, MomentT<kState>* exp_avg_sq, int64_t i,
                         typename T::V m, typename T::V v, uint32_t key, int64_t element) {
  if constexpr (kState == State::kFp32) {
    if constexpr (kStream) {
      T::Stream(exp_avg + i, m);
      T::Stream(exp_avg_sq + i, v);
    } else {
      T::Store(exp_avg + i, m);
      T::Store(exp_avg_sq + i, v);
    }
  } else if constexpr (kState == State::kBf16Nearest) {
    T::StoreBf16(exp_avg + i, m);
    T::StoreBf16(exp_avg_sq + i, v);
  } else {
    const typename T::VI bits = T::RandomBits(key, element);
    T::StoreBf16Stochastic(exp_avg + i, m, bits);
    T::StoreBf16Stochastic(exp_avg_sq + i, v, T::High16(bits));
  }
}

// One vector of the fused update at element i. Same operations, in the same order, as
// AdamScalar (adam_scalar.cc, which explains the order): the result is bit-identical to it.
// kStream: the new state goes out with non-temporal stores (see AdamSpanOut).
template <class T, DType kGrad, Out kOut, bool kL2, Moment kMoment, State kState, bool kStream>
inline void AdamVector(const AdamConsts<T>& c, uint32_t key, const void* grad,
                       const float* param_in, const MomentT<kState>* exp_avg_in,
                       const MomentT<kState>* exp_avg_sq_in, float* param, MomentT<kState>* exp_avg,
                       MomentT<kState>* exp_avg_sq, void* out, int64_t i, int64_t element) {
  using V = typename T::V;
  V p = T::Load(param_in + i);
  V g = T::Mul(LoadGrad<T, kGrad>(grad, i), c.grad_multiplier);
  if constexpr (kL2) g = T::Fma(p, c.l2_weight_decay, g);
  p = T::Mul(p, c.decoupled_decay);
  V m = LoadMoment<T, kState>(exp_avg_in, i);
  if constexpr (kMoment == Moment::kMulAdd) {
    m = T::Fma(g, c.one_minus_beta1, T::Mul(m, c.beta1));
  } else if constexpr (kMoment == Moment::kLerpFromExpAvg) {
    m = T::Fma(c.lerp_coeff, T::Sub(g, m), m);
  } else {
    m = T::Fma(c.lerp_coeff, T::Sub(g, m), g);
  }
  const V v = T::Fma(T::Mul(c.one_minus_beta2, g), g,
                     T::Mul(LoadMoment<T, kState>(exp_avg_sq_in, i), c.beta2));
  const V denom = T::Add(T::Div(T::Sqrt(v), c.bias_correction2_sqrt), c.eps);
  p = T::Add(p, T::Div(T::Mul(c.neg_step_size, m), denom));
  if constexpr (kStream) {
    T::Stream(param + i, p);
  } else {
    T::Store(param + i, p);
  }
  StoreMoments<T, kState, kStream>(exp_avg, exp_avg_sq, i, m, v, key, element);
  StoreOut<T, kOut>(out, i, p);
}

// Same loads and stores as AdamVector, in the same order (all loads, then all stores), with one
// add per stream: the memory roofline of the pass. The order matters: a store to param[i]
// followed by a load of exp_avg[i] (same address bits modulo 4 KiB when the buffers are
// page-aligned) stalls on 4K aliasing, which would make the roofline slower than the kernel.
// bf16 moments are stored as their high halves, the cheapest store of those bytes.
template <class T, DType kGrad, Out kOut, State kState>
inline void RooflineVector(const void* grad, const float* param_in,
                           const MomentT<kState>* exp_avg_in, const MomentT<kState>* exp_avg_sq_in,
                           float* param, MomentT<kState>* exp_avg, MomentT<kState>* exp_avg_sq,
                           void* out, int64_t i) {
  using V = typename T::V;
  const V g = LoadGrad<T, kGrad>(grad, i);
  const V p = T::Add(T::Load(param_in + i), g);
  const V m = T::Add(LoadMoment<T, kState>(exp_avg_in, i), g);
  const V v = T::Add(LoadMoment<T, kState>(exp_avg_sq_in, i), g);
  T::Store(param + i, p);
  if constexpr (kState == State::kFp32) {
    T::Store(exp_avg + i, m);
    T::Store(exp_avg_sq + i, v);
  } else {
    T::StoreHigh16(exp_avg + i, m);
    T::StoreHigh16(exp_avg_sq + i, v);
  }
  if constexpr (kOut != Out::kNone) T::StoreHigh16(static_cast<uint16_t*>(out) + i, p);
}

// Runs body(grad, param_in, exp_avg_in, exp_avg_sq_in, param, exp_avg, exp_avg_sq, out, i,
// element) over a span: kUnroll vectors at a time, then single vectors, then the last n % kWidth
// elements through zero-padded stack copies, so the tail gets exactly the vector arithmetic and any
// n and any alignment work. `element` is the flat index of the vector's first element (i in the
// span, also in the tail, where i indexes the copies). The state is read from the span's *_in
// pointers where they are set (an update written elsewhere), else from where it is written (in
// place).
template <class T, DType kGrad, Out kOut, State kState, int kUnroll, class Body>
inline void ForEachVector(const AdamSpan& span, Body&& body) {
  using M = MomentT<kState>;
  constexpr int W = T::kWidth;
  // Locals, not span.*: the stores through float* could alias the span, which would make the
  // compiler reload every pointer after every store.
  const void* const grad = span.grad;                      // (n,)
  float* const param = span.param;                         // (n,)
  M* const exp_avg = static_cast<M*>(span.exp_avg);        // (n,)
  M* const exp_avg_sq = static_cast<M*>(span.exp_avg_sq);  // (n,)
  const bool in_place = span.param_in == nullptr;
  const float* const param_in = in_place ? param : span.param_in;  // (n,)
  const M* const exp_avg_in = in_place ? exp_avg : static_cast<const M*>(span.exp_avg_in);
  const M* const exp_avg_sq_in = in_place ? exp_avg_sq : static_cast<const M*>(span.exp_avg_sq_in);
  void* const out = span.out;  // (n,) or null
  const int64_t n = span.n;
  const int64_t first = span.first_element;
  int64_t i = 0;
  for (; i + kUnroll * W <= n; i += kUnroll * W) {
    // Independent vectors: their divisions and square roots overlap in the pipeline.
#pragma GCC unroll 8
    for (int u = 0; u < kUnroll; ++u) {
      body(grad, param_in, exp_avg_in, exp_avg_sq_in, param, exp_avg, exp_avg_sq, out, i + u * W,
           first + i + u * W);
    }
  }
  for (; i + W <= n; i += W) {
    body(grad, param_in, exp_avg_in, exp_avg_sq_in, param, exp_avg, exp_avg_sq, out, i, first + i);
  }
  const int64_t rest = n - i;
  if (rest == 0) return;
  constexpr int kGradBytes = kGrad == DType::kFp32 ? 4 : 2;
  alignas(64) unsigned char grad_buf[W * 4] = {};
  alignas(64) float param_buf[W] = {};
  alignas(64) M exp_avg_buf[W] = {};
  alignas(64) M exp_avg_sq_buf[W] = {};
  alignas(64) uint16_t out_buf[W] = {};
  std::memcpy(grad_buf, static_cast<const unsigned char*>(grad) + i * kGradBytes,
              rest * kGradBytes);
  std::memcpy(param_buf, param_in + i, rest * sizeof(float));
  std::memcpy(exp_avg_buf, exp_avg_in + i, rest * sizeof(M));
  std::memcpy(exp_avg_sq_buf, exp_avg_sq_in + i, rest * sizeof(M));
  body(grad_buf, param_buf, exp_avg_buf, exp_avg_sq_buf, param_buf, exp_avg_buf, exp_avg_sq_buf,
       out_buf, 0, first + i);
  std::memcpy(param + i, param_buf, rest * sizeof(float));
  std::memcpy(exp_avg + i, exp_avg_buf, rest * sizeof(M));
  std::memcpy(exp_avg_sq + i, exp_avg_sq_buf, rest * sizeof(M));
  if constexpr (kOut != Out::kNone) {
    std::memcpy(static_cast<uint16_t*>(out) + i, out_buf, rest * sizeof(uint16_t));
  }
}

template <class T, DType kGrad, Out kOut, bool kL2, Moment kMoment, State kState, bool kStream>
void AdamSpanTyped(const AdamStepScalars& s, const AdamSpan& span) {
  using M = MomentT<kState>;
  const AdamConsts<T> c(s);
  const uint32_t key = span.rounding_key;
  ForEachVector<T, kGrad, kOut, kState, T::kUnroll>(
      span, [&c, key](const void* grad, const float* param_in, const M* exp_avg_in,
                      const M* exp_avg_sq_in, float* param, M* exp_avg, M* exp_avg_sq, void* out,
                      int64_t i, int64_t element) {
        AdamVector<T, kGrad, kOut, kL2, kMoment, kState, kStream>(
            c, key, grad, param_in, exp_avg_in, exp_avg_sq_in, param, exp_avg, exp_avg_sq, out, i,
            element);
      });
}

// The moments' storage, once per call. Streaming stores are for fp32 moments only (see
// AdamSpanOut).
template <class T, DType kGrad, Out kOut, bool kL2, Moment kMoment, bool kStream>
void AdamSpanState(const AdamStepScalars& s, const AdamSpan& span) {
  if constexpr (kStream) {
    AdamSpanTyped<T, kGrad, kOut, kL2, kMoment, State::kFp32, true>(s, span);
  } else if (span.state_dtype != DType::kBf16) {
    AdamSpanTyped<T, kGrad, kOut, kL2, kMoment, State::kFp32, false>(s, span);
  } else if (span.rounding == StateRounding::kNearest) {
    AdamSpanTyped<T, kGrad, kOut, kL2, kMoment, State::kBf16Nearest, false>(s, span);
  } else {
    AdamSpanTyped<T, kGrad, kOut, kL2, kMoment, State::kBf16Stochastic, false>(s, span);
  }
}

// The form, and for lerp which branch of torch's lerp, once per call: the weight is per step.
template <class T, DType kGrad, Out kOut, bool kL2, bool kStream>
void AdamSpanMoment(const AdamStepScalars& s, const AdamSpan& span) {
  if (s.form != AdamForm::kLerp) {
    AdamSpanState<T, kGrad, kOut, kL2, Moment::kMulAdd, kStream>(s, span);
  } else if (LerpWeightSmall<T>(s.one_minus_beta1)) {
    AdamSpanState<T, kGrad, kOut, kL2, Moment::kLerpFromExpAvg, kStream>(s, span);
  } else {
    AdamSpanState<T, kGrad, kOut, kL2, Moment::kLerpFromGrad, kStream>(s, span);
  }
}

template <class T, DType kGrad, Out kOut, State kState>
void RooflineSpanTyped(const AdamSpan& span) {
  using M = MomentT<kState>;
  ForEachVector<T, kGrad, kOut, kState, T::kUnroll>(
      span, [](const void* grad, const float* param_in, const M* exp_avg_in, const M* exp_avg_sq_in,
               float* param, M* exp_avg, M* exp_avg_sq, void* out, int64_t i, int64_t /*element*/) {
        RooflineVector<T, kGrad, kOut, kState>(grad, param_in, exp_avg_in, exp_avg_sq_in, param,
                                               exp_avg, exp_avg_sq, out, i);
      });
}

template <class T, DType kGrad, Out kOut>
void RooflineSpanState(const AdamSpan& span) {
  if (span.state_dtype == DType::kBf16) {
    RooflineSpanTyped<T, kGrad, kOut, State::kBf16Nearest>(span);
  } else {
    RooflineSpanTyped<T, kGrad, kOut, State::kFp32>(span);
  }
}

template <class T>
inline Out OutKind(const AdamSpan& span) {
  if (span.out == nullptr) return Out::kNone;
  return span.out_dtype == DType::kBf16 ? Out::kBf16 : Out::kFp16;
}

// Turns the span's run-time dtypes into template arguments once per call.
template <class T, DType kGrad, Out kOut, bool kStream = false>
void AdamSpanL2(const AdamStepScalars& s, const AdamSpan& span) {
  // torch adds the L2 term only when weight_decay != 0 (see adam_scalar.cc).
  if (s.l2_weight_decay != 0.0f) {
    AdamSpanMoment<T, kGrad, kOut, true, kStream>(s, span);
  } else {
    AdamSpanMoment<T, kGrad, kOut, false, kStream>(s, span);
  }
}

template <class T>
inline bool Aligned64(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 63) == 0;
}

template <class T, DType kGrad>
void AdamSpanOut(const AdamStepScalars& s, const AdamSpan& span) {
  switch (OutKind<T>(span)) {
    case Out::kNone:
      // An update written elsewhere without a 16-bit copy is an update during backward into
      // the staging copy, which nothing reads before the commit: non-temporal stores spare the
      // read of each destination line an ordinary store makes first (12 of the pass's 38 bytes
      // an element). Where every destination is 64-byte aligned (tiles are; a cut at a group
      // boundary may not be), so that every vector store fills whole lines.
      if (span.param_in != nullptr && span.state_dtype == DType::kFp32 &&
          Aligned64<T>(span.param) && Aligned64<T>(span.exp_avg) && Aligned64<T>(span.exp_avg_sq)) {
        AdamSpanL2<T, kGrad, Out::kNone, true>(s, span);
        T::Fence();  // the commit, on another thread, reads these lines
        return;
      }
      return AdamSpanL2<T, kGrad, Out::kNone>(s, span);
    case Out::kFp16:
      return AdamSpanL2<T, kGrad, Out::kFp16>(s, span);
    case Out::kBf16:
      return AdamSpanL2<T, kGrad, Out::kBf16>(s, span);
  }
}

template <class T>
void AdamSpanAny(const AdamStepScalars& s, const AdamSpan& span) {
  switch (span.grad_dtype) {
    case DType::kFp32:
      return AdamSpanOut<T, DType::kFp32>(s, span);
    case DType::kFp16:
      return AdamSpanOut<T, DType::kFp16>(s, span);
    case DType::kBf16:
      return AdamSpanOut<T, DType::kBf16>(s, span);
  }
}

template <class T, DType kGrad>
void RooflineSpanOut(const AdamSpan& span) {
  switch (OutKind<T>(span)) {
    case Out::kNone:
      return RooflineSpanState<T, kGrad, Out::kNone>(span);
    case Out::kFp16:
      return RooflineSpanState<T, kGrad, Out::kFp16>(span);
    case Out::kBf16:
      return RooflineSpanState<T, kGrad, Out::kBf16>(span);
  }
}

template <class T>
void RooflineSpanAny(const AdamSpan& span) {
  switch (span.grad_dtype) {
    case DType::kFp32:
      return RooflineSpanOut<T, DType::kFp32>(span);
    case DType::kFp16:
      return RooflineSpanOut<T, DType::kFp16>(span);
    case DType::kBf16:
      return RooflineSpanOut<T, DType::kBf16>(span);
  }
}

// The conversions alone: the 16-bit copy of weights that Adam did not just write (a replayed
// step, a read of the state as 16 bits), and the tests (adam_kernel_internal.h).
template <class T, Out kOut>
void FloatToHalfTyped(const float* in, uint16_t* half, int64_t n) {
  constexpr int W = T::kWidth;
  int64_t i = 0;
  for (; i + W <= n; i += W) StoreOut<T, kOut>(half, i, T::Load(in + i));
  if (i == n) return;
  alignas(64) float in_buf[W] = {};
  alignas(64) uint16_t half_buf[W] = {};
  std::memcpy(in_buf, in + i, (n - i) * sizeof(float));
  StoreOut<T, kOut>(half_buf, 0, T::Load(in_buf));
  std::memcpy(half + i, half_buf, (n - i) * sizeof(uint16_t));
}

template <class T>
void FloatToHalfAny(const float* in, DType dtype, uint16_t* half, int64_t n) {
  if (dtype == DType::kBf16) {
    FloatToHalfTyped<T, Out::kBf16>(in, half, n);
  } else {
    FloatToHalfTyped<T, Out::kFp16>(in, half, n);
  }
}

template <class T>
void HalfToFloatAny(const uint16_t* half, DType dtype, float* out, int64_t n) {
  constexpr int W = T::kWidth;
  int64_t i = 0;
  alignas(64) uint16_t half_buf[W] = {};
  alignas(64) float out_buf[W] = {};
  for (; i < n; i += W) {
    const int64_t k = n - i < W ? n - i : W;
    std::memcpy(half_buf, half + i, k * sizeof(uint16_t));
    T::Store(out_buf, dtype == DType::kBf16 ? T::LoadBf16(half_buf) : T::LoadFp16(half_buf));
    std::memcpy(out + i, out_buf, k * sizeof(float));
  }
}

}  // namespace simd
}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_ADAM_ADAM_SIMD_H_
