// What the job controller's files (job_controller.cc, pool/scheduling.cc, pool/workers.cc) read
// of a job the same way: its ranks and servers, its tenant and that tenant's quotas, its attempt's
// reference, and the controller's log line for an error. Internal to offload_controller.
#ifndef OFFLOAD_SERVICES_JOB_CONTROLLER_POOL_JOB_FACTS_H_
#define OFFLOAD_SERVICES_JOB_CONTROLLER_POOL_JOB_FACTS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "base/logging.h"
#include "google/protobuf/timestamp.pb.h"
#include "offload/v1/job.pb.h"
#include "offload/v1/worker.pb.h"
#include "services/job_controller/tenancy/caller.h"
#include "services/job_controller/tenancy/identities.h"

namespace offload {

inline void SetTimestamp(absl::Time t, google::protobuf::Timestamp* out) {
  const int64_t seconds = absl::ToUnixSeconds(t);
  out->set_seconds(seconds);
  out->set_nanos(static_cast<int32_t>((t - absl::FromUnixSeconds(seconds)) / absl::Nanoseconds(1)));
}

inline uint32_t Ranks(const v1::JobSpec& spec) {
  return spec.parallel().has_ranks() ? spec.parallel().ranks() : 1;
}

inline uint32_t OptimizerServers(const v1::JobSpec& spec) {
  return spec.parallel().has_optimizer_servers() ? spec.parallel().optimizer_servers() : 1;
}

inline v1::AttemptRef Ref(const std::string& job_id, uint32_t attempt) {
  v1::AttemptRef ref;
  ref.set_job_id(job_id);
  ref.set_attempt(attempt);
  return ref;
}

inline const std::string& TenantOf(const v1::Job& job) {
  static const std::string* const kOperator = new std::string(kOperatorTenant);
  return job.tenant().empty() ? *kOperator : job.tenant();
}

// The quotas and weight of `tenant` (not its tokens); one the table does not list has weight 1 and
// no quotas.
inline v1::TenantConfig QuotaOf(const TenantTable& table, const std::string& tenant) {
  v1::TenantConfig config;
  config.set_name(tenant);
  config.set_weight(1.0);
  if (const v1::TenantConfig* found = table.Find(tenant); found != nullptr) {
    config.set_weight(found->weight());
    config.set_max_optimizer_servers(found->max_optimizer_servers());
    config.set_max_ranks(found->max_ranks());
    config.set_max_running_jobs(found->max_running_jobs());
  }
  return config;
}

inline std::string WaitingReason(const v1::JobSpec& spec) {
  return absl::StrCat("waiting for ", Ranks(spec), " free trainer(s) and ", OptimizerServers(spec),
                      " free optimizer server(s)");
}

inline void LogError(const absl::Status& status) {
  if (!status.ok()) LOG(ERROR) << absl::StrFormat("job_controller: %s", status.ToString().c_str());
}

}  // namespace offload

#endif  // OFFLOAD_SERVICES_JOB_CONTROLLER_POOL_JOB_FACTS_H_
