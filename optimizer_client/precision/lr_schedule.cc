#include "optimizer_client/precision/lr_schedule.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace offload {

absl::Status ValidateLrSchedule(const v1::LrSchedule& s) {
  if (!std::isfinite(s.max_lr()) || s.max_lr() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("lr must be positive, got ", s.max_lr()));
  }
  if (!std::isfinite(s.min_lr()) || s.min_lr() < 0 || s.min_lr() > s.max_lr()) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_lr must be in [0, lr], got ", s.min_lr(), " with lr ", s.max_lr()));
  }
  return absl::OkStatus();
}

float ScheduledLr(const v1::LrSchedule& s, uint64_t step) {
  const double max_lr = s.max_lr(), min_lr = s.min_lr();
  if (step <= s.warmup_steps()) return static_cast<float>(max_lr * step / s.warmup_steps());
  if (step >= s.total_steps()) return s.min_lr();
  const double progress = static_cast<double>(step - s.warmup_steps()) /
                          static_cast<double>(s.total_steps() - s.warmup_steps());
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return static_cast<float>(min_lr + (max_lr - min_lr) * cosine);
}

}  // namespace offload
