#include "cpu_optimizer_server/stall/stall_monitor.h"

namespace offload {

StallMonitor::~StallMonitor() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void StallMonitor::Add(Watch* watch) {
  absl::MutexLock lock(&mu_);
  watches_.insert(watch);
  if (!started_) {
    started_ = true;
    thread_ = std::thread([this] { Loop(); });
  }
}

void StallMonitor::Remove(Watch* watch) {
  absl::MutexLock lock(&mu_);
  watches_.erase(watch);
}

void StallMonitor::Loop() {
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stop_), period_)) {
    const int64_t now = absl::ToUnixNanos(absl::Now());
    for (Watch* w : watches_) {
      const int64_t until = w->until_ns_.load(std::memory_order_acquire);
      if (until != 0 && now >= until && !w->fired_.exchange(true, std::memory_order_acq_rel)) {
        w->context_->TryCancel();  // does not block; the waiting call returns CANCELLED
      }
    }
  }
}

}  // namespace offload
