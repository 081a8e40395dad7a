#include "cpu_optimizer_server/shard/server_metrics.h"

#include "base/metrics/metrics.h"
#include "base/thread_pool.h"
#include "cpu_optimizer_server/shard/shard_store.h"

namespace offload {

ServerMetrics& ServerMetrics::Get() {
  static ServerMetrics* metrics = new ServerMetrics();
  return *metrics;
}

void ServerMetrics::Enable() {
  if (enabled()) return;
  prometheus::Registry& registry = MetricsRegistry();
  auto& receive = prometheus::BuildCounter()
                      .Name("offload_optimizer_receive_bytes_total")
                      .Help("Gradient bytes received, by data plane.")
                      .Register(registry);
  auto& transmit = prometheus::BuildCounter()
                       .Name("offload_optimizer_transmit_bytes_total")
                       .Help("Updated parameter bytes sent back, by data plane.")
                       .Register(registry);
  const char* planes[] = {"grpc", "shm", "ucx"};
  for (int i = 0; i < 3; ++i) {
    receive_[i] = &receive.Add({{"transport", planes[i]}});
    transmit_[i] = &transmit.Add({{"transport", planes[i]}});
  }
  params_updated_ = &prometheus::BuildCounter()
                         .Name("offload_optimizer_params_updated_total")
                         .Help("Parameters updated by Adam.")
                         .Register(registry)
                         .Add({});
  auto& steps = prometheus::BuildCounter()
                    .Name("offload_optimizer_steps_total")
                    .Help("Range steps committed: applied, or skipped for fp16 overflow.")
                    .Register(registry);
  steps_applied_ = &steps.Add({{"result", "applied"}});
  steps_skipped_ = &steps.Add({{"result", "skipped"}});
  adam_seconds_ = &prometheus::BuildHistogram()
                       .Name("offload_optimizer_adam_seconds")
                       .Help(
                           "Wall time of the Adam update of one range step, with its "
                           "parameters streamed back wave by wave.")
                       .Register(registry)
                       .Add({}, DurationBuckets());
  disk_read_ = &prometheus::BuildCounter()
                    .Name("offload_optimizer_disk_read_bytes_total")
                    .Help("Optimizer state bytes read from the disk tier by Adam passes.")
                    .Register(registry)
                    .Add({});
  disk_written_ = &prometheus::BuildCounter()
                       .Name("offload_optimizer_disk_written_bytes_total")
                       .Help("Optimizer state bytes written back to the disk tier by Adam passes.")
                       .Register(registry)
                       .Add({});
  disk_wait_seconds_ = &prometheus::BuildHistogram()
                            .Name("offload_optimizer_disk_wait_seconds")
                            .Help(
                                "Time one range step's Adam pass waited on the disk tier (reads "
                                "not yet in, write-backs holding the ring).")
                            .Register(registry)
                            .Add({}, DurationBuckets());
  enabled_.store(true, std::memory_order_release);
}

void ServerMetrics::DiskPass(int64_t bytes_read, int64_t bytes_written, double wait_seconds) {
  if (!enabled()) return;
  disk_read_->Increment(static_cast<double>(bytes_read));
  disk_written_->Increment(static_cast<double>(bytes_written));
  disk_wait_seconds_->Observe(wait_seconds);
}

void ServerMetrics::StepApplied(int64_t elements, double adam_seconds) {
  if (!enabled()) return;
  steps_applied_->Increment();
  params_updated_->Increment(static_cast<double>(elements));
  adam_seconds_->Observe(adam_seconds);
}

std::vector<std::shared_ptr<prometheus::Collectable>> MakeShardStoreCollectors(
    const ShardStore* store) {
  using Samples = std::vector<CallbackMetric::Sample>;
  std::vector<std::shared_ptr<prometheus::Collectable>> out;
  out.push_back(CallbackMetric::Gauge(
      "offload_optimizer_state_bytes",
      "Bytes of optimizer state held: fp32 master weights and Adam moments.", [store] {
        double bytes = 0;
        for (const auto& job : store->Jobs()) bytes += static_cast<double>(job->state_bytes());
        return Samples{{{}, bytes}};
      }));
  out.push_back(CallbackMetric::Gauge(
      "offload_optimizer_disk_state_bytes",
      "Bytes of optimizer state in state files on the disk tier (--state_dir).", [store] {
        double bytes = 0;
        for (const auto& job : store->Jobs()) bytes += static_cast<double>(job->disk_bytes());
        return Samples{{{}, bytes}};
      }));
  if (store->disk() != nullptr) {
    out.push_back(CallbackMetric::Gauge(
        "offload_optimizer_disk_free_bytes", "Free bytes of the disk tier's file system.", [store] {
          return Samples{{{}, static_cast<double>(store->disk()->FreeBytes())}};
        }));
  }
  out.push_back(CallbackMetric::Gauge(
      "offload_optimizer_memory_limit_bytes",
      "The server's memory budget for state, accumulators and gradients in flight.", [store] {
        return Samples{{{}, static_cast<double>(store->options().memory_limit_bytes)}};
      }));
  out.push_back(CallbackMetric::Gauge("offload_optimizer_shard_jobs", "Shard jobs held.", [store] {
    return Samples{{{}, static_cast<double>(store->Jobs().size())}};
  }));
  out.push_back(CallbackMetric::Gauge(
      "offload_optimizer_queue_depth", "Adam work regions queued or running on the thread pool.",
      [store] {
        return Samples{{{}, static_cast<double>(store->pool()->queue_depth())}};
      }));
  return out;
}

}  // namespace offload
