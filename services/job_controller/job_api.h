// The job control API as C++ calls (ARCHITECTURE.md section 7): what the gRPC JobService and the
// REST gateway both serve, so the two can never disagree. Errors are absl::Status codes the
// adapters map to gRPC and HTTP statuses; messages name the field or the job they are about.
//
// Every call names its Caller (tenancy/caller.h). A caller without a token gets UNAUTHENTICATED; a
// tenant sees and acts on its own jobs only, and another tenant's job is NOT_FOUND, exactly as a
// job that does not exist; admins see all. Calls that change something, and calls refused for who
// made them, are written to the audit log.
#ifndef OFFLOAD_SERVICES_JOB_CONTROLLER_JOB_API_H_
#define OFFLOAD_SERVICES_JOB_CONTROLLER_JOB_API_H_

#include "absl/status/statusor.h"
#include "offload/v1/job.pb.h"
#include "services/job_controller/tenancy/caller.h"

namespace offload {

class JobApi {
 public:
  virtual ~JobApi() = default;

  // INVALID_ARGUMENT naming the field for a bad spec (an unknown tenant, a priority out of range,
  // a job larger than its tenant's quota); PERMISSION_DENIED for a tenant naming another. The job
  // is stored before this returns.
  virtual absl::StatusOr<v1::Job> SubmitJob(const Caller& caller,
                                            const v1::SubmitJobRequest& request) = 0;
  // NOT_FOUND for an unknown id.
  virtual absl::StatusOr<v1::Job> GetJob(const Caller& caller,
                                         const v1::GetJobRequest& request) = 0;
  virtual absl::StatusOr<v1::ListJobsResponse> ListJobs(const Caller& caller,
                                                        const v1::ListJobsRequest& request) = 0;
  // The actions return the job as it is after the request was recorded. FAILED_PRECONDITION when
  // the job's state does not allow it (cancelling a finished job, resuming a running one).
  virtual absl::StatusOr<v1::Job> CancelJob(const Caller& caller,
                                            const v1::JobActionRequest& request) = 0;
  virtual absl::StatusOr<v1::Job> PauseJob(const Caller& caller,
                                           const v1::JobActionRequest& request) = 0;
  virtual absl::StatusOr<v1::Job> ResumeJob(const Caller& caller,
                                            const v1::JobActionRequest& request) = 0;
  virtual absl::StatusOr<v1::Job> CheckpointJob(const Caller& caller,
                                                const v1::JobActionRequest& request) = 0;
  virtual absl::StatusOr<v1::ListJobEventsResponse> ListJobEvents(
      const Caller& caller, const v1::ListJobEventsRequest& request) = 0;
  // PERMISSION_DENIED for a caller that is not an admin.
  virtual absl::StatusOr<v1::ListAuditResponse> ListAudit(const Caller& caller,
                                                          const v1::ListAuditRequest& request) = 0;
};

}  // namespace offload

#endif  // OFFLOAD_SERVICES_JOB_CONTROLLER_JOB_API_H_
