// Dynamic loss scaling for fp16 training (ARCHITECTURE.md section 1), with PyTorch GradScaler's
// defaults: start at 2^16, halve and skip the step on overflow, double after 2000 clean steps. bf16
// runs keep the scale at 1, but a non-finite gradient still skips the step: applying it would turn
// the master weights into NaN, and nothing the user trained may be lost.
#ifndef OFFLOAD_OPTIMIZER_CLIENT_PRECISION_LOSS_SCALER_H_
#define OFFLOAD_OPTIMIZER_CLIENT_PRECISION_LOSS_SCALER_H_

#include <cstdint>

#include "absl/status/status.h"
#include "offload/v1/checkpoint.pb.h"

namespace offload {

struct LossScalerOptions {
  float init_scale = 65536.0f;
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int growth_interval = 2000;
  float min_scale = 1.0f;  // an overflow at scale 1 still skips, but the scale stops shrinking
};

class DynamicLossScaler {
 public:
  // Disabled (bf16): the scale stays 1.
  DynamicLossScaler(const LossScalerOptions& options, bool enabled);

  float scale() const { return scale_; }
  uint64_t skipped_steps() const { return skipped_steps_; }

  // After every step: `overflow` says whether the step's gradients had an inf or NaN.
  void Update(bool overflow);

  v1::LossScaleState State() const;
  absl::Status Restore(const v1::LossScaleState& state);

 private:
  LossScalerOptions options_;
  bool enabled_;
  float scale_;
  uint32_t clean_steps_ = 0;
  uint64_t skipped_steps_ = 0;
};

}  // namespace offload

#endif  // OFFLOAD_OPTIMIZER_CLIENT_PRECISION_LOSS_SCALER_H_
