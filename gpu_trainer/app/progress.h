// What the user watches while a job trains: on a terminal a one-line progress bar redrawn in
// place (step, loss, tokens/s, time left); off a terminal (CI, logs, a pod) plain log lines.
#ifndef OFFLOAD_GPU_TRAINER_APP_PROGRESS_H_
#define OFFLOAD_GPU_TRAINER_APP_PROGRESS_H_

#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace offload {

class ProgressReporter {
 public:
  // `bar`: draw the bar (a terminal); else one line every `log_every` steps.
  ProgressReporter(FILE* out, bool bar, uint64_t total_steps, int log_every);

  // After each step.
  void Step(uint64_t step, float loss, float lr, float loss_scale, bool skipped,
            int64_t tokens_per_step);
  // A message on its own line (the bar is redrawn under it).
  void Message(const std::string& line);
  void Finish();

 private:
  void Draw();

  FILE* const out_;
  const bool bar_;
  const uint64_t total_steps_;
  const int log_every_;
  uint64_t step_ = 0;
  uint64_t steps_timed_ = 0;
  float loss_ = 0, lr_ = 0, scale_ = 1;
  uint64_t skipped_ = 0;
  double tokens_per_s_ = 0;
  double step_seconds_ = 0;  // moving average
  absl::Time last_ = absl::Now();
  absl::Time last_draw_ = absl::InfinitePast();
  bool drawn_ = false;
};

std::string FormatDuration(double seconds);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_APP_PROGRESS_H_
