// Runs an action (a call's TryCancel) if a phase does not end in time: a bound on one exchange of
// a stream that has no deadline of its own, such as the set-up of a data plane's Attach stream,
// which then lives as long as the attachment.
#ifndef OFFLOAD_BASE_WATCHDOG_H_
#define OFFLOAD_BASE_WATCHDOG_H_

#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace offload {

class Watchdog {
 public:
  // Runs `on_timeout` once, on a thread of the watchdog's, if Disarm is not called within
  // `timeout`.
  Watchdog(absl::Duration timeout, std::function<void()> on_timeout);
  // Disarms and joins.
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Ends the phase. False when the action already ran (or is running): the phase timed out.
  bool Disarm() ABSL_LOCKS_EXCLUDED(mu_);
  bool fired() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  bool disarmed_ ABSL_GUARDED_BY(mu_) = false;
  bool fired_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace offload

#endif  // OFFLOAD_BASE_WATCHDOG_H_
