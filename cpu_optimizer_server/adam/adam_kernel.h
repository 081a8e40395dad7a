// Fused Adam / AdamW over fp32 master weights and moments, per ARCHITECTURE.md section 5.
//
// One call updates one contiguous span: it reads the gradient (fp32, fp16 or bf16), scales it by
// grad_multiplier, updates (param, exp_avg, exp_avg_sq) in place and writes the 16-bit copy of the
// updated weights in the same pass, so every byte crosses the memory bus once.
//
// Three implementations share this signature: a scalar reference (adam_scalar.cc), and an AVX2+F16C
// and an AVX-512 path instantiated from one template (adam_simd.h). The path is chosen at run time
// from CPU features; a setting can force any path the CPU supports. The hyper-parameters and the
// per-step scalars are base/adam/adam_math.h's, which the GPU optimizer shares.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_ADAM_ADAM_KERNEL_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_ADAM_ADAM_KERNEL_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/adam/adam_math.h"  // IWYU pragma: export (AdamHyperParams, AdamStepScalars)
#include "base/dtype.h"

namespace offload {

// How the moments are rounded when they are stored in bf16 (AdamSpan::state_dtype). Nearest
// even is deterministic but loses the updates smaller than half a bf16 ulp: with beta2 = 0.999,
// exp_avg_sq * beta2 rounds back to exp_avg_sq, so the second moment never decays. Stochastic
// rounding rounds up with probability (dropped bits) / ulp, so the moment is right in expectation.
// Its random bits are a hash of (the step's key, the element's index in the job's flat space): the
// same bits on every run, every SIMD path and however the span is cut, so a step replays, and a
// resumed run matches an uninterrupted one, bit for bit.
enum class StateRounding { kStochastic = 0, kNearest = 1 };

// The key of step t's stochastic rounding (any t; 1-based in use).
uint32_t StochasticRoundingKey(uint64_t t);

// The random bits of element `element` under `key`: the low 16 round exp_avg, the high 16
// exp_avg_sq (murmur3's 32-bit finalizer of the element's low 32 bits xor the key; the pattern
// repeats every 2^32 elements, which correlates nothing a step computes).
inline uint32_t StochasticRoundingBits(uint32_t key, int64_t element) {
  uint32_t x = static_cast<uint32_t>(element) ^ key;
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  x ^= x >> 16;
  return x;
}

// fp32 -> bf16 rounding up with probability (the 16 dropped bits) / 2^16, given 16 random bits:
// add them to the bits and keep the high half. A NaN rounds as FloatToBf16 does (a quiet NaN with
// its payload) rather than carry into the exponent or the sign; an inf stays inf.
inline uint16_t FloatToBf16Stochastic(float f, uint32_t random16) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return FloatToBf16(f);
  return static_cast<uint16_t>((u + (random16 & 0xffffu)) >> 16);
}

// One contiguous span of n elements. All pointers may be unaligned.
struct AdamSpan {
  const void* grad = nullptr;  // (n,) in grad_dtype
  DType grad_dtype = DType::kFp32;
  float* param = nullptr;          // (n,) fp32 master weights, updated (see param_in)
  void* exp_avg = nullptr;         // (n,) first moment in state_dtype
  void* exp_avg_sq = nullptr;      // (n,) second moment in state_dtype
  void* out = nullptr;             // (n,) 16-bit copy of the updated param in out_dtype, or nullptr
  DType out_dtype = DType::kFp16;  // kFp16 or kBf16
  int64_t n = 0;
  // Where the state is read from when it is not param, exp_avg and exp_avg_sq themselves: all
  // three null (in place) or all three set. An update during backward writes the new state into
  // the range's staging copy and leaves the state it read untouched, so undoing it costs nothing.
  const float* param_in = nullptr;      // (n,)
  const void* exp_avg_in = nullptr;     // (n,) in state_dtype
  const void* exp_avg_sq_in = nullptr;  // (n,) in state_dtype
  // The moments' storage: kFp32, or kBf16 (read exactly, computed in fp32, stored rounded as
  // `rounding` says). The master weights are fp32 either way.
  DType state_dtype = DType::kFp32;
  StateRounding rounding = StateRounding::kStochastic;
  uint32_t rounding_key = 0;  // StochasticRoundingKey(t) of the step
  int64_t first_element = 0;  // the flat index of element 0, for the random bits
};

using AdamKernelFn = void (*)(const AdamStepScalars& s, const AdamSpan& span);

// The memory roofline of the fused pass: exactly the loads and stores of the Adam kernel
// (read grad, param, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq, out; the moments in
// the span's state_dtype) with trivial
// arithmetic. Benchmarks run it beside the real kernel to report the ratio.
using RooflineKernelFn = void (*)(const AdamSpan& span);

enum class SimdPath { kScalar, kAvx2, kAvx512 };

absl::string_view SimdPathName(SimdPath path);
// "auto" picks the best the CPU supports; "scalar", "avx2", "avx512" force a path and fail with
// FAILED_PRECONDITION when the CPU lacks the instructions.
absl::StatusOr<SimdPath> ParseSimdPath(absl::string_view name);
bool SimdPathSupported(SimdPath path);
SimdPath BestSimdPath();

AdamKernelFn GetAdamKernel(SimdPath path);
RooflineKernelFn GetRooflineKernel(SimdPath path);

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_ADAM_ADAM_KERNEL_H_
