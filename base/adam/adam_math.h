// Adam / AdamW's hyper-parameters and the scalars one step computes from them (ARCHITECTURE.md
// section 5): what every implementation of the update shares, the CPU shards' fused kernels
// (cpu_optimizer_server/adam/adam_kernel.h) and the GPU-resident optimizer of the no-offload
// baseline (gpu_trainer/cuda/optim/). Both take their per-step constants from
// ComputeAdamStepScalars, so they start every step from the same bits.
#ifndef OFFLOAD_BASE_ADAM_ADAM_MATH_H_
#define OFFLOAD_BASE_ADAM_ADAM_MATH_H_

#include <cstdint>

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

}  // namespace offload

#endif  // OFFLOAD_BASE_ADAM_ADAM_MATH_H_
