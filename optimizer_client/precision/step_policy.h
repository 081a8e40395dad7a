// What a step does with its gradients once they are all out (ARCHITECTURE.md section 1): skip it
// on overflow, clip by the global norm, fold the loss scale and the micro-batch mean into the
// shards' gradient multiplier, and move the dynamic loss scale. One home for these rules, so the
// C++ trainer (train/trainer.cc) and the C ABI's front ends (capi/offload_c.h) cannot drift.
#ifndef OFFLOAD_OPTIMIZER_CLIENT_PRECISION_STEP_POLICY_H_
#define OFFLOAD_OPTIMIZER_CLIENT_PRECISION_STEP_POLICY_H_

#include "absl/status/status.h"
#include "optimizer_client/precision/grad_stats.h"
#include "optimizer_client/precision/loss_scaler.h"

namespace offload {

struct StepPolicyOptions {
  LossScalerOptions loss_scaler;
  bool loss_scaling = false;  // fp16: dynamic loss scaling; bf16: the scale stays 1
  float grad_clip = 0;        // max global norm; <= 0: no clipping
  int micro_batches = 1;      // the shards sum the micro-batches' gradients
};

// What the commit of one step carries, and what the step reports.
struct StepDecision {
  float loss_scale = 1;       // the scale the step's gradients were computed with
  bool skip = false;          // some gradient is inf or NaN: drop the gradients, keep the weights
  double grad_norm = 0;       // global norm of the step's (mean) gradient, unscaled
  float clip_coef = 1;        // min(1, grad_clip / (grad_norm + 1e-6)); 1 when off or skipped
  float grad_multiplier = 1;  // clip_coef / (loss_scale * micro_batches): what the shards apply
};

class StepPolicy {
 public:
  explicit StepPolicy(const StepPolicyOptions& options);

  const StepPolicyOptions& options() const { return options_; }
  // The scale to multiply the loss by in the step about to run.
  float loss_scale() const { return scaler_.scale(); }
  const DynamicLossScaler& scaler() const { return scaler_; }

  // From the step's statistics over every rank (gradients as rounded to 16 bits, still
  // multiplied by the loss scale and summed over micro-batches), with max_grad_norm overriding
  // the options' grad_clip for this step when >= 0. Changes nothing.
  StepDecision Decide(const GradStats& global, float max_grad_norm = -1) const;
  // After the step is committed: the loss scale halves on a skip and grows after a clean window.
  void Finish(const StepDecision& decision) { scaler_.Update(decision.skip); }

  v1::LossScaleState State() const { return scaler_.State(); }
  absl::Status Restore(const v1::LossScaleState& state) { return scaler_.Restore(state); }

 private:
  StepPolicyOptions options_;
  DynamicLossScaler scaler_;
};

}  // namespace offload

#endif  // OFFLOAD_OPTIMIZER_CLIENT_PRECISION_STEP_POLICY_H_
