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

// One contiguous span of n elements. All pointers may be unaligned.
struct AdamSpan {
  const void* grad = nullptr;  // (n,) in grad_dtype
  DType grad_dtype = DType::kFp32;
  float* param = nullptr;          // (n,) fp32 master weights, updated (see param_in)
  float* exp_avg = nullptr;        // (n,) first moment
  float* exp_avg_sq = nullptr;     // (n,) second moment
  void* out = nullptr;             // (n,) 16-bit copy of the updated param in out_dtype, or nullptr
  DType out_dtype = DType::kFp16;  // kFp16 or kBf16
  int64_t n = 0;
  // Where the state is read from when it is not param, exp_avg and exp_avg_sq themselves: all
  // three null (in place) or all three set. An update during backward writes the new state into
  // the range's staging copy and leaves the state it read untouched, so undoing it costs nothing.
  const float* param_in = nullptr;       // (n,)
  const float* exp_avg_in = nullptr;     // (n,)
  const float* exp_avg_sq_in = nullptr;  // (n,)
};

using AdamKernelFn = void (*)(const AdamStepScalars& s, const AdamSpan& span);

// The memory roofline of the fused pass: exactly the loads and stores of the Adam kernel
// (read grad, param, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq, out) with trivial
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
