#include "optimizer_client/precision/step_policy.h"

#include <cmath>

namespace offload {

StepPolicy::StepPolicy(const StepPolicyOptions& options)
    : options_(options), scaler_(options.loss_scaler, options.loss_scaling) {}

StepDecision StepPolicy::Decide(const GradStats& global, float max_grad_norm) const {
  StepDecision d;
  d.loss_scale = scaler_.scale();
  d.skip = global.nonfinite;
  const float micro = static_cast<float>(options_.micro_batches);
  // The shards sum the micro-batches' gradients; the step's gradient is their mean.
  d.grad_norm = std::sqrt(global.sum_squares) / (d.loss_scale * micro);
  const float clip = max_grad_norm >= 0 ? max_grad_norm : options_.grad_clip;
  // No clipping on a step the shards skip: its norm is inf or NaN.
  d.clip_coef = d.skip ? 1.0f : ClipCoefficient(d.grad_norm, clip);
  // No 1/W: the ranks averaged before rounding.
  d.grad_multiplier = d.clip_coef / (d.loss_scale * micro);
  return d;
}

}  // namespace offload
