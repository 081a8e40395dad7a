// ProgressClient: a trainer rank's reports to the job controller (WorkerService.ReportProgress)
// and the controller's requests back (pause, cancel, checkpoint). Reports go from a thread of its
// own, newest first, so a slow or restarting controller never holds up a training step.
#ifndef OFFLOAD_JOBS_WORKER_PROGRESS_CLIENT_H_
#define OFFLOAD_JOBS_WORKER_PROGRESS_CLIENT_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "offload/v1/worker.grpc.pb.h"

namespace offload {

class ProgressClient {
 public:
  // `report` names the attempt and rank; the rest of it is filled by Update.
  ProgressClient(std::shared_ptr<grpc::Channel> channel, std::string token,
                 v1::ProgressReport report, absl::Duration interval = absl::Milliseconds(500));
  ~ProgressClient();  // stops the thread without a last report (Flush sends one)
  ProgressClient(const ProgressClient&) = delete;
  ProgressClient& operator=(const ProgressClient&) = delete;

  // Replaces the report's progress fields (everything but attempt and rank); sent at the next
  // tick. Never blocks on the network.
  void Update(const v1::ProgressReport& progress);
  // The controller's last answer (JOB_REQUEST_NONE before any).
  v1::ProgressReply reply() const;
  // Sends the current report now and waits for the answer, up to `timeout`: the end of a run,
  // so the controller has the last step and checkpoint before the rank exits.
  absl::Status Flush(absl::Duration timeout);

 private:
  absl::Status Send(absl::Duration timeout);
  void Loop();

  std::unique_ptr<v1::WorkerService::Stub> stub_;
  const std::string token_;
  const absl::Duration interval_;
  mutable absl::Mutex mu_;
  v1::ProgressReport report_ ABSL_GUARDED_BY(mu_);
  v1::ProgressReply reply_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Mutex send_mu_;  // one call at a time, in order
  std::thread thread_;
};

}  // namespace offload

#endif  // OFFLOAD_JOBS_WORKER_PROGRESS_CLIENT_H_
