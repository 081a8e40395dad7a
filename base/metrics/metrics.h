// Prometheus metrics of a process (ARCHITECTURE.md section 8, names in docs/METRICS.md): one
// registry per process that every library adds its families to, the standard process_* gauges, and
// the /metrics endpoint on the address `--metrics_address` names. The page is prometheus-cpp's text
// format served by cpp-httplib (the REST gateway's server): prometheus-cpp's own civetweb exposer
// fails to start inside gpu_trainer, and one HTTP library is enough. Counters and gauges are
// lock-free atomics, so the hot paths update them per chunk or per step; values that are cheaper to
// read than to keep up to date (bytes held, queue depth) come from collectors that run only when
// Prometheus scrapes.
#ifndef OFFLOAD_BASE_METRICS_METRICS_H_
#define OFFLOAD_BASE_METRICS_METRICS_H_

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"

namespace httplib {
class Server;
}

namespace offload {

// The process-wide registry: families registered anywhere in the process are served together.
prometheus::Registry& MetricsRegistry();

// Bucket bounds for durations from 1 ms to about 2 min (exponential, factor 2): a CPU step of the
// demo model, a GPU step, an Adam pass over a large shard all land inside.
const std::vector<double>& DurationBuckets();

// A gauge or counter family whose values are computed at scrape time by `collect`: for state
// another component already keeps (bytes held, jobs by state), so nothing is updated twice.
class CallbackMetric : public prometheus::Collectable {
 public:
  struct Sample {
    std::vector<std::pair<std::string, std::string>> labels;
    double value = 0;
  };
  using Collector = std::function<std::vector<Sample>()>;
  // `type` is Gauge or Counter.
  CallbackMetric(std::string name, std::string help, prometheus::MetricType type, Collector collect)
      : name_(std::move(name)), help_(std::move(help)), type_(type), collect_(std::move(collect)) {}
  std::vector<prometheus::MetricFamily> Collect() const override;

  static std::shared_ptr<CallbackMetric> Gauge(std::string name, std::string help,
                                               Collector collect) {
    return std::make_shared<CallbackMetric>(std::move(name), std::move(help),
                                            prometheus::MetricType::Gauge, std::move(collect));
  }
  static std::shared_ptr<CallbackMetric> Counter(std::string name, std::string help,
                                                 Collector collect) {
    return std::make_shared<CallbackMetric>(std::move(name), std::move(help),
                                            prometheus::MetricType::Counter, std::move(collect));
  }

 private:
  const std::string name_;
  const std::string help_;
  const prometheus::MetricType type_;
  const Collector collect_;
};

// Serves /metrics until destroyed.
class MetricsServer {
 public:
  // `address` is host:port (port 0: any free port). `binary` names the program in
  // offload_build_info. The process_* gauges are served too.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& address,
                                                              const std::string& binary);
  ~MetricsServer();

  // host:port actually bound (the real port when 0 was asked for).
  const std::string& address() const { return address_; }

  // Serves `collectable` as well, for as long as this server lives. Thread-safe.
  void Add(std::shared_ptr<prometheus::Collectable> collectable);

  // The page: every collectable's families in the text exposition format.
  std::string Render() const;

 private:
  MetricsServer() = default;
  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;
  std::atomic<bool> loop_ended_{false};
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<prometheus::Collectable>> collectables_;  // guarded by mu_
  std::string address_;
};

// The standard process_* metrics of the Prometheus client libraries, read from /proc/self at
// scrape time.
std::shared_ptr<prometheus::Collectable> MakeProcessCollector();

// cpp-httplib's listening socket options without SO_REUSEPORT, which would let a second server
// bind a port another one already serves (and share its connections) instead of failing.
void ExclusiveListenSocketOptions(int socket);

// Starts the server when `address` is not empty (the binaries' --metrics_address), and prints
// "<binary>: metrics on http://ADDRESS/metrics". Null when `address` is empty.
absl::StatusOr<std::unique_ptr<MetricsServer>> StartMetricsServerIfAsked(const std::string& address,
                                                                         const std::string& binary);

}  // namespace offload

#endif  // OFFLOAD_BASE_METRICS_METRICS_H_
