#include "services/job_controller/controller_metrics.h"

#include "base/metrics/metrics.h"
#include "services/common/job_state_names.h"

namespace offload {
namespace {

using Samples = std::vector<CallbackMetric::Sample>;
const char* const kKinds[2] = {"trainer", "optimizer_server"};

}  // namespace

// The label values must match the names people see in offloadctl and the REST API.
std::string JobStateLabel(v1::JobState state) { return StateName(state); }

namespace {

// One snapshot per scrape: the families agree with each other, and the controller's lock is
// taken once.
class ControllerCollector : public prometheus::Collectable {
 public:
  explicit ControllerCollector(const JobController* controller) : controller_(controller) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    const JobController::Stats stats = controller_->GetStats();
    const CallbackMetric metrics[] = {
        {"offload_controller_jobs", "Jobs in each state.", prometheus::MetricType::Gauge,
         [&stats] {
           Samples samples;
           for (const auto& [state, n] : stats.jobs) {
             samples.push_back({{{"state", JobStateLabel(state)}}, static_cast<double>(n)});
           }
           return samples;
         }},
        {"offload_controller_workers", "Registered pool workers, by kind and state.",
         prometheus::MetricType::Gauge,
         [&stats] {
           Samples samples;
           for (int k = 0; k < 2; ++k) {
             samples.push_back({{{"kind", kKinds[k]}, {"state", "idle"}},
                                static_cast<double>(stats.workers[k][0])});
             samples.push_back({{{"kind", kKinds[k]}, {"state", "busy"}},
                                static_cast<double>(stats.workers[k][1])});
           }
           return samples;
         }},
        {"offload_controller_worker_heartbeat_timeouts_total",
         "Workers declared dead because their heartbeats stopped.", prometheus::MetricType::Counter,
         [&stats] {
           Samples samples;
           for (int k = 0; k < 2; ++k) {
             samples.push_back(
                 {{{"kind", kKinds[k]}}, static_cast<double>(stats.heartbeat_timeouts[k])});
           }
           return samples;
         }},
        {"offload_controller_attempt_failures_total", "Job attempts that failed.",
         prometheus::MetricType::Counter,
         [&stats] {
           return Samples{{{}, static_cast<double>(stats.attempt_failures)}};
         }},
        {"offload_controller_job_restarts_total",
         "Attempts restarted from the last checkpoint after a failure.",
         prometheus::MetricType::Counter,
         [&stats] {
           return Samples{{{}, static_cast<double>(stats.restarts)}};
         }},
    };
    std::vector<prometheus::MetricFamily> families;
    for (const CallbackMetric& m : metrics) {
      for (prometheus::MetricFamily& f : m.Collect()) families.push_back(std::move(f));
    }
    return families;
  }

 private:
  const JobController* const controller_;
};

}  // namespace

std::shared_ptr<prometheus::Collectable> MakeControllerCollector(const JobController* controller) {
  return std::make_shared<ControllerCollector>(controller);
}

}  // namespace offload
