#include "jobs/worker/progress_client.h"

#include <utility>

#include "base/grpc_status.h"
#include "base/security/security.h"

namespace offload {

ProgressClient::ProgressClient(std::shared_ptr<grpc::Channel> channel, std::string token,
                               v1::ProgressReport report, absl::Duration interval)
    : stub_(v1::WorkerService::NewStub(std::move(channel))),
      token_(std::move(token)),
      interval_(interval),
      report_(std::move(report)) {
  thread_ = std::thread([this] { Loop(); });
}

ProgressClient::~ProgressClient() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void ProgressClient::Update(const v1::ProgressReport& progress) {
  absl::MutexLock lock(&mu_);
  v1::AttemptRef attempt = report_.attempt();
  const uint32_t rank = report_.rank();
  report_ = progress;
  *report_.mutable_attempt() = attempt;
  report_.set_rank(rank);
}

v1::ProgressReply ProgressClient::reply() const {
  absl::MutexLock lock(&mu_);
  return reply_;
}

absl::Status ProgressClient::Send(absl::Duration timeout) {
  absl::MutexLock send_lock(&send_mu_);
  v1::ProgressReport report;
  {
    absl::MutexLock lock(&mu_);
    report = report_;
  }
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  AttachBearer(&context, token_);
  v1::ProgressReply reply;
  grpc::Status s = stub_->ReportProgress(&context, report, &reply);
  if (!s.ok()) return FromGrpcStatus(s);
  absl::MutexLock lock(&mu_);
  reply_ = reply;
  return absl::OkStatus();
}

absl::Status ProgressClient::Flush(absl::Duration timeout) { return Send(timeout); }

void ProgressClient::Loop() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), interval_);
      if (stopping_) return;
    }
    // Polls even without news: the controller's requests come back in the reply. A failure is
    // only a missed tick (the controller may be restarting); the next one tries again.
    Send(interval_ * 4).IgnoreError();
  }
}

}  // namespace offload
