#include "jobs/worker/worker_agent.h"

#include <algorithm>
#include <cstdio>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/grpc_status.h"
#include "base/logging.h"
#include "base/metrics/metrics.h"
#include "base/security/security.h"

namespace offload {
namespace {

// docs/METRICS.md, "Pool workers". Process-wide: a process may run several agents (gpu_trainer
// --workers), so the gauges count them, each agent moving them by one when its own state changes.
struct WorkerMetrics {
  prometheus::Gauge& registered;
  prometheus::Gauge& busy;
  prometheus::Counter& assignments;
  prometheus::Counter& heartbeat_failures;

  static WorkerMetrics& Get() {
    static WorkerMetrics* m =
        new WorkerMetrics{prometheus::BuildGauge()
                              .Name("offload_worker_registered")
                              .Help("Workers of this process registered with the job controller.")
                              .Register(MetricsRegistry())
                              .Add({}),
                          prometheus::BuildGauge()
                              .Name("offload_worker_busy")
                              .Help("Workers of this process running an assignment.")
                              .Register(MetricsRegistry())
                              .Add({}),
                          prometheus::BuildCounter()
                              .Name("offload_worker_assignments_total")
                              .Help("Assignments this worker has started.")
                              .Register(MetricsRegistry())
                              .Add({}),
                          prometheus::BuildCounter()
                              .Name("offload_worker_heartbeat_failures_total")
                              .Help("Heartbeats that did not reach the job controller.")
                              .Register(MetricsRegistry())
                              .Add({})};
    return *m;
  }
};

}  // namespace
namespace {

void SetDeadline(grpc::ClientContext* context, absl::Duration timeout) {
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

bool SameAttempt(const v1::AttemptRef& a, const v1::AttemptRef& b) {
  return a.job_id() == b.job_id() && a.attempt() == b.attempt();
}

v1::AttemptRef RefOf(const v1::Assignment& a) {
  v1::AttemptRef ref;
  ref.set_job_id(a.job_id());
  ref.set_attempt(a.attempt());
  return ref;
}

// The attempt no longer runs here, whether it ended or the controller withdrew it.
void ForgetAttempt(std::vector<v1::Assignment>* running, const v1::AttemptRef& ref) {
  running->erase(
      std::remove_if(running->begin(), running->end(),
                     [&](const v1::Assignment& a) { return SameAttempt(RefOf(a), ref); }),
      running->end());
}

// Moves `gauge` by one when *state changes to `now`.
void Track(prometheus::Gauge& gauge, bool* state, bool now) {
  if (*state == now) return;
  *state = now;
  if (now) {
    gauge.Increment();
  } else {
    gauge.Decrement();
  }
}

}  // namespace

WorkerAgent::WorkerAgent(WorkerAgentOptions options, WorkerHooks hooks)
    : options_(std::move(options)),
      hooks_(std::move(hooks)),
      stub_(v1::WorkerService::NewStub(options_.channel)) {}

absl::StatusOr<std::unique_ptr<WorkerAgent>> WorkerAgent::Start(WorkerAgentOptions options,
                                                                WorkerHooks hooks) {
  if (options.channel == nullptr) return absl::InvalidArgumentError("the worker needs a channel");
  std::unique_ptr<WorkerAgent> agent(new WorkerAgent(std::move(options), std::move(hooks)));
  const absl::Time deadline = absl::Now() + agent->options_.connect_timeout;
  for (;;) {
    absl::Status s = agent->Register();
    if (s.ok()) break;
    // Only an unreachable controller is worth waiting for; a refusal (a bad token) is final.
    if (s.code() != absl::StatusCode::kUnavailable &&
        s.code() != absl::StatusCode::kDeadlineExceeded) {
      return absl::Status(s.code(), absl::StrCat("registering with the job controller at ",
                                                 agent->options_.controller, ": ", s.message()));
    }
    if (absl::Now() >= deadline) {
      return absl::UnavailableError(
          absl::StrCat("the job controller at ", agent->options_.controller, " did not answer in ",
                       absl::FormatDuration(agent->options_.connect_timeout), ": ", s.message()));
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  agent->thread_ = std::thread([a = agent.get()] { a->Loop(); });
  return agent;
}

WorkerAgent::~WorkerAgent() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
  absl::MutexLock lock(&mu_);
  Track(WorkerMetrics::Get().registered, &registered_, false);
  Track(WorkerMetrics::Get().busy, &busy_, false);
}

std::string WorkerAgent::worker_id() const {
  absl::MutexLock lock(&mu_);
  return worker_id_;
}

void WorkerAgent::Finished(v1::AttemptResult result) {
  absl::MutexLock lock(&mu_);
  for (const v1::Assignment& a : running_) {
    if (SameAttempt(RefOf(a), result.attempt())) unreported_.push_back(a);
  }
  ForgetAttempt(&running_, result.attempt());
  Track(WorkerMetrics::Get().busy, &busy_, !running_.empty());
  finished_.push_back(std::move(result));
}

void WorkerAgent::Drain(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto sent = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return finished_.empty(); };
  mu_.AwaitWithTimeout(absl::Condition(&sent), timeout);
}

absl::Status WorkerAgent::Register() {
  v1::RegisterWorkerRequest request;
  *request.mutable_worker() = options_.info;
  {
    absl::MutexLock lock(&mu_);
    for (const v1::Assignment& a : running_) *request.add_running() = a;
    for (const v1::Assignment& a : unreported_) *request.add_running() = a;
  }
  v1::RegisterWorkerResponse response;
  grpc::ClientContext context;
  SetDeadline(&context, options_.call_timeout);
  AttachBearer(&context, options_.token);
  grpc::Status s = stub_->RegisterWorker(&context, request, &response);
  absl::MutexLock lock(&mu_);
  Track(WorkerMetrics::Get().registered, &registered_, s.ok());
  if (!s.ok()) return FromGrpcStatus(s);
  worker_id_ = response.worker_id();
  if (response.heartbeat_interval_ms() > 0) {
    interval_ = absl::Milliseconds(response.heartbeat_interval_ms());
  }
  beat_timeout_ = options_.call_timeout;
  if (response.heartbeat_timeout_ms() > 0) {
    beat_timeout_ =
        std::min(beat_timeout_, absl::Milliseconds(response.heartbeat_timeout_ms()) / 2);
  }
  return absl::OkStatus();
}

void WorkerAgent::Loop() {
  for (;;) {
    absl::Duration interval;
    {
      absl::MutexLock lock(&mu_);
      interval = interval_;
      // Wakes early only to stop; results wait for the next beat, which is soon enough.
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), interval);
      if (stopping_) return;
    }
    HeartbeatOnce();
  }
}

void WorkerAgent::HeartbeatOnce() {
  v1::HeartbeatRequest request;
  size_t num_finished;
  absl::Duration timeout;
  {
    absl::MutexLock lock(&mu_);
    timeout = beat_timeout_;
    request.set_worker_id(worker_id_);
    for (const v1::Assignment& a : running_) *request.add_running() = RefOf(a);
    for (const v1::AttemptResult& r : finished_) *request.add_finished() = r;
    num_finished = finished_.size();
  }
  v1::HeartbeatResponse response;
  grpc::ClientContext context;
  SetDeadline(&context, timeout);
  AttachBearer(&context, options_.token);
  grpc::Status s = stub_->Heartbeat(&context, request, &response);
  if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
    // The controller restarted (or declared this worker dead): join again with what still runs.
    absl::Status r = Register();
    LOG(WARNING) << absl::StrFormat(
        "worker %s: the job controller lost this worker; registering again: %s",
        options_.info.name().c_str(), r.ok() ? "ok" : r.ToString().c_str());
    return;
  }
  if (!s.ok()) {
    WorkerMetrics::Get().heartbeat_failures.Increment();
    absl::MutexLock lock(&mu_);
    if (!unreachable_) {
      LOG(WARNING) << absl::StrFormat("worker %s: heartbeat to %s failed (%s); retrying",
                                      options_.info.name().c_str(), options_.controller.c_str(),
                                      s.error_message().c_str());
      unreachable_ = true;
    }
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    if (unreachable_) {
      LOG(INFO) << absl::StrFormat("worker %s: the job controller answers again",
                                   options_.info.name().c_str());
      unreachable_ = false;
    }
    // Results queued while this beat was in flight stay for the next one.
    for (size_t i = 0; i < num_finished; ++i) {
      const v1::AttemptRef& done = finished_[i].attempt();
      unreported_.erase(
          std::remove_if(unreported_.begin(), unreported_.end(),
                         [&](const v1::Assignment& a) { return SameAttempt(RefOf(a), done); }),
          unreported_.end());
    }
    finished_.erase(finished_.begin(), finished_.begin() + num_finished);
  }
  for (const v1::AttemptRef& ref : response.stop()) {
    {
      absl::MutexLock lock(&mu_);
      ForgetAttempt(&running_, ref);
      Track(WorkerMetrics::Get().busy, &busy_, !running_.empty());
    }
    if (hooks_.stop) hooks_.stop(ref);
  }
  for (const v1::Assignment& a : response.start()) {
    {
      absl::MutexLock lock(&mu_);
      running_.push_back(a);
      Track(WorkerMetrics::Get().busy, &busy_, true);
    }
    WorkerMetrics::Get().assignments.Increment();
    if (hooks_.start) hooks_.start(a);
  }
}

}  // namespace offload
