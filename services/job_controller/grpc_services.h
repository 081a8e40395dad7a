// The gRPC faces of the job controller: JobService over any JobApi, WorkerService over the
// JobController. A JobService call names its caller (the tenant of its bearer token) and the API
// decides; a WorkerService call is authenticated first, with the operator's tokens only. Both
// answer with the absl::Status of the call carried over code and message unchanged.
#ifndef OFFLOAD_SERVICES_JOB_CONTROLLER_GRPC_SERVICES_H_
#define OFFLOAD_SERVICES_JOB_CONTROLLER_GRPC_SERVICES_H_

#include "absl/status/status.h"
#include "base/grpc_status.h"
#include "base/security/security.h"
#include "grpcpp/grpcpp.h"
#include "offload/v1/job.grpc.pb.h"
#include "offload/v1/worker.grpc.pb.h"
#include "services/job_controller/job_api.h"
#include "services/job_controller/job_controller.h"
#include "services/job_controller/tenancy/identities.h"

namespace offload {

class JobServiceImpl final : public v1::JobService::Service {
 public:
  // `api` and `identities` (nullptr: no authentication) must outlive the service.
  JobServiceImpl(JobApi* api, const Identities* identities) : api_(api), identities_(identities) {}

  grpc::Status SubmitJob(grpc::ServerContext* context, const v1::SubmitJobRequest* request,
                         v1::Job* response) override;
  grpc::Status GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request,
                      v1::Job* response) override;
  grpc::Status ListJobs(grpc::ServerContext* context, const v1::ListJobsRequest* request,
                        v1::ListJobsResponse* response) override;
  grpc::Status CancelJob(grpc::ServerContext* context, const v1::JobActionRequest* request,
                         v1::Job* response) override;
  grpc::Status PauseJob(grpc::ServerContext* context, const v1::JobActionRequest* request,
                        v1::Job* response) override;
  grpc::Status ResumeJob(grpc::ServerContext* context, const v1::JobActionRequest* request,
                         v1::Job* response) override;
  grpc::Status CheckpointJob(grpc::ServerContext* context, const v1::JobActionRequest* request,
                             v1::Job* response) override;
  grpc::Status ListJobEvents(grpc::ServerContext* context, const v1::ListJobEventsRequest* request,
                             v1::ListJobEventsResponse* response) override;
  grpc::Status ListAudit(grpc::ServerContext* context, const v1::ListAuditRequest* request,
                         v1::ListAuditResponse* response) override;

 private:
  Caller Identify(const grpc::ServerContext& context) const;

  JobApi* const api_;
  const Identities* const identities_;
};

class WorkerServiceImpl final : public v1::WorkerService::Service {
 public:
  // `controller` and `tokens` (empty: no authentication) must outlive the service. Pool workers
  // hold the operator's tokens; a tenant's token is not one of them.
  WorkerServiceImpl(JobController* controller, const BearerTokens* tokens)
      : controller_(controller), tokens_(tokens) {}

  grpc::Status RegisterWorker(grpc::ServerContext* context,
                              const v1::RegisterWorkerRequest* request,
                              v1::RegisterWorkerResponse* response) override;
  grpc::Status Heartbeat(grpc::ServerContext* context, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override;
  grpc::Status ReportProgress(grpc::ServerContext* context, const v1::ProgressReport* request,
                              v1::ProgressReply* response) override;
  grpc::Status RendezvousSet(grpc::ServerContext* context, const v1::RendezvousSetRequest* request,
                             v1::RendezvousSetResponse* response) override;
  grpc::Status RendezvousGet(grpc::ServerContext* context, const v1::RendezvousGetRequest* request,
                             v1::RendezvousGetResponse* response) override;

 private:
  JobController* const controller_;
  const BearerTokens* const tokens_;
};

}  // namespace offload

#endif  // OFFLOAD_SERVICES_JOB_CONTROLLER_GRPC_SERVICES_H_
