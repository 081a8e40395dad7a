// The job control API as C++ calls (ARCHITECTURE.md section 7): what the gRPC JobService and the
// REST gateway both serve, so the two can never disagree. Errors are absl::Status codes the
// adapters map to gRPC and HTTP statuses; messages name the field or the job they are about.
#ifndef OFFLOAD_SERVICES_JOB_CONTROLLER_JOB_API_H_
#define OFFLOAD_SERVICES_JOB_CONTROLLER_JOB_API_H_

#include "absl/status/statusor.h"
#include "offload/v1/job.pb.h"

namespace offload {

class JobApi {
 public:
  virtual ~JobApi() = default;

  // INVALID_ARGUMENT naming the field for a bad spec; the job is stored before this returns.
  virtual absl::StatusOr<v1::Job> SubmitJob(const v1::SubmitJobRequest& request) = 0;
  // NOT_FOUND for an unknown id.
  virtual absl::StatusOr<v1::Job> GetJob(const v1::GetJobRequest& request) = 0;
  virtual absl::StatusOr<v1::ListJobsResponse> ListJobs(const v1::ListJobsRequest& request) = 0;
  // The actions return the job as it is after the request was recorded. FAILED_PRECONDITION when
  // the job's state does not allow it (cancelling a finished job, resuming a running one).
  virtual absl::StatusOr<v1::Job> CancelJob(const v1::JobActionRequest& request) = 0;
  virtual absl::StatusOr<v1::Job> PauseJob(const v1::JobActionRequest& request) = 0;
  virtual absl::StatusOr<v1::Job> ResumeJob(const v1::JobActionRequest& request) = 0;
  virtual absl::StatusOr<v1::Job> CheckpointJob(const v1::JobActionRequest& request) = 0;
  virtual absl::StatusOr<v1::ListJobEventsResponse> ListJobEvents(
      const v1::ListJobEventsRequest& request) = 0;
};

}  // namespace offload

#endif  // OFFLOAD_SERVICES_JOB_CONTROLLER_JOB_API_H_
