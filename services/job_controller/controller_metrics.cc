#include "services/job_controller/controller_metrics.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "services/common/metrics.h"

namespace offload {
namespace {

using Samples = std::vector<CallbackMetric::Sample>;
const char* const kKinds[2] = {"trainer", "optimizer_server"};

}  // namespace

std::string JobStateLabel(v1::JobState state) {
  std::string name = v1::JobState_Name(state);
  constexpr absl::string_view kPrefix = "JOB_STATE_";
  if (absl::StartsWith(name, kPrefix)) name = name.substr(kPrefix.size());
  return absl::AsciiStrToLower(name);
}

std::vector<std::shared_ptr<prometheus::Collectable>> MakeControllerCollectors(
    const JobController* controller) {
  std::vector<std::shared_ptr<prometheus::Collectable>> out;
  out.push_back(
      CallbackMetric::Gauge("offload_controller_jobs", "Jobs in each state.", [controller] {
        Samples samples;
        for (const auto& [state, n] : controller->GetStats().jobs) {
          samples.push_back({{{"state", JobStateLabel(state)}}, n});
        }
        return samples;
      }));
  out.push_back(CallbackMetric::Gauge(
      "offload_controller_workers", "Registered pool workers, by kind and state.", [controller] {
        const JobController::Stats stats = controller->GetStats();
        Samples samples;
        for (int k = 0; k < 2; ++k) {
          samples.push_back({{{"kind", kKinds[k]}, {"state", "idle"}}, stats.workers[k][0]});
          samples.push_back({{{"kind", kKinds[k]}, {"state", "busy"}}, stats.workers[k][1]});
        }
        return samples;
      }));
  out.push_back(CallbackMetric::Counter(
      "offload_controller_worker_heartbeat_timeouts_total",
      "Workers declared dead because their heartbeats stopped.", [controller] {
        const JobController::Stats stats = controller->GetStats();
        Samples samples;
        for (int k = 0; k < 2; ++k) {
          samples.push_back(
              {{{"kind", kKinds[k]}}, static_cast<double>(stats.heartbeat_timeouts[k])});
        }
        return samples;
      }));
  out.push_back(CallbackMetric::Counter(
      "offload_controller_attempt_failures_total", "Job attempts that failed.", [controller] {
        return Samples{{{}, static_cast<double>(controller->GetStats().attempt_failures)}};
      }));
  out.push_back(CallbackMetric::Counter(
      "offload_controller_job_restarts_total",
      "Attempts restarted from the last checkpoint after a failure.", [controller] {
        return Samples{{{}, static_cast<double>(controller->GetStats().restarts)}};
      }));
  return out;
}

}  // namespace offload
