#include "services/job_controller/job_controller.h"

#include <algorithm>
#include <set>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "jobs/spec/job_spec.h"
#include "model_spec/gpt2_config.h"
#include "model_spec/model_preset.h"
#include "model_spec/param_layout.h"
#include "model_spec/partition.h"
#include "services/job_controller/job_state.h"
#include "services/job_controller/pool/job_facts.h"

namespace offload {
namespace {

constexpr uint32_t kMaxListPageSize = 1000;
constexpr uint32_t kDefaultListPageSize = 100;
// Far above any real pool, low enough that the partition arithmetic stays in int.
constexpr uint32_t kMaxRanks = 65536;
constexpr uint32_t kMaxOptimizerServers = 65536;
constexpr size_t kMaxAuditMessage = 512;

std::string WithReason(absl::string_view what, const std::string& reason) {
  return reason.empty() ? std::string(what) : absl::StrCat(what, ": ", reason);
}

}  // namespace

absl::StatusOr<v1::PartitionMap> PartitionForSpec(const v1::JobSpec& spec) {
  if (spec.has_torch()) {
    // The script's model is unknown until it runs: its front end lays the parameters out on the
    // servers itself (CreateJob), so the map says only how many ranks and shards there are.
    v1::PartitionMap map;
    map.set_world_size(Ranks(spec));
    map.set_num_shards(OptimizerServers(spec));
    return map;
  }
  const v1::ModelSpec& m = spec.model();
  ModelShape shape;  // the shape gpu_trainer makes of the flags this spec becomes
  if (m.has_preset()) shape.preset = m.preset();
  shape.vocab = m.has_vocab() ? m.vocab() : 0;
  shape.layers = m.layers();
  shape.heads = m.heads();
  shape.channels = m.channels();
  shape.context = m.context();
  OFFLOAD_ASSIGN_OR_RETURN(Gpt2Config config,
                           ResolveModel(shape, spec.data().path(), "model.preset", "model"));
  const uint32_t ranks = Ranks(spec);
  const uint32_t servers = OptimizerServers(spec);
  if (ranks < 1 || ranks > kMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("parallel.ranks: must be in [1, ", kMaxRanks, "], got ", ranks));
  }
  if (servers < 1 || servers > kMaxOptimizerServers) {
    return absl::InvalidArgumentError(absl::StrCat("parallel.optimizer_servers: must be in [1, ",
                                                   kMaxOptimizerServers, "], got ", servers));
  }
  absl::StatusOr<v1::PartitionMap> map =
      MakePartitionMap(Gpt2NumParams(config), static_cast<int>(ranks), static_cast<int>(servers));
  if (!map.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("parallel.optimizer_servers: ", map.status().message()));
  }
  return map;
}

JobController::JobController(JobControllerOptions options)
    : options_(std::move(options)),
      started_(options_.clock()),
      // Worker ids must not repeat across controller restarts, or a worker of the previous run
      // could heartbeat as somebody else: the real start time tags this run's ids.
      worker_id_tag_(absl::StrCat(absl::Hex(absl::ToUnixMillis(absl::Now()) & 0xffffff))) {}

JobController::~JobController() { Shutdown(); }

absl::StatusOr<std::unique_ptr<JobController>> JobController::Create(JobControllerOptions options) {
  if (options.store == nullptr) return absl::InvalidArgumentError("JobController needs a store");
  if (options.heartbeat_interval <= absl::ZeroDuration() ||
      options.heartbeat_timeout <= options.heartbeat_interval) {
    return absl::InvalidArgumentError(
        "the heartbeat timeout must be longer than the heartbeat interval, and both > 0");
  }
  std::unique_ptr<JobController> controller(new JobController(std::move(options)));
  OFFLOAD_ASSIGN_OR_RETURN(controller->attempt_key_, controller->options_.store->AttemptKey());
  OFFLOAD_RETURN_IF_ERROR(controller->Load());
  return controller;
}

absl::Status JobController::Load() {
  absl::MutexLock lock(&mu_);
  OFFLOAD_ASSIGN_OR_RETURN(std::vector<v1::Job> jobs, options_.store->LoadJobs());
  for (v1::Job& job : jobs) {
    const std::string id = job.id();
    absl::StatusOr<uint64_t> last_sequence = options_.store->LastSequence(id);
    if (!last_sequence.ok()) return last_sequence.status();
    JobEntry& entry = jobs_[id];
    entry.job = std::move(job);
    entry.next_sequence = *last_sequence + 1;
    entry.last_persist = started_;
    entry.order = submit_order_.size();
    submit_order_.push_back(id);
    if (!IsActive(entry.job.state())) continue;
    // The workers are not durable: the attempt waits for them to register again.
    for (std::string& worker : *entry.job.mutable_trainer_workers()) worker.clear();
    for (std::string& worker : *entry.job.mutable_server_workers()) worker.clear();
    entry.trainers_released = true;
    entry.reissue_checkpoint = entry.job.state() == v1::JOB_STATE_CHECKPOINTING;
    entry.vacancy_deadline = started_ + options_.heartbeat_timeout;
    AddEvent(entry, absl::StrCat("the controller restarted; attempt ", entry.job.attempt(),
                                 " waits for its workers to register again"));
  }
  return PersistDirty();
}

absl::StatusOr<JobController::JobEntry*> JobController::FindJob(const std::string& id) {
  if (id.empty()) return absl::InvalidArgumentError("id: a job id is required");
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("job ", id, " not found"));
  return &it->second;
}

absl::StatusOr<JobController::JobEntry*> JobController::FindJobFor(const Caller& caller,
                                                                   const std::string& id,
                                                                   bool* foreign) {
  *foreign = false;
  OFFLOAD_ASSIGN_OR_RETURN(JobEntry * entry, FindJob(id));
  if (!caller.admin && TenantOf(entry->job) != caller.tenant) {
    *foreign = true;
    return absl::NotFoundError(absl::StrCat("job ", id, " not found"));
  }
  return entry;
}

void JobController::Audit(const Caller& caller, absl::string_view action, const std::string& job_id,
                          const absl::Status& outcome) {
  v1::AuditRecord record;
  SetTimestamp(options_.clock(), record.mutable_time());
  record.set_tenant(caller.tenant);
  record.set_admin(caller.admin);
  record.set_action(std::string(action));
  record.set_job_id(job_id.substr(0, kMaxAuditMessage));
  record.set_code(absl::StatusCodeToString(outcome.code()));
  record.set_message(std::string(outcome.message().substr(0, kMaxAuditMessage)));
  LogError(options_.store->AppendAudit(record).status());
}

std::shared_ptr<const TenantTable> JobController::Tenants() const {
  if (options_.identities != nullptr) return options_.identities->table();
  static const auto* const kEmpty = new std::shared_ptr<const TenantTable>(new TenantTable());
  return *kEmpty;
}

void JobController::AddEvent(JobEntry& entry, std::string message) {
  const absl::Time now = options_.clock();
  v1::JobEvent& event = entry.unsaved_events.emplace_back();
  event.set_sequence(entry.next_sequence++);
  event.set_job_id(entry.job.id());
  SetTimestamp(now, event.mutable_time());
  event.set_state(entry.job.state());
  event.set_attempt(entry.job.attempt());
  event.set_message(std::move(message));
  SetTimestamp(now, entry.job.mutable_update_time());
  entry.dirty = true;
}

absl::Status JobController::SetState(JobEntry& entry, v1::JobState to, std::string reason) {
  if (absl::Status s = CheckTransition(entry.job.state(), to); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("job ", entry.job.id(), ": ", s.message()));
  }
  entry.job.set_state(to);
  entry.job.set_reason(std::move(reason));
  SetTimestamp(options_.clock(), entry.job.mutable_update_time());
  entry.dirty = true;
  return absl::OkStatus();
}

absl::Status JobController::Persist(JobEntry& entry) {
  if (!entry.dirty) return absl::OkStatus();
  OFFLOAD_RETURN_IF_ERROR(options_.store->Commit(entry.job, entry.unsaved_events));
  entry.unsaved_events.clear();
  entry.dirty = false;
  entry.progress_dirty = false;
  entry.last_persist = options_.clock();
  return absl::OkStatus();
}

absl::Status JobController::PersistDirty() {
  absl::Status first;
  for (auto& [id, entry] : jobs_) first.Update(Persist(entry));
  return first;
}

bool JobController::IsCurrent(const JobEntry& entry, uint32_t attempt) const {
  return IsActive(entry.job.state()) && entry.job.attempt() == attempt;
}

bool JobController::IsLive(const Worker& worker, absl::Time now) const {
  return now - worker.last_heartbeat <= options_.heartbeat_timeout;
}

bool JobController::IsFree(const Worker& worker, absl::Time now) const {
  return worker.job_id.empty() && worker.other_running.empty() && IsLive(worker, now);
}

std::string JobController::Describe(const Worker& worker) const {
  return worker.info.name().empty() ? worker.id
                                    : absl::StrCat(worker.id, " (", worker.info.name(), ")");
}

// ---------------------------------------------------------------------------------------------
// The job API.

namespace {

// UNAUTHENTICATED for a caller whose call carried no token the controller accepts.
absl::Status Admit(const Caller& caller) {
  if (caller.authenticated) return absl::OkStatus();
  return absl::UnauthenticatedError("missing or invalid bearer token");
}

}  // namespace

absl::StatusOr<v1::Job> JobController::SubmitJob(const Caller& caller,
                                                 const v1::SubmitJobRequest& request) {
  std::string tenant = request.spec().tenant().empty() ? caller.tenant : request.spec().tenant();
  absl::StatusOr<v1::Job> submitted = [&]() -> absl::StatusOr<v1::Job> {
    OFFLOAD_RETURN_IF_ERROR(Admit(caller));
    const v1::JobSpec& spec = request.spec();
    if (absl::Status s = ValidateJobSpec(spec); !s.ok()) {
      return absl::InvalidArgumentError(s.message());
    }
    if (tenant != caller.tenant && !caller.admin) {
      return absl::PermissionDeniedError(
          absl::StrCat("tenant: tenant ", caller.tenant, " cannot submit jobs for another tenant"));
    }
    const std::shared_ptr<const TenantTable> tenants = Tenants();
    if (tenant != kOperatorTenant && tenants->Find(tenant) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("tenant: unknown tenant '", tenant, "'"));
    }
    if (std::string never =
            QuotaNeverFits(QuotaOf(*tenants, tenant), Ranks(spec), OptimizerServers(spec));
        !never.empty()) {
      return absl::InvalidArgumentError(never);
    }
    OFFLOAD_ASSIGN_OR_RETURN(v1::PartitionMap partition, PartitionForSpec(spec));

    absl::MutexLock lock(&mu_);
    absl::StatusOr<uint64_t> number = options_.store->NextJobNumber();
    if (!number.ok()) return number.status();
    JobEntry entry;
    v1::Job& job = entry.job;
    job.set_id(absl::StrCat(options_.job_id_prefix, *number));
    *job.mutable_spec() = spec;
    job.set_tenant(tenant);
    job.set_state(v1::JOB_STATE_PENDING);
    job.set_reason(WaitingReason(spec));
    *job.mutable_partition() = std::move(partition);
    if (spec.training().has_steps()) {
      job.mutable_progress()->set_total_steps(static_cast<uint64_t>(spec.training().steps()));
    }
    AddEvent(entry, spec.name().empty() ? "submitted" : absl::StrCat("submitted: ", spec.name()));
    *job.mutable_create_time() = job.update_time();
    // Stored before it exists here: a failed write leaves no job behind for a retry to duplicate.
    OFFLOAD_RETURN_IF_ERROR(Persist(entry));
    const std::string id = job.id();
    entry.order = submit_order_.size();
    jobs_[id] = std::move(entry);
    submit_order_.push_back(id);
    Schedule();
    LogError(PersistDirty());
    return jobs_[id].job;
  }();
  Audit(caller, "submit", submitted.ok() ? submitted->id() : "", submitted.status());
  return submitted;
}

absl::Status JobController::AdmitRead(const Caller& caller, absl::string_view action,
                                      const std::string& job_id) {
  absl::Status admitted = Admit(caller);
  if (!admitted.ok()) Audit(caller, action, job_id, admitted);
  return admitted;
}

absl::StatusOr<v1::Job> JobController::GetJob(const Caller& caller,
                                              const v1::GetJobRequest& request) {
  OFFLOAD_RETURN_IF_ERROR(AdmitRead(caller, "get", request.id()));
  bool foreign = false;
  absl::StatusOr<v1::Job> job = [&]() -> absl::StatusOr<v1::Job> {
    absl::MutexLock lock(&mu_);
    OFFLOAD_ASSIGN_OR_RETURN(JobEntry * entry, FindJobFor(caller, request.id(), &foreign));
    return entry->job;
  }();
  if (foreign) Audit(caller, "get", request.id(), job.status());
  return job;
}

absl::StatusOr<v1::ListJobsResponse> JobController::ListJobs(const Caller& caller,
                                                             const v1::ListJobsRequest& request) {
  OFFLOAD_RETURN_IF_ERROR(AdmitRead(caller, "list", ""));
  const uint32_t page_size = request.page_size() == 0
                                 ? kDefaultListPageSize
                                 : std::min(request.page_size(), kMaxListPageSize);
  uint64_t offset = 0;
  if (!request.page_token().empty() && !absl::SimpleAtoi(request.page_token(), &offset)) {
    return absl::InvalidArgumentError("page_token: not a token from a previous ListJobs response");
  }
  const std::set<int> states(request.states().begin(), request.states().end());
  v1::ListJobsResponse response;
  absl::MutexLock lock(&mu_);
  uint64_t matched = 0;
  for (auto it = submit_order_.rbegin(); it != submit_order_.rend(); ++it) {
    const v1::Job& job = jobs_.at(*it).job;
    if (!caller.admin && TenantOf(job) != caller.tenant) continue;
    if (!states.empty() && states.count(job.state()) == 0) continue;
    if (matched++ < offset) continue;
    if (static_cast<uint32_t>(response.jobs_size()) == page_size) {
      response.set_next_page_token(absl::StrCat(offset + page_size));
      break;
    }
    *response.add_jobs() = job;
  }
  return response;
}

absl::StatusOr<v1::Job> JobController::Act(const Caller& caller, absl::string_view name,
                                           const v1::JobActionRequest& request,
                                           const std::function<absl::Status(JobEntry&)>& action) {
  absl::StatusOr<v1::Job> result = [&]() -> absl::StatusOr<v1::Job> {
    OFFLOAD_RETURN_IF_ERROR(Admit(caller));
    absl::MutexLock lock(&mu_);
    bool foreign = false;
    OFFLOAD_ASSIGN_OR_RETURN(JobEntry * found, FindJobFor(caller, request.id(), &foreign));
    JobEntry& entry = *found;
    // An action touches the job and at most the workers of its attempt: both are put back as they
    // were when it fails or cannot be stored, so a refused request leaves no trace.
    const JobEntry saved = entry;
    std::vector<Worker> saved_workers;
    for (const auto* ids : {&entry.job.trainer_workers(), &entry.job.server_workers()}) {
      for (const std::string& id : *ids) {
        if (auto it = workers_.find(id); it != workers_.end()) saved_workers.push_back(it->second);
      }
    }
    absl::Status s = action(entry);
    if (s.ok()) s = Persist(entry);
    if (!s.ok()) {
      entry = saved;
      for (Worker& worker : saved_workers) workers_[worker.id] = std::move(worker);
      return s;
    }
    Schedule();
    LogError(PersistDirty());
    return entry.job;
  }();
  Audit(caller, name, request.id(), result.status());
  return result;
}

bool JobController::TrainersStarted(const JobEntry& entry) const {
  for (const std::string& id : entry.job.trainer_workers()) {
    auto it = workers_.find(id);
    if (it != workers_.end() && it->second.delivered) return true;
  }
  return false;
}

absl::StatusOr<v1::Job> JobController::CancelJob(const Caller& caller,
                                                 const v1::JobActionRequest& request) {
  return Act(
      caller, "cancel", request,
      [&](JobEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
        const v1::JobState state = entry.job.state();
        if (state == v1::JOB_STATE_PENDING || state == v1::JOB_STATE_PAUSED) {
          const std::string why = WithReason("cancelled", request.reason());
          OFFLOAD_RETURN_IF_ERROR(SetState(entry, v1::JOB_STATE_CANCELLED, why));
          AddEvent(entry, why);
          return absl::OkStatus();
        }
        if (IsActive(state) && !TrainersStarted(entry)) {
          // No rank runs yet that could hear the request: the attempt ends here.
          FinishAttempt(entry, v1::JOB_STATE_CANCELLED, WithReason("cancelled", request.reason()));
          return absl::OkStatus();
        }
        if (IsActive(state)) {
          if (entry.job.request() == v1::JOB_REQUEST_CANCEL) return absl::OkStatus();
          // A pending pause is overtaken: cancelling is what the user asks for last.
          entry.job.set_request(v1::JOB_REQUEST_CANCEL);
          AddEvent(entry, WithReason("cancel requested", request.reason()));
          return absl::OkStatus();
        }
        return absl::FailedPreconditionError(
            absl::StrCat("job ", entry.job.id(), " is ", StateName(state), ": nothing to cancel"));
      });
}

absl::StatusOr<v1::Job> JobController::PauseJob(const Caller& caller,
                                                const v1::JobActionRequest& request) {
  return Act(caller, "pause", request,
             [&](JobEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
               const v1::JobState state = entry.job.state();
               if (state == v1::JOB_STATE_PENDING) {
                 const std::string why = WithReason("paused", request.reason());
                 OFFLOAD_RETURN_IF_ERROR(SetState(entry, v1::JOB_STATE_PAUSED, why));
                 AddEvent(entry, why);
                 return absl::OkStatus();
               }
               if (IsActive(state) && !TrainersStarted(entry) &&
                   entry.job.request() != v1::JOB_REQUEST_CANCEL) {
                 FinishAttempt(entry, v1::JOB_STATE_PAUSED, WithReason("paused", request.reason()));
                 return absl::OkStatus();
               }
               if (IsActive(state)) {
                 switch (entry.job.request()) {
                   case v1::JOB_REQUEST_PAUSE:
                     return absl::OkStatus();
                   case v1::JOB_REQUEST_CANCEL:
                     return absl::FailedPreconditionError(
                         absl::StrCat("job ", entry.job.id(), " is being cancelled"));
                   default:
                     break;
                 }
                 entry.job.set_request(v1::JOB_REQUEST_PAUSE);
                 std::string what = WithReason("pause requested", request.reason());
                 if (entry.job.spec().checkpoint().dir().empty()) {
                   absl::StrAppend(&what, " (the job has no checkpoint.dir: a resume starts over)");
                 }
                 AddEvent(entry, std::move(what));
                 return absl::OkStatus();
               }
               return absl::FailedPreconditionError(
                   absl::StrCat("job ", entry.job.id(), " is ", StateName(state),
                                ": only a pending or running job can "
                                "be paused"));
             });
}

absl::StatusOr<v1::Job> JobController::ResumeJob(const Caller& caller,
                                                 const v1::JobActionRequest& request) {
  return Act(caller, "resume", request,
             [&](JobEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
               if (entry.job.state() != v1::JOB_STATE_PAUSED) {
                 return absl::FailedPreconditionError(
                     absl::StrCat("job ", entry.job.id(), " is ", StateName(entry.job.state()),
                                  ": only a paused job can be resumed"));
               }
               const std::string why = WithReason("resumed", request.reason());
               OFFLOAD_RETURN_IF_ERROR(SetState(entry, v1::JOB_STATE_PENDING, why));
               AddEvent(entry, why);
               return absl::OkStatus();
             });
}

absl::StatusOr<v1::Job> JobController::CheckpointJob(const Caller& caller,
                                                     const v1::JobActionRequest& request) {
  return Act(
      caller, "checkpoint", request,
      [&](JobEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
        const v1::Job& job = entry.job;
        if (job.spec().checkpoint().dir().empty()) {
          return absl::FailedPreconditionError(absl::StrCat(
              "job ", job.id(), " has no checkpoint.dir: there is nowhere to write a checkpoint"));
        }
        if (job.state() != v1::JOB_STATE_RUNNING) {
          return absl::FailedPreconditionError(absl::StrCat("job ", job.id(), " is ",
                                                            StateName(job.state()),
                                                            ": only a running job can checkpoint"));
        }
        if (job.request() != v1::JOB_REQUEST_NONE) {
          const char* what = job.request() == v1::JOB_REQUEST_PAUSE     ? "pause"
                             : job.request() == v1::JOB_REQUEST_PREEMPT ? "preemption"
                                                                        : "cancel";
          return absl::FailedPreconditionError(
              absl::StrCat("job ", job.id(), " is stopping (", what, " requested)"));
        }
        const std::string why = WithReason("checkpoint requested", request.reason());
        OFFLOAD_RETURN_IF_ERROR(SetState(entry, v1::JOB_STATE_CHECKPOINTING, why));
        ++entry.checkpoint_request;
        AddEvent(entry, why);
        return absl::OkStatus();
      });
}

absl::StatusOr<v1::ListJobEventsResponse> JobController::ListJobEvents(
    const Caller& caller, const v1::ListJobEventsRequest& request) {
  OFFLOAD_RETURN_IF_ERROR(AdmitRead(caller, "events", request.id()));
  {
    absl::MutexLock lock(&mu_);
    bool foreign = false;
    if (absl::StatusOr<JobEntry*> entry = FindJobFor(caller, request.id(), &foreign); !entry.ok()) {
      if (foreign) Audit(caller, "events", request.id(), entry.status());
      return entry.status();
    }
  }
  // The store serializes its own use: the history is read without holding up the controller.
  absl::StatusOr<std::vector<v1::JobEvent>> events =
      options_.store->Events(request.id(), request.after_sequence());
  if (!events.ok()) return events.status();
  v1::ListJobEventsResponse response;
  for (v1::JobEvent& event : *events) *response.add_events() = std::move(event);
  return response;
}

absl::StatusOr<v1::ListAuditResponse> JobController::ListAudit(
    const Caller& caller, const v1::ListAuditRequest& request) {
  OFFLOAD_RETURN_IF_ERROR(AdmitRead(caller, "audit", ""));
  if (!caller.admin) {
    const absl::Status refused = absl::PermissionDeniedError(
        absl::StrCat("tenant ", caller.tenant, " is not an admin: only admins read the audit log"));
    Audit(caller, "audit", "", refused);
    return refused;
  }
  const uint32_t page_size = request.page_size() == 0
                                 ? kDefaultListPageSize
                                 : std::min(request.page_size(), kMaxListPageSize);
  OFFLOAD_ASSIGN_OR_RETURN(std::vector<v1::AuditRecord> records,
                           options_.store->Audit(request.after_sequence(), page_size));
  v1::ListAuditResponse response;
  for (v1::AuditRecord& record : records) *response.add_records() = std::move(record);
  return response;
}

}  // namespace offload
