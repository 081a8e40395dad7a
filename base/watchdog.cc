#include "base/watchdog.h"

#include <utility>

namespace offload {

Watchdog::Watchdog(absl::Duration timeout, std::function<void()> on_timeout) {
  thread_ = std::thread([this, timeout, on_timeout = std::move(on_timeout)] {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&disarmed_), timeout)) return;
      fired_ = true;
    }
    // Outside the lock: the action may block (a cancel waiting on the call's own locks), and
    // Disarm must still be able to answer meanwhile.
    on_timeout();
  });
}

Watchdog::~Watchdog() {
  Disarm();
  thread_.join();
}

bool Watchdog::Disarm() {
  absl::MutexLock lock(&mu_);
  disarmed_ = true;
  return !fired_;
}

bool Watchdog::fired() const {
  absl::MutexLock lock(&mu_);
  return fired_;
}

}  // namespace offload
