// The job controller (ARCHITECTURE.md section 7): the jobs and their state machine, the worker pool
// (registration, heartbeats, assignment of attempts), progress from the trainers, the rendezvous
// store of each attempt, and the durable store every change goes through before a call returns.
#ifndef OFFLOAD_SERVICES_JOB_CONTROLLER_JOB_CONTROLLER_H_
#define OFFLOAD_SERVICES_JOB_CONTROLLER_JOB_CONTROLLER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "offload/v1/job.pb.h"
#include "offload/v1/worker.pb.h"
#include "services/job_controller/job_api.h"
#include "services/job_controller/job_store.h"
#include "services/job_controller/tenancy/fair_share.h"
#include "services/job_controller/tenancy/identities.h"

namespace offload {

struct JobControllerOptions {
  JobStore* store = nullptr;  // required; outlives the controller
  absl::Duration heartbeat_interval = absl::Seconds(1);
  absl::Duration heartbeat_timeout = absl::Seconds(10);
  // Every timestamp and timeout the controller decides by; tests drive a fake one. Rendezvous
  // waits are real waits and use the real clock.
  std::function<absl::Time()> clock = [] { return absl::Now(); };
  std::string job_id_prefix = "job-";
  // Progress reports are persisted at most this often per job (checkpoints always at once).
  absl::Duration progress_persist_interval = absl::Seconds(1);
  // The tenants' weights and quotas, read at every scheduling pass (so a reload takes effect at
  // the next). nullptr: one tenant, "default", with no quotas. Outlives the controller.
  const Identities* identities = nullptr;
};

class JobController : public JobApi {
 public:
  // Reloads every job of the store. Jobs that were running come back with their worker slots
  // vacant; the workers take them back when they register again, and a slot still vacant a
  // heartbeat_timeout later fails the attempt.
  static absl::StatusOr<std::unique_ptr<JobController>> Create(JobControllerOptions options);
  ~JobController() override;

  // JobApi.
  absl::StatusOr<v1::Job> SubmitJob(const Caller& caller,
                                    const v1::SubmitJobRequest& request) override;
  absl::StatusOr<v1::Job> GetJob(const Caller& caller, const v1::GetJobRequest& request) override;
  absl::StatusOr<v1::ListJobsResponse> ListJobs(const Caller& caller,
                                                const v1::ListJobsRequest& request) override;
  absl::StatusOr<v1::Job> CancelJob(const Caller& caller,
                                    const v1::JobActionRequest& request) override;
  absl::StatusOr<v1::Job> PauseJob(const Caller& caller,
                                   const v1::JobActionRequest& request) override;
  absl::StatusOr<v1::Job> ResumeJob(const Caller& caller,
                                    const v1::JobActionRequest& request) override;
  absl::StatusOr<v1::Job> CheckpointJob(const Caller& caller,
                                        const v1::JobActionRequest& request) override;
  absl::StatusOr<v1::ListJobEventsResponse> ListJobEvents(
      const Caller& caller, const v1::ListJobEventsRequest& request) override;
  absl::StatusOr<v1::ListAuditResponse> ListAudit(const Caller& caller,
                                                  const v1::ListAuditRequest& request) override;

  // The worker protocol of worker.proto.
  absl::StatusOr<v1::RegisterWorkerResponse> RegisterWorker(
      const v1::RegisterWorkerRequest& request);
  // NOT_FOUND "unknown worker; register again" for a worker id this controller does not know.
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request);
  // FAILED_PRECONDITION when the report's attempt is no longer the job's current one: the rank
  // should stop.
  absl::StatusOr<v1::ProgressReply> ReportProgress(const v1::ProgressReport& report);
  absl::StatusOr<v1::RendezvousSetResponse> RendezvousSet(const v1::RendezvousSetRequest& request);
  // Waits (at most 10 minutes) until every key is set.
  absl::StatusOr<v1::RendezvousGetResponse> RendezvousGet(const v1::RendezvousGetRequest& request);

  // Declares workers without a heartbeat for heartbeat_timeout dead, fails attempts whose workers
  // did not come back after a controller restart, persists throttled progress and schedules.
  // The binary calls it every heartbeat_interval; tests call it after moving their clock.
  absl::Status Tick();

  // Wakes every waiting RendezvousGet with UNAVAILABLE, before the server shuts down.
  void Shutdown();

  // What the controller's metrics report (docs/METRICS.md), read when Prometheus scrapes.
  struct Stats {
    std::map<v1::JobState, int> jobs;  // every state but UNSPECIFIED, zeros included
    // Registered workers: [0 trainer, 1 optimizer server][0 idle, 1 busy].
    int workers[2][2] = {};
    uint64_t heartbeat_timeouts[2] = {};  // workers declared dead, by kind as above
    uint64_t attempt_failures = 0;
    uint64_t restarts = 0;
    struct Tenant {
      TenantLoad load;
      double fair_share_deficit = 0;  // entitled share minus dominant share
      uint64_t preemptions = 0;       // of its jobs, ever (kept in the jobs' records)
    };
    std::map<std::string, Tenant> tenants;  // every tenant of the table or of a job
  };
  Stats GetStats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Worker {
    std::string id;
    uint64_t number = 0;  // registration order: the scheduler prefers older workers
    v1::WorkerInfo info;
    absl::Time last_heartbeat;
    // The attempt this worker holds a slot of (job_id empty: none).
    std::string job_id;
    uint32_t attempt = 0;
    uint32_t slot = 0;          // rank, or shard index
    bool delivered = false;     // its Assignment went out in a heartbeat
    absl::Time delivered_at;    // when, for the acknowledgement deadline
    bool acknowledged = false;  // it listed the attempt in `running`
    bool finished = false;      // a trainer that reported its rank's end
    std::optional<v1::Assignment> pending_start;
    std::vector<v1::AttemptRef> pending_stop;
    // Attempts it said it still runs that are not its slot's: it is busy until they are gone.
    std::vector<v1::AttemptRef> other_running;
  };

  struct JobEntry {
    v1::Job job;
    uint64_t next_sequence = 1;
    std::vector<v1::JobEvent> unsaved_events;
    bool dirty = false;           // the stored record is older than `job`
    bool progress_dirty = false;  // only progress changed since the last write
    absl::Time last_persist = absl::InfinitePast();
    // Per attempt: CheckpointJob's counter, and whether the trainers have their Assignments yet
    // (they wait until every optimizer server of the attempt has acknowledged its own).
    uint64_t checkpoint_request = 0;
    bool trainers_released = false;
    // After a controller restart a CHECKPOINTING job asks its trainers for one more checkpoint,
    // since the counter they carried out is not known.
    bool reissue_checkpoint = false;
    // When the vacant slots of the attempt (left by a controller restart, or by a worker whose
    // heartbeat was lost) must be filled again, and why each is vacant ("rank 0" -> the reason).
    absl::Time vacancy_deadline = absl::InfiniteFuture();
    std::map<std::string, std::string> vacancy_reasons;
    // The first progress report of the attempt, for the ETA.
    std::optional<std::pair<absl::Time, uint64_t>> first_report;
    // Its place in the queue: the position in submit_order_.
    uint64_t order = 0;
  };

  using RendezvousKey = std::pair<std::string, uint32_t>;

  explicit JobController(JobControllerOptions options);
  absl::Status Load();

  absl::StatusOr<JobEntry*> FindJob(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The same for a caller: another tenant's job is NOT_FOUND with the same message as a job that
  // does not exist (`*foreign` says which it was, for the audit log).
  absl::StatusOr<JobEntry*> FindJobFor(const Caller& caller, const std::string& id, bool* foreign)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes one record of the audit log; a failed write is logged, and does not undo the call.
  void Audit(const Caller& caller, absl::string_view action, const std::string& job_id,
             const absl::Status& outcome);
  // A read is audited only when refused: UNAUTHENTICATED, recorded, for a caller without a valid
  // token.
  absl::Status AdmitRead(const Caller& caller, absl::string_view action, const std::string& job_id);
  // The tenants' table: weights and quotas (an empty one without identities).
  std::shared_ptr<const TenantTable> Tenants() const;
  // Records an event with the job's current state and attempt.
  void AddEvent(JobEntry& entry, std::string message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status SetState(JobEntry& entry, v1::JobState to, std::string reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes every job with unwritten changes; the first error, the others still tried.
  absl::Status PersistDirty() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Persist(JobEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies a user's action and keeps it only once it is stored.
  absl::StatusOr<v1::Job> Act(const Caller& caller, absl::string_view name,
                              const v1::JobActionRequest& request,
                              const std::function<absl::Status(JobEntry&)>& action)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Starts pending jobs on free workers, the tenant furthest below its fair share first, then by
  // priority, then by age; then preempts for the most urgent job that still cannot start.
  void Schedule() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What each tenant's jobs hold and wait for.
  std::map<std::string, TenantLoad> Loads() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  PoolSize Pool(absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Asks running jobs of lower priority to checkpoint and stop when the most urgent pending job
  // cannot start on the free workers and those already being released.
  // `loads` and `pool` as Schedule leaves them.
  void Preempt(absl::Time now, const TenantTable& tenants,
               const std::map<std::string, TenantLoad>& loads, const PoolSize& pool)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The attempt of `victim` ends for `for_job`: at once when no rank has started, else its
  // trainers are asked to checkpoint and stop.
  void PreemptJob(JobEntry& victim, const v1::Job& for_job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A worker of the current attempt lost its heartbeat: its slot waits twice the heartbeat timeout
  // for it to register again (a cut link, not a death) before the attempt fails.
  void VacateSlot(JobEntry& entry, const Worker& worker, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartAttempt(JobEntry& entry, const std::vector<Worker*>& trainers,
                    const std::vector<Worker*>& servers) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Carries the attempt's shard secret (worker.proto), derived from attempt_key_.
  v1::Assignment MakeAssignment(const v1::Job& job, v1::WorkerKind kind, uint32_t slot) const;
  // Hands the trainers their Assignments once every server of the attempt acknowledged its own.
  void MaybeReleaseTrainers(JobEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Clears what belongs to one attempt, so a new attempt never inherits the last one's state.
  static void ResetAttempt(JobEntry& entry);
  // Frees the attempt's workers (queueing the stops they need) and drops its rendezvous.
  void EndAttempt(JobEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The attempt ended in `to` (SUCCEEDED, PAUSED, CANCELLED).
  void FinishAttempt(JobEntry& entry, v1::JobState to, std::string reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The attempt failed: restart from the last checkpoint if the spec allows, else FAILED.
  void FailAttempt(JobEntry& entry, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnAttemptResult(Worker& worker, const v1::AttemptResult& result)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TakeBack(Worker& worker, const v1::Assignment& running) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Whether any rank of the attempt got its Assignment (and so can hear a request).
  bool TrainersStarted(const JobEntry& entry) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool IsCurrent(const JobEntry& entry, uint32_t attempt) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool IsLive(const Worker& worker, absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool IsFree(const Worker& worker, absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string Describe(const Worker& worker) const;

  const JobControllerOptions options_;
  const absl::Time started_;
  const std::string worker_id_tag_;
  // The store's key for attempt secrets (JobStore::AttemptKey), read once at Create.
  std::string attempt_key_;

  mutable absl::Mutex mu_;
  absl::CondVar rendezvous_changed_;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, JobEntry> jobs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> submit_order_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Worker> workers_ ABSL_GUARDED_BY(mu_);
  // Since this process started (Prometheus handles the reset at a restart).
  uint64_t heartbeat_timeouts_[2] ABSL_GUARDED_BY(mu_) = {};
  uint64_t attempt_failures_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t restarts_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_worker_number_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<RendezvousKey, std::map<std::string, std::string>> rendezvous_ ABSL_GUARDED_BY(mu_);
};

// The model's flat parameter space split for the spec's ranks and optimizer servers
// (ARCHITECTURE.md section 3), with gpu_trainer's defaults for unset fields. INVALID_ARGUMENT
// naming the field.
absl::StatusOr<v1::PartitionMap> PartitionForSpec(const v1::JobSpec& spec);

}  // namespace offload

#endif  // OFFLOAD_SERVICES_JOB_CONTROLLER_JOB_CONTROLLER_H_
