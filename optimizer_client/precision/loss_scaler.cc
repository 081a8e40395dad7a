#include "optimizer_client/precision/loss_scaler.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace offload {

DynamicLossScaler::DynamicLossScaler(const LossScalerOptions& options, bool enabled)
    : options_(options), enabled_(enabled), scale_(enabled ? options.init_scale : 1.0f) {}

void DynamicLossScaler::Update(bool overflow) {
  if (overflow) {
    ++skipped_steps_;
    clean_steps_ = 0;
    if (enabled_) scale_ = std::max(options_.min_scale, scale_ * options_.backoff_factor);
    return;
  }
  if (!enabled_) return;
  if (++clean_steps_ >= static_cast<uint32_t>(options_.growth_interval)) {
    clean_steps_ = 0;
    const float grown = scale_ * options_.growth_factor;
    if (std::isfinite(grown)) scale_ = grown;
  }
}

v1::LossScaleState DynamicLossScaler::State() const {
  v1::LossScaleState state;
  state.set_scale(scale_);
  state.set_clean_steps(clean_steps_);
  state.set_skipped_steps(skipped_steps_);
  return state;
}

absl::Status DynamicLossScaler::Restore(const v1::LossScaleState& state) {
  if (!std::isfinite(state.scale()) || state.scale() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss_scale.scale must be a positive finite number, got ", state.scale()));
  }
  if (!enabled_ && state.scale() != 1.0f) {
    return absl::InvalidArgumentError(absl::StrCat("loss_scale.scale is ", state.scale(),
                                                   " but this run uses no loss scaling (bf16)"));
  }
  scale_ = state.scale();
  clean_steps_ = state.clean_steps();
  skipped_steps_ = state.skipped_steps();
  return absl::OkStatus();
}

}  // namespace offload
