#include "cpu_optimizer_server/stall/step_timeout.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace offload {

absl::Duration StepTimeout::MedianLocked() const {
  const int n = std::min(recorded_, kWindow);
  std::array<absl::Duration, kWindow> sorted = recent_;
  std::nth_element(sorted.begin(), sorted.begin() + n / 2, sorted.begin() + n);
  return sorted[n / 2];
}

absl::Duration StepTimeout::Get() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (recorded_ < kMinSteps) return options_.call_timeout;
  const absl::Duration derived = std::max(options_.floor, MedianLocked() * options_.multiple);
  return std::min(derived, options_.call_timeout);
}

void StepTimeout::Record(absl::Duration step) {
  std::lock_guard<std::mutex> lock(mu_);
  recent_[recorded_ % kWindow] = step;
  ++recorded_;
}

std::string StepTimeout::Describe(absl::Duration limit) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (recorded_ < kMinSteps) {
    return absl::StrCat("no answer within ", absl::FormatDuration(limit), " (the call timeout)");
  }
  return absl::StrCat("no answer within ", absl::FormatDuration(limit), " (", options_.multiple,
                      "x the median step of ", absl::FormatDuration(MedianLocked()), ", at least ",
                      absl::FormatDuration(options_.floor), ", at most ",
                      absl::FormatDuration(options_.call_timeout), ")");
}

}  // namespace offload
