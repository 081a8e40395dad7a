// Fused Adam / AdamW over fp32 master weights and moments, per ARCHITECTURE.md section 5.
//
// One call updates one contiguous span: it reads the gradient (fp32, fp16 or bf16), scales it by
// grad_multiplier, updates (param, exp_avg, exp_avg_sq) in place and writes the 16-bit copy of the
// updated weights in the same pass, so every byte crosses the memory bus once.
//
// Three implementations share this signature: a scalar reference (adam_scalar.cc), and an AVX2+F16C
// and an AVX-512 path instantiated from one template (adam_simd.h). The path is chosen at run time
// from CPU features; a setting can force any path the CPU supports.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_ADAM_ADAM_KERNEL_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_ADAM_ADAM_KERNEL_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/dtype.h"

namespace offload {

// Which torch's single-tensor Adam/AdamW the kernels reproduce (ARCHITECTURE.md section 5). The
// forms differ in how exp_avg moves and how bias_correction2_sqrt is computed; the values match
// proto AdamForm and OffloadConfig.adam_form.
enum class AdamForm : int32_t {
  kTorch113 = 0,  // exp_avg.mul_(b1).add_(grad, alpha=1-b1); math.sqrt(bias_correction2)
  kLerp = 1,      // torch 2.x: exp_avg.lerp_(grad, 1-b1); bias_correction2 ** 0.5
};

// Hyper-parameters that stay fixed for a job (lr may change per step via the commit). Doubles,
// like torch's Python floats: each per-step scalar is computed from them in double and rounded
// to fp32 once, as torch does, so hyper-parameters need not be exact in fp32.
struct AdamHyperParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adamw = true;  // decoupled weight decay (torch.optim.AdamW); false: L2 (Adam)
  bool bias_correction = true;
  AdamForm form = AdamForm::kTorch113;
};

// Per-step constants, computed once per step in double precision the way torch does
// (Python floats), then rounded to fp32 for the kernels.
struct AdamStepScalars {
  float grad_multiplier;  // g = grad * grad_multiplier
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float eps;
  float l2_weight_decay;        // Adam: g += l2_weight_decay * p (0 for AdamW)
  float decoupled_decay;        // AdamW: p *= decoupled_decay (= 1 - lr * wd; 1 for Adam)
  float step_size;              // lr / (1 - beta1^t), or lr without bias correction
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t), or 1 without bias correction
  AdamForm form;                // how exp_avg moves (see AdamForm)
};

// `t` is the 1-based count of applied updates (skipped steps do not count).
AdamStepScalars ComputeAdamStepScalars(const AdamHyperParams& hp, double lr, int64_t t,
                                       float grad_multiplier);

// One contiguous span of n elements. All pointers may be unaligned.
struct AdamSpan {
  const void* grad = nullptr;  // (n,) in grad_dtype
  DType grad_dtype = DType::kFp32;
  float* param = nullptr;          // (n,) fp32 master weights, updated in place
  float* exp_avg = nullptr;        // (n,) first moment
  float* exp_avg_sq = nullptr;     // (n,) second moment
  void* out = nullptr;             // (n,) 16-bit copy of the updated param in out_dtype, or nullptr
  DType out_dtype = DType::kFp16;  // kFp16 or kBf16
  int64_t n = 0;
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
