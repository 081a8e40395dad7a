#include "gpu_trainer/app/progress.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace offload {

std::string FormatDuration(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return absl::StrFormat("%dh%02dm", s / 3600, s % 3600 / 60);
  if (s >= 60) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%ds", s);
}

ProgressReporter::ProgressReporter(FILE* out, bool bar, uint64_t total_steps, int log_every)
    : out_(out), bar_(bar), total_steps_(total_steps), log_every_(std::max(1, log_every)) {}

void ProgressReporter::Step(uint64_t step, float loss, float lr, float loss_scale, bool skipped,
                            int64_t tokens_per_step) {
  const absl::Time now = absl::Now();
  const double seconds = absl::ToDoubleSeconds(now - last_);
  last_ = now;
  // The first step of a run pays for warm-up; averaging from the second keeps the ETA honest.
  if (steps_timed_++ > 0) {
    step_seconds_ = steps_timed_ == 2 ? seconds : 0.9 * step_seconds_ + 0.1 * seconds;
    tokens_per_s_ = step_seconds_ > 0 ? tokens_per_step / step_seconds_ : 0;
  }
  step_ = step;
  loss_ = loss;
  lr_ = lr;
  scale_ = loss_scale;
  if (skipped) ++skipped_;
  if (bar_) {
    if (now - last_draw_ >= absl::Milliseconds(100) || step == total_steps_) Draw();
    return;
  }
  if (step % log_every_ == 0 || step == total_steps_ || skipped) {
    absl::FPrintF(out_, "step %d/%d loss %.4f lr %.3e loss_scale %g tokens_per_s %.0f eta %s%s\n",
                  step, total_steps_, loss, lr, loss_scale, tokens_per_s_,
                  FormatDuration(step_seconds_ * (total_steps_ - step)),
                  skipped ? " (overflow: step skipped)" : "");
    std::fflush(out_);
  }
}

void ProgressReporter::Draw() {
  last_draw_ = absl::Now();
  constexpr int kWidth = 24;
  const int filled = static_cast<int>(kWidth * step_ / std::max<uint64_t>(1, total_steps_));
  std::string bar(filled, '#');
  bar.resize(kWidth, '.');
  absl::FPrintF(out_, "\r\033[K[%s] step %d/%d | loss %.4f | %.1fk tok/s | %s left%s", bar, step_,
                total_steps_, loss_, tokens_per_s_ / 1000.0,
                FormatDuration(step_seconds_ * (total_steps_ - step_)),
                skipped_ ? absl::StrFormat(" | %d skipped", skipped_) : "");
  std::fflush(out_);
  drawn_ = true;
}

void ProgressReporter::Message(const std::string& line) {
  if (bar_ && drawn_) absl::FPrintF(out_, "\r\033[K");
  absl::FPrintF(out_, "%s\n", line);
  if (bar_ && drawn_) Draw();
  std::fflush(out_);
}

void ProgressReporter::Finish() {
  if (bar_ && drawn_) {
    Draw();
    absl::FPrintF(out_, "\n");
    std::fflush(out_);
  }
  drawn_ = false;
}

}  // namespace offload
