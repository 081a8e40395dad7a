// WorkerAgent: a pool worker's side of the controller's WorkerService (ARCHITECTURE.md section 7).
// It registers, heartbeats on a thread of its own, hands the owner the attempts the controller
// assigns or withdraws, and reports how they ended. It outlives the controller: while the
// controller is unreachable it keeps trying, and when a restarted controller no longer knows it,
// it registers again with what it still runs, so a controller restart costs no running job.
#ifndef OFFLOAD_JOBS_WORKER_WORKER_AGENT_H_
#define OFFLOAD_JOBS_WORKER_WORKER_AGENT_H_

#include <unistd.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "offload/v1/worker.grpc.pb.h"

namespace offload {

// This machine's name for WorkerInfo (every pool worker reports it the same way); "localhost" when
// the system has none to give.
inline std::string ThisHostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

struct WorkerAgentOptions {
  std::string controller;                  // host:port, for messages
  std::shared_ptr<grpc::Channel> channel;  // to the controller (MakeChannel)
  std::string token;                       // bearer token; empty sends none
  v1::WorkerInfo info;
  // How long Start waits for the first registration (the controller may still be starting).
  absl::Duration connect_timeout = absl::Seconds(60);
  absl::Duration call_timeout = absl::Seconds(10);
};

struct WorkerHooks {
  // A new attempt for this worker. Called on the agent's thread; return quickly.
  std::function<void(const v1::Assignment&)> start;
  // The controller withdrew an attempt (restarted, cancelled, failed elsewhere): end it now.
  // Called on the agent's thread; return quickly.
  std::function<void(const v1::AttemptRef&)> stop;
};

class WorkerAgent {
 public:
  // Registers (retrying UNAVAILABLE until connect_timeout), then heartbeats until destroyed.
  static absl::StatusOr<std::unique_ptr<WorkerAgent>> Start(WorkerAgentOptions options,
                                                            WorkerHooks hooks);
  ~WorkerAgent();  // stops the heartbeat thread
  WorkerAgent(const WorkerAgent&) = delete;
  WorkerAgent& operator=(const WorkerAgent&) = delete;

  // The attempt ended on this worker; sent with the next heartbeat (again until one gets through).
  void Finished(v1::AttemptResult result);

  // Waits until every result given to Finished has reached the controller, or `timeout`.
  void Drain(absl::Duration timeout);

  std::string worker_id() const;

 private:
  WorkerAgent(WorkerAgentOptions options, WorkerHooks hooks);
  absl::Status Register() ABSL_LOCKS_EXCLUDED(mu_);
  void Loop();
  void HeartbeatOnce();

  const WorkerAgentOptions options_;
  const WorkerHooks hooks_;
  std::unique_ptr<v1::WorkerService::Stub> stub_;

  mutable absl::Mutex mu_;
  std::string worker_id_ ABSL_GUARDED_BY(mu_);
  absl::Duration interval_ ABSL_GUARDED_BY(mu_) = absl::Seconds(1);
  // A heartbeat's deadline: at most half the controller's heartbeat timeout, so that a beat stuck
  // on a cut link (TCP retransmitting with backoff) gives way to the next one instead of making
  // the outage look twice as long as it was.
  absl::Duration beat_timeout_ ABSL_GUARDED_BY(mu_) = absl::Seconds(10);
  std::vector<v1::Assignment> running_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::AttemptResult> finished_ ABSL_GUARDED_BY(mu_);
  // The assignments of finished_ (attempts that ended here, their results not yet delivered): a
  // registration after losing the controller still claims their slots, so that the result the
  // next heartbeat carries lands on the slot's holder instead of being lost.
  std::vector<v1::Assignment> unreported_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // What this agent adds to the process's offload_worker_registered and _busy gauges.
  bool registered_ ABSL_GUARDED_BY(mu_) = false;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool unreachable_ ABSL_GUARDED_BY(mu_) = false;  // said once per outage, not every heartbeat
  std::thread thread_;
};

}  // namespace offload

#endif  // OFFLOAD_JOBS_WORKER_WORKER_AGENT_H_
