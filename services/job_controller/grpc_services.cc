#include "services/job_controller/grpc_services.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace offload {
namespace {

// Runs `call` and moves its value into `response`; the controller decides about the caller.
template <typename Response, typename Call>
grpc::Status Answer(Response* response, Call call) {
  absl::StatusOr<Response> result = call();
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = *std::move(result);
  return grpc::Status::OK;
}

// Authenticates with `tokens` first.
template <typename Response, typename Call>
grpc::Status Serve(const BearerTokens& tokens, const grpc::ServerContext& context,
                   Response* response, Call call) {
  if (grpc::Status auth = CheckBearer(tokens, context); !auth.ok()) return auth;
  return Answer(response, std::move(call));
}

}  // namespace

Caller JobServiceImpl::Identify(const grpc::ServerContext& context) const {
  return identities_ == nullptr ? Caller::Operator() : identities_->Identify(context);
}

grpc::Status JobServiceImpl::SubmitJob(grpc::ServerContext* context,
                                       const v1::SubmitJobRequest* request, v1::Job* response) {
  return Answer(response, [&] { return api_->SubmitJob(Identify(*context), *request); });
}

grpc::Status JobServiceImpl::GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request,
                                    v1::Job* response) {
  return Answer(response, [&] { return api_->GetJob(Identify(*context), *request); });
}

grpc::Status JobServiceImpl::ListJobs(grpc::ServerContext* context,
                                      const v1::ListJobsRequest* request,
                                      v1::ListJobsResponse* response) {
  return Answer(response, [&] { return api_->ListJobs(Identify(*context), *request); });
}

grpc::Status JobServiceImpl::CancelJob(grpc::ServerContext* context,
                                       const v1::JobActionRequest* request, v1::Job* response) {
  return Answer(response, [&] { return api_->CancelJob(Identify(*context), *request); });
}

grpc::Status JobServiceImpl::PauseJob(grpc::ServerContext* context,
                                      const v1::JobActionRequest* request, v1::Job* response) {
  return Answer(response, [&] { return api_->PauseJob(Identify(*context), *request); });
}

grpc::Status JobServiceImpl::ResumeJob(grpc::ServerContext* context,
                                       const v1::JobActionRequest* request, v1::Job* response) {
  return Answer(response, [&] { return api_->ResumeJob(Identify(*context), *request); });
}

grpc::Status JobServiceImpl::CheckpointJob(grpc::ServerContext* context,
                                           const v1::JobActionRequest* request, v1::Job* response) {
  return Answer(response, [&] { return api_->CheckpointJob(Identify(*context), *request); });
}

grpc::Status JobServiceImpl::ListJobEvents(grpc::ServerContext* context,
                                           const v1::ListJobEventsRequest* request,
                                           v1::ListJobEventsResponse* response) {
  return Answer(response, [&] { return api_->ListJobEvents(Identify(*context), *request); });
}

grpc::Status JobServiceImpl::ListAudit(grpc::ServerContext* context,
                                       const v1::ListAuditRequest* request,
                                       v1::ListAuditResponse* response) {
  return Answer(response, [&] { return api_->ListAudit(Identify(*context), *request); });
}

grpc::Status WorkerServiceImpl::RegisterWorker(grpc::ServerContext* context,
                                               const v1::RegisterWorkerRequest* request,
                                               v1::RegisterWorkerResponse* response) {
  return Serve(*tokens_, *context, response, [&] { return controller_->RegisterWorker(*request); });
}

grpc::Status WorkerServiceImpl::Heartbeat(grpc::ServerContext* context,
                                          const v1::HeartbeatRequest* request,
                                          v1::HeartbeatResponse* response) {
  return Serve(*tokens_, *context, response, [&] { return controller_->Heartbeat(*request); });
}

grpc::Status WorkerServiceImpl::ReportProgress(grpc::ServerContext* context,
                                               const v1::ProgressReport* request,
                                               v1::ProgressReply* response) {
  return Serve(*tokens_, *context, response, [&] { return controller_->ReportProgress(*request); });
}

grpc::Status WorkerServiceImpl::RendezvousSet(grpc::ServerContext* context,
                                              const v1::RendezvousSetRequest* request,
                                              v1::RendezvousSetResponse* response) {
  return Serve(*tokens_, *context, response, [&] { return controller_->RendezvousSet(*request); });
}

grpc::Status WorkerServiceImpl::RendezvousGet(grpc::ServerContext* context,
                                              const v1::RendezvousGetRequest* request,
                                              v1::RendezvousGetResponse* response) {
  return Serve(*tokens_, *context, response, [&] {
    // No use waiting past the caller's own deadline: it has stopped listening by then.
    v1::RendezvousGetRequest bounded = *request;
    const absl::Duration left = absl::FromChrono(context->deadline()) - absl::Now();
    if (left < absl::Hours(1)) {
      const uint32_t left_ms =
          static_cast<uint32_t>(std::max<int64_t>(1, absl::ToInt64Milliseconds(left)));
      if (bounded.timeout_ms() == 0 || left_ms < bounded.timeout_ms()) {
        bounded.set_timeout_ms(left_ms);
      }
    }
    return controller_->RendezvousGet(bounded);
  });
}

}  // namespace offload
