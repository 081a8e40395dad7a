#include "services/job_controller/controller_metrics.h"

#include "base/metrics/metrics.h"
#include "jobs/spec/job_state_names.h"

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
template <typename Value>
Samples PerTenant(const JobController::Stats& stats, Value value) {
  Samples samples;
  for (const auto& [tenant, t] : stats.tenants) {
    samples.push_back({{{"tenant", tenant}}, value(t)});
  }
  return samples;
}

class ControllerCollector : public prometheus::Collectable {
 public:
  ControllerCollector(const JobController* controller, const Identities* identities)
      : controller_(controller), identities_(identities) {}

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
        {"offload_tenant_optimizer_servers", "Optimizer servers held by the tenant's running jobs.",
         prometheus::MetricType::Gauge,
         [&stats] {
           return PerTenant(stats, [](const JobController::Stats::Tenant& t) {
             return static_cast<double>(t.load.servers);
           });
         }},
        {"offload_tenant_ranks", "Trainer ranks held by the tenant's running jobs.",
         prometheus::MetricType::Gauge,
         [&stats] {
           return PerTenant(stats, [](const JobController::Stats::Tenant& t) {
             return static_cast<double>(t.load.ranks);
           });
         }},
        {"offload_tenant_jobs", "The tenant's jobs queued (pending) and running.",
         prometheus::MetricType::Gauge,
         [&stats] {
           Samples samples;
           for (const auto& [tenant, t] : stats.tenants) {
             samples.push_back({{{"tenant", tenant}, {"state", "queued"}},
                                static_cast<double>(t.load.queued_jobs)});
             samples.push_back({{{"tenant", tenant}, {"state", "running"}},
                                static_cast<double>(t.load.running_jobs)});
           }
           return samples;
         }},
        {"offload_tenant_fair_share_deficit",
         "The tenant's entitled share of the pool minus its dominant share; > 0: below its fair "
         "share.",
         prometheus::MetricType::Gauge,
         [&stats] {
           return PerTenant(
               stats, [](const JobController::Stats::Tenant& t) { return t.fair_share_deficit; });
         }},
        {"offload_tenant_preemptions_total",
         "Times the tenant's jobs were stopped for a job of higher priority.",
         prometheus::MetricType::Counter,
         [&stats] {
           return PerTenant(stats, [](const JobController::Stats::Tenant& t) {
             return static_cast<double>(t.preemptions);
           });
         }},
        {"offload_controller_tenants_reloads_total",
         "Reads of a changed tenants file, by outcome (an error keeps the last good tenants).",
         prometheus::MetricType::Counter,
         [this] {
           Samples samples;
           for (const bool ok : {true, false}) {
             samples.push_back(
                 {{{"result", ok ? "ok" : "error"}},
                  identities_ == nullptr ? 0.0 : static_cast<double>(identities_->reloads(ok))});
           }
           return samples;
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
  const Identities* const identities_;
};

}  // namespace

std::shared_ptr<prometheus::Collectable> MakeControllerCollector(const JobController* controller,
                                                                 const Identities* identities) {
  return std::make_shared<ControllerCollector>(controller, identities);
}

}  // namespace offload
