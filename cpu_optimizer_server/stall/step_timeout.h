// How long a trainer waits on a shard inside a step before it calls the shard hung (issue 60).
// A shard killed -9 is found at once (its connections close) and a stopped host by gRPC's
// keepalive; a shard whose process answers keepalives but whose step makes no progress (a stuck
// disk, a wedged thread) is found only by a deadline. A fixed one must cover the largest model's
// step, so it is far too long for most: this one follows the shard's own step times.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_STALL_STEP_TIMEOUT_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_STALL_STEP_TIMEOUT_H_

#include <array>
#include <mutex>
#include <string>

#include "absl/time/time.h"

namespace offload {

struct StepTimeoutOptions {
  // The bound until the shard has steps measured, and always the most.
  absl::Duration call_timeout = absl::Minutes(10);
  // Never less: a step that stalls on its trainer (a slow batch, a collective) is not the shard's.
  absl::Duration floor = absl::Seconds(60);
  double multiple = 10;  // of the median step
};

// Thread-safe: every range's stream of one shard records into one.
class StepTimeout {
 public:
  static constexpr int kMinSteps = 3;  // measured steps before the median is trusted
  static constexpr int kWindow = 32;   // the last steps the median is taken over

  explicit StepTimeout(const StepTimeoutOptions& options) : options_(options) {}

  // call_timeout until kMinSteps steps were recorded, then multiple x the median of the last
  // kWindow, within [floor, call_timeout].
  absl::Duration Get() const;
  // A committed step's time on the wire, from its open to its commit's answer.
  void Record(absl::Duration step);
  // "no answer within 1m (10x the median step of 3.2s, at least 1m)": what a timed-out wait says.
  std::string Describe(absl::Duration limit) const;

 private:
  const StepTimeoutOptions options_;
  mutable std::mutex mu_;
  std::array<absl::Duration, kWindow> recent_{};
  int recorded_ = 0;  // all steps recorded; the last min(recorded_, kWindow) are in recent_

  absl::Duration MedianLocked() const;
};

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_STALL_STEP_TIMEOUT_H_
