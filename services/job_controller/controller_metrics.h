// The job controller's metrics (docs/METRICS.md, "Job controller"): all read from
// JobController::GetStats when Prometheus scrapes, so the controller keeps no second copy.
#ifndef OFFLOAD_SERVICES_JOB_CONTROLLER_CONTROLLER_METRICS_H_
#define OFFLOAD_SERVICES_JOB_CONTROLLER_CONTROLLER_METRICS_H_

#include <memory>
#include <string>
#include <vector>

#include "prometheus/collectable.h"
#include "services/job_controller/job_controller.h"

namespace offload {

// "pending", "running", ... : the JobState name without its prefix, in lower case.
std::string JobStateLabel(v1::JobState state);

// Every family of the controller from one GetStats() per scrape. `controller` and `identities`
// (nullptr: no tenants file) must outlive it.
std::shared_ptr<prometheus::Collectable> MakeControllerCollector(const JobController* controller,
                                                                 const Identities* identities);

}  // namespace offload

#endif  // OFFLOAD_SERVICES_JOB_CONTROLLER_CONTROLLER_METRICS_H_
