// The optimizer server's metrics (docs/METRICS.md, "Optimizer server"). Counters are bumped once
// per chunk or per committed range step, never per element; what the store holds (state bytes,
// jobs, queued Adam work) is read only when Prometheus scrapes.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_SERVER_METRICS_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_SERVER_METRICS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/histogram.h"

namespace offload {

class ShardStore;

// The data plane a step stream came over; the `transport` label.
enum class DataPlane { kGrpc = 0, kShm = 1, kUcx = 2 };

// Counts nothing until Enable(): the trainer's in-process optimizer runs the same StepSession,
// and its updates must not appear as an optimizer server's.
class ServerMetrics {
 public:
  static ServerMetrics& Get();
  // Registers the families in the process registry, all at zero, and starts counting. The
  // optimizer server calls it once at startup, before it serves.
  void Enable();

  // Gradient bytes accepted / 16-bit parameter bytes sent back over `plane`.
  void Received(DataPlane plane, int64_t bytes) {
    if (enabled()) receive_[Index(plane)]->Increment(bytes);
  }
  void Sent(DataPlane plane, int64_t bytes) {
    if (enabled()) transmit_[Index(plane)]->Increment(bytes);
  }
  // A range step committed: `elements` updated by Adam in `adam_seconds`, or skipped.
  void StepApplied(int64_t elements, double adam_seconds);
  // A commit's pass over a range's state on the disk tier: bytes read and written, and the
  // seconds its thread waited on the disk.
  void DiskPass(int64_t bytes_read, int64_t bytes_written, double wait_seconds);
  void StepSkipped() {
    if (enabled()) steps_skipped_->Increment();
  }

 private:
  ServerMetrics() = default;
  static int Index(DataPlane plane) { return static_cast<int>(plane); }
  bool enabled() const { return enabled_.load(std::memory_order_acquire); }

  std::atomic<bool> enabled_{false};  // set once the pointers below are

  prometheus::Counter* receive_[3];
  prometheus::Counter* transmit_[3];
  prometheus::Counter* params_updated_;
  prometheus::Counter* steps_applied_;
  prometheus::Counter* steps_skipped_;
  prometheus::Histogram* adam_seconds_;
  prometheus::Counter* disk_read_;
  prometheus::Counter* disk_written_;
  prometheus::Histogram* disk_wait_seconds_;
};

// Scrape-time gauges of `store` (state bytes in memory and on disk, memory limit, the disk's free
// bytes, shard jobs, Adam queue depth), to add
// to the server's MetricsServer. `store` must outlive them.
std::vector<std::shared_ptr<prometheus::Collectable>> MakeShardStoreCollectors(
    const ShardStore* store);

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_SERVER_METRICS_H_
