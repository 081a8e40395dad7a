#include "base/adam/adam_math.h"

#include <cmath>

namespace offload {

AdamStepScalars ComputeAdamStepScalars(const AdamHyperParams& hp, double lr, int64_t t,
                                       float grad_multiplier) {
  // torch.optim computes these with Python floats (double) from the hyper-parameters and hands
  // each to a tensor op, which rounds it to fp32 once. Doing the same from the same doubles makes
  // every scalar bit-identical to torch's, whether or not the hyper-parameters are exact in fp32.
  const double beta1 = hp.beta1;
  const double beta2 = hp.beta2;
  const double wd = hp.weight_decay;
  AdamStepScalars s;
  s.grad_multiplier = grad_multiplier;
  s.form = hp.form;
  s.beta1 = static_cast<float>(beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = static_cast<float>(hp.eps);
  if (hp.adamw) {
    s.l2_weight_decay = 0.0f;
    s.decoupled_decay = static_cast<float>(1.0 - lr * wd);
  } else {
    s.l2_weight_decay = static_cast<float>(wd);
    s.decoupled_decay = 1.0f;
  }
  if (hp.bias_correction) {
    // t >= 1; Python's float ** float is C pow() (step is step_t.item(), a float), so std::pow
    // gives the same double.
    const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(t));
    const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(t));
    s.step_size = static_cast<float>(lr / bias_correction1);
    // torch 1.13 takes math.sqrt(bias_correction2); 2.x writes bias_correction2 ** 0.5, which is
    // pow(x, 0.5): not guaranteed to be the correctly rounded sqrt, so each form does its own.
    s.bias_correction2_sqrt = static_cast<float>(
        hp.form == AdamForm::kLerp ? std::pow(bias_correction2, 0.5) : std::sqrt(bias_correction2));
  } else {
    s.step_size = static_cast<float>(lr);
    s.bias_correction2_sqrt = 1.0f;
  }
  return s;
}

}  // namespace offload
