// Cancels a gRPC step stream that has waited on its shard longer than the step timeout
// (step_timeout.h). gRPC's deadline covers a whole call, and a step stream stays open
// while its trainer computes or pauses (a debugger between backward and step): only the time
// spent inside a blocking call (a write the shard does not take, a read of its answer) is the
// shard's, so only that is bounded. One thread per client, started with its first stream.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_STALL_STALL_MONITOR_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_STALL_STALL_MONITOR_H_

#include <atomic>
#include <cstdint>
#include <set>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace offload {

class StallMonitor {
 public:
  // One call's watch. Between Begin and End the call is cancelled once `limit` passed.
  class Watch {
   public:
    explicit Watch(grpc::ClientContext* context) : context_(context) {}
    void Begin(absl::Duration limit) {
      until_ns_.store(absl::ToUnixNanos(absl::Now() + limit), std::memory_order_release);
    }
    void End() { until_ns_.store(0, std::memory_order_release); }
    // The monitor cancelled the call: its status is the monitor's, not the shard's.
    bool fired() const { return fired_.load(std::memory_order_acquire); }

   private:
    friend class StallMonitor;
    grpc::ClientContext* const context_;
    std::atomic<int64_t> until_ns_{0};  // 0: not waiting
    std::atomic<bool> fired_{false};
  };

  explicit StallMonitor(absl::Duration period = absl::Milliseconds(50)) : period_(period) {}
  ~StallMonitor();
  StallMonitor(const StallMonitor&) = delete;
  StallMonitor& operator=(const StallMonitor&) = delete;

  // Watched from Add until Remove, which returns only once the monitor no longer touches it.
  void Add(Watch* watch) ABSL_LOCKS_EXCLUDED(mu_);
  void Remove(Watch* watch) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop();

  const absl::Duration period_;
  absl::Mutex mu_;
  std::set<Watch*> watches_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_STALL_STALL_MONITOR_H_
