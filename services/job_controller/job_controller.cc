#include "services/job_controller/job_controller.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/logging.h"
#include "base/security/security.h"
#include "base/status_macros.h"
#include "jobs/spec/job_spec.h"
#include "model_spec/gpt2_config.h"
#include "model_spec/model_preset.h"
#include "model_spec/param_layout.h"
#include "model_spec/partition.h"
#include "services/job_controller/job_state.h"

namespace offload {
namespace {

// The index of Stats' per-kind arrays.
int KindIndex(v1::WorkerKind kind) { return kind == v1::WORKER_KIND_OPTIMIZER_SERVER ? 1 : 0; }

// Rendezvous waits are capped so a forgotten rank cannot hold a server thread for ever.
constexpr absl::Duration kMaxRendezvousWait = absl::Minutes(10);
constexpr uint32_t kMaxListPageSize = 1000;
constexpr uint32_t kDefaultListPageSize = 100;
// Far above any real pool, low enough that the partition arithmetic stays in int.
constexpr uint32_t kMaxRanks = 65536;
constexpr uint32_t kMaxOptimizerServers = 65536;

void SetTimestamp(absl::Time t, google::protobuf::Timestamp* out) {
  const int64_t seconds = absl::ToUnixSeconds(t);
  out->set_seconds(seconds);
  out->set_nanos(static_cast<int32_t>((t - absl::FromUnixSeconds(seconds)) / absl::Nanoseconds(1)));
}

uint32_t Ranks(const v1::JobSpec& spec) {
  return spec.parallel().has_ranks() ? spec.parallel().ranks() : 1;
}

uint32_t OptimizerServers(const v1::JobSpec& spec) {
  return spec.parallel().has_optimizer_servers() ? spec.parallel().optimizer_servers() : 1;
}

// Any attempt after the first may have left a checkpoint (one the controller has not heard of
// yet, too), and gpu_trainer refuses to start over a checkpoint without --resume, while --resume
// over an empty directory starts fresh: so later attempts resume whenever there is a directory.
bool ResumesFromCheckpoint(const v1::Job& job) {
  const v1::CheckpointSpec& checkpoint = job.spec().checkpoint();
  if (checkpoint.resume()) return true;
  return !checkpoint.dir().empty() &&
         (job.progress().last_checkpoint_step() > 0 || job.attempt() > 1);
}

v1::AttemptRef Ref(const std::string& job_id, uint32_t attempt) {
  v1::AttemptRef ref;
  ref.set_job_id(job_id);
  ref.set_attempt(attempt);
  return ref;
}

const std::string& TenantOf(const v1::Job& job) {
  static const std::string* const kOperator = new std::string(kOperatorTenant);
  return job.tenant().empty() ? *kOperator : job.tenant();
}

// Jobs without a checkpoint directory are never preempted: they would start over and lose what
// they trained.
bool Preemptible(const v1::Job& job) {
  return (!job.spec().has_preemptible() || job.spec().preemptible()) &&
         !job.spec().checkpoint().dir().empty();
}

// The quotas and weight of `tenant` (not its tokens); one the table does not list has weight 1 and
// no quotas.
v1::TenantConfig QuotaOf(const TenantTable& table, const std::string& tenant) {
  v1::TenantConfig config;
  config.set_name(tenant);
  config.set_weight(1.0);
  if (const v1::TenantConfig* found = table.Find(tenant); found != nullptr) {
    config.set_weight(found->weight());
    config.set_max_optimizer_servers(found->max_optimizer_servers());
    config.set_max_ranks(found->max_ranks());
    config.set_max_running_jobs(found->max_running_jobs());
  }
  return config;
}

std::string WaitingReason(const v1::JobSpec& spec) {
  return absl::StrCat("waiting for ", Ranks(spec), " free trainer(s) and ", OptimizerServers(spec),
                      " free optimizer server(s)");
}

constexpr absl::string_view kQuotaReason = "waiting for quota: ";
constexpr size_t kMaxAuditMessage = 512;

std::string WithReason(absl::string_view what, const std::string& reason) {
  return reason.empty() ? std::string(what) : absl::StrCat(what, ": ", reason);
}

void LogError(const absl::Status& status) {
  if (!status.ok()) LOG(ERROR) << absl::StrFormat("job_controller: %s", status.ToString().c_str());
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

// ---------------------------------------------------------------------------------------------
// Attempts.

std::map<std::string, TenantLoad> JobController::Loads() const {
  std::map<std::string, TenantLoad> loads;
  for (const auto& [id, entry] : jobs_) {
    const v1::Job& job = entry.job;
    if (IsActive(job.state())) {
      TenantLoad& load = loads[TenantOf(job)];
      load.servers += OptimizerServers(job.spec());
      load.ranks += Ranks(job.spec());
      ++load.running_jobs;
    } else if (job.state() == v1::JOB_STATE_PENDING) {
      ++loads[TenantOf(job)].queued_jobs;
    }
  }
  return loads;
}

PoolSize JobController::Pool(absl::Time now) const {
  PoolSize pool;
  for (const auto& [id, worker] : workers_) {
    if (!IsLive(worker, now)) continue;
    ++(worker.info.kind() == v1::WORKER_KIND_TRAINER ? pool.trainers : pool.servers);
  }
  return pool;
}

void JobController::Schedule() {
  const absl::Time now = options_.clock();
  const std::shared_ptr<const TenantTable> tenants = Tenants();
  const PoolSize pool = Pool(now);
  std::map<std::string, TenantLoad> loads = Loads();
  std::vector<Worker*> free_trainers, free_shards;  // oldest first: the scheduler prefers them
  for (auto& [worker_id, worker] : workers_) {
    if (!IsFree(worker, now)) continue;
    (worker.info.kind() == v1::WORKER_KIND_TRAINER ? free_trainers : free_shards)
        .push_back(&worker);
  }
  auto older = [](const Worker* a, const Worker* b) { return a->number < b->number; };
  std::sort(free_trainers.begin(), free_trainers.end(), older);
  std::sort(free_shards.begin(), free_shards.end(), older);
  // Jobs that running jobs were preempted for: they go first, and the workers they wait for are
  // kept for them, or what the preemption freed would go to somebody else.
  std::set<std::string> claims;
  for (const auto& [id, entry] : jobs_) {
    if (!entry.job.preempted_for().empty()) claims.insert(entry.job.preempted_for());
  }
  std::vector<JobEntry*> pending;
  for (const std::string& id : submit_order_) {
    JobEntry& entry = jobs_.at(id);
    if (entry.job.state() == v1::JOB_STATE_PENDING) pending.push_back(&entry);
  }
  // A claimed job that does not fit yet holds back the free workers it will need.
  size_t held_trainers = 0, held_shards = 0;
  for (JobEntry* entry : pending) {
    if (claims.count(entry->job.id()) == 0) continue;
    const uint32_t ranks = Ranks(entry->job.spec());
    const uint32_t servers = OptimizerServers(entry->job.spec());
    if (ranks <= free_trainers.size() && servers <= free_shards.size()) continue;
    held_trainers += std::min<size_t>(ranks, free_trainers.size());
    held_shards += std::min<size_t>(servers, free_shards.size());
  }
  while (true) {
    // The next job to start: of those that fit and are within their tenant's quotas, a claimed
    // one, else the one whose tenant has the smallest weighted dominant share, then the highest
    // priority, then the oldest.
    JobEntry* best = nullptr;
    std::tuple<bool, double, int32_t, uint64_t> best_key;
    // The fitting job of the highest priority (then the oldest): it goes instead of `best` when it
    // could preempt `best` at once, or `best` would start only to be stopped again.
    JobEntry* urgent = nullptr;
    for (JobEntry* entry : pending) {
      v1::Job& job = entry->job;
      if (job.state() != v1::JOB_STATE_PENDING) continue;
      const std::string& tenant = TenantOf(job);
      const v1::TenantConfig quota = QuotaOf(*tenants, tenant);
      const uint32_t ranks = Ranks(job.spec());
      const uint32_t servers = OptimizerServers(job.spec());
      if (std::string block = QuotaBlock(quota, loads[tenant], ranks, servers); !block.empty()) {
        std::string reason = absl::StrCat(kQuotaReason, block);
        if (job.reason() != reason) {
          job.set_reason(std::move(reason));
          entry->dirty = true;
        }
        continue;
      }
      if (absl::StartsWith(job.reason(), kQuotaReason)) {
        job.set_reason(WaitingReason(job.spec()));
        entry->dirty = true;
      }
      const bool claimed = claims.count(job.id()) > 0;
      auto left = [claimed](size_t free, size_t held) {
        return claimed ? free : free - std::min(free, held);
      };
      if (ranks > left(free_trainers.size(), held_trainers) ||
          servers > left(free_shards.size(), held_shards)) {
        continue;
      }
      // Negated where larger goes first, so that the smallest key wins.
      const std::tuple<bool, double, int32_t, uint64_t> key = {
          !claimed, DominantShare(loads[tenant], pool) / quota.weight(), -job.spec().priority(),
          entry->order};
      if (best == nullptr || key < best_key) {
        best = entry;
        best_key = key;
      }
      if (urgent == nullptr || job.spec().priority() > urgent->job.spec().priority()) {
        urgent = entry;
      }
    }
    if (best == nullptr) break;
    if (claims.count(best->job.id()) == 0 && Preemptible(best->job) &&
        urgent->job.spec().priority() > best->job.spec().priority()) {
      best = urgent;
    }
    const uint32_t ranks = Ranks(best->job.spec());
    const uint32_t servers = OptimizerServers(best->job.spec());
    std::vector<Worker*> trainers(free_trainers.begin(), free_trainers.begin() + ranks);
    std::vector<Worker*> shards(free_shards.begin(), free_shards.begin() + servers);
    free_trainers.erase(free_trainers.begin(), free_trainers.begin() + ranks);
    free_shards.erase(free_shards.begin(), free_shards.begin() + servers);
    if (claims.count(best->job.id()) > 0) {
      // It fit, so it held nothing back.
      claims.erase(best->job.id());
    }
    // Slots follow the workers' indexes (a k8s completion index) where they have them, so pod i
    // runs rank i; workers without one come after, oldest first.
    auto by_index = [](const Worker* a, const Worker* b) {
      if (a->info.has_index() != b->info.has_index()) return a->info.has_index();
      return a->info.has_index() && a->info.index() != b->info.index()
                 ? a->info.index() < b->info.index()
                 : a->number < b->number;
    };
    std::sort(trainers.begin(), trainers.end(), by_index);
    std::sort(shards.begin(), shards.end(), by_index);
    TenantLoad& load = loads[TenantOf(best->job)];
    load.servers += servers;
    load.ranks += ranks;
    ++load.running_jobs;
    --load.queued_jobs;
    StartAttempt(*best, trainers, shards);
  }
  Preempt(now, *tenants, loads, pool);
}

void JobController::Preempt(absl::Time now, const TenantTable& tenants,
                            const std::map<std::string, TenantLoad>& loads, const PoolSize& pool) {
  // Workers that are free, or soon will be: idle, draining an attempt that ended, or held by a job
  // already asked to stop for another.
  size_t trainers = 0, shards = 0;
  for (const auto& [id, worker] : workers_) {
    if (!IsLive(worker, now) || !worker.job_id.empty()) continue;
    ++(worker.info.kind() == v1::WORKER_KIND_TRAINER ? trainers : shards);
  }
  for (const auto& [id, entry] : jobs_) {
    if (IsActive(entry.job.state()) && entry.job.request() == v1::JOB_REQUEST_PREEMPT) {
      trainers += Ranks(entry.job.spec());
      shards += OptimizerServers(entry.job.spec());
    }
  }
  // The jobs within their quotas that wait, the most urgent first: the highest priority, then the
  // oldest. Each takes what is free or being freed; the first that finds too little preempts.
  std::vector<const JobEntry*> waiting;
  for (const std::string& id : submit_order_) {
    const JobEntry& entry = jobs_.at(id);
    const v1::Job& job = entry.job;
    if (job.state() != v1::JOB_STATE_PENDING || job.spec().priority() == 0) continue;
    if (!QuotaBlock(QuotaOf(tenants, TenantOf(job)), loads.at(TenantOf(job)), Ranks(job.spec()),
                    OptimizerServers(job.spec()))
             .empty()) {
      continue;
    }
    waiting.push_back(&entry);
  }
  std::stable_sort(waiting.begin(), waiting.end(), [](const JobEntry* a, const JobEntry* b) {
    return a->job.spec().priority() > b->job.spec().priority();
  });
  for (const JobEntry* urgent : waiting) {
    const v1::Job& job = urgent->job;
    const uint32_t ranks = Ranks(job.spec());
    const uint32_t servers = OptimizerServers(job.spec());
    if (ranks > pool.trainers || servers > pool.servers) continue;  // the pool is too small
    if (ranks <= trainers && servers <= shards) {
      // It only waits for workers to drain.
      trainers -= ranks;
      shards -= servers;
      continue;
    }
    // Victims: preemptible running jobs of lower priority, the lowest first, then the latest
    // submitted (what they trained is checkpointed either way; the latest has waited least).
    std::vector<JobEntry*> candidates;
    for (auto& [id, entry] : jobs_) {
      const v1::Job& victim = entry.job;
      if (!IsActive(victim.state()) || !Preemptible(victim) ||
          victim.spec().priority() >= job.spec().priority() ||
          (victim.request() != v1::JOB_REQUEST_NONE &&
           victim.request() != v1::JOB_REQUEST_CHECKPOINT)) {
        continue;
      }
      candidates.push_back(&entry);
    }
    std::sort(candidates.begin(), candidates.end(), [](const JobEntry* a, const JobEntry* b) {
      if (a->job.spec().priority() != b->job.spec().priority()) {
        return a->job.spec().priority() < b->job.spec().priority();
      }
      return a->order > b->order;
    });
    std::vector<JobEntry*> victims;
    size_t more_trainers = trainers, more_shards = shards;
    for (JobEntry* victim : candidates) {
      if (ranks <= more_trainers && servers <= more_shards) break;
      victims.push_back(victim);
      more_trainers += Ranks(victim->job.spec());
      more_shards += OptimizerServers(victim->job.spec());
    }
    // Not even all of them would make room: nothing is stopped for it, nor for the jobs behind it
    // (they would take what it waits for).
    if (ranks > more_trainers || servers > more_shards) return;
    for (JobEntry* victim : victims) PreemptJob(*victim, job);
    trainers = more_trainers - ranks;
    shards = more_shards - servers;
  }
}

void JobController::PreemptJob(JobEntry& victim, const v1::Job& for_job) {
  victim.job.set_preempted_for(for_job.id());
  const std::string why = absl::StrCat("job ", for_job.id(), " of priority ",
                                       for_job.spec().priority(), " needs its workers");
  if (!TrainersStarted(victim)) {
    victim.job.set_preemptions(victim.job.preemptions() + 1);
    FinishAttempt(victim, v1::JOB_STATE_PENDING,
                  absl::StrCat("preempted before its ranks started: ", why));
    return;
  }
  victim.job.set_request(v1::JOB_REQUEST_PREEMPT);
  AddEvent(victim, absl::StrCat("preemption requested: ", why,
                                "; the ranks checkpoint and stop, and the job waits to resume"));
}

void JobController::StartAttempt(JobEntry& entry, const std::vector<Worker*>& trainers,
                                 const std::vector<Worker*>& servers) {
  v1::Job& job = entry.job;
  job.set_attempt(job.attempt() + 1);
  job.clear_preempted_for();
  ResetAttempt(entry);
  auto take = [&](Worker& worker, uint32_t slot) {
    worker.job_id = job.id();
    worker.attempt = job.attempt();
    worker.slot = slot;
    worker.delivered = false;
    worker.acknowledged = false;
    worker.finished = false;
    worker.pending_start.reset();
  };
  std::vector<std::string> rank_names, shard_names;
  for (uint32_t rank = 0; rank < trainers.size(); ++rank) {
    take(*trainers[rank], rank);
    job.add_trainer_workers(trainers[rank]->id);
    rank_names.push_back(Describe(*trainers[rank]));
  }
  for (uint32_t shard = 0; shard < servers.size(); ++shard) {
    take(*servers[shard], shard);
    job.add_server_workers(servers[shard]->id);
    job.add_shard_addresses(servers[shard]->info.address());
    shard_names.push_back(
        absl::StrCat(Describe(*servers[shard]), " at ", servers[shard]->info.address()));
  }
  LogError(SetState(entry, v1::JOB_STATE_RUNNING, ""));
  AddEvent(entry,
           absl::StrCat("attempt ", job.attempt(), " started on trainer(s) ",
                        absl::StrJoin(rank_names, ", "), " and optimizer server(s) ",
                        absl::StrJoin(shard_names, ", "),
                        ResumesFromCheckpoint(job) ? ", resuming from the latest checkpoint" : ""));
  // Servers first: a trainer must never reach a server that does not yet accept its job.
  for (uint32_t shard = 0; shard < servers.size(); ++shard) {
    servers[shard]->pending_start = MakeAssignment(job, v1::WORKER_KIND_OPTIMIZER_SERVER, shard);
  }
  MaybeReleaseTrainers(entry);
}

v1::Assignment JobController::MakeAssignment(const v1::Job& job, v1::WorkerKind kind,
                                             uint32_t slot) const {
  v1::Assignment a;
  a.set_job_id(job.id());
  a.set_attempt(job.attempt());
  a.set_shard_job_id(ShardJobId(job.id(), job.attempt()));
  // The shard job id is unique per attempt, so the secret is too; a restarted controller derives
  // the same one for the attempt its workers still run.
  a.set_shard_secret(DeriveSecret(attempt_key_, a.shard_job_id()));
  *a.mutable_spec() = job.spec();
  *a.mutable_partition() = job.partition();
  a.set_resume(ResumesFromCheckpoint(job));
  a.set_world_size(Ranks(job.spec()));
  *a.mutable_shard_addresses() = job.shard_addresses();
  if (kind == v1::WORKER_KIND_TRAINER) {
    a.set_rank(slot);
  } else {
    a.set_shard_index(slot);
  }
  return a;
}

void JobController::MaybeReleaseTrainers(JobEntry& entry) {
  if (entry.trainers_released || !IsActive(entry.job.state())) return;
  for (const std::string& id : entry.job.server_workers()) {
    auto it = workers_.find(id);
    if (it == workers_.end() || !it->second.acknowledged) return;
  }
  // Ranks on one host share its GPUs: each learns its place among them.
  std::map<std::string, uint32_t> on_host;  // hostname -> the attempt's ranks there
  std::vector<uint32_t> local_rank(entry.job.trainer_workers_size(), 0);
  for (uint32_t rank = 0; rank < static_cast<uint32_t>(entry.job.trainer_workers_size()); ++rank) {
    auto it = workers_.find(entry.job.trainer_workers(rank));
    if (it != workers_.end()) local_rank[rank] = on_host[it->second.info.hostname()]++;
  }
  for (uint32_t rank = 0; rank < static_cast<uint32_t>(entry.job.trainer_workers_size()); ++rank) {
    auto it = workers_.find(entry.job.trainer_workers(rank));
    if (it == workers_.end()) continue;
    v1::Assignment a = MakeAssignment(entry.job, v1::WORKER_KIND_TRAINER, rank);
    a.set_local_rank(local_rank[rank]);
    a.set_local_ranks(on_host[it->second.info.hostname()]);
    it->second.pending_start = std::move(a);
  }
  entry.trainers_released = true;
}

void JobController::ResetAttempt(JobEntry& entry) {
  v1::Job& job = entry.job;
  job.set_request(v1::JOB_REQUEST_NONE);
  job.clear_trainer_workers();
  job.clear_server_workers();
  job.clear_shard_addresses();
  entry.checkpoint_request = 0;
  entry.trainers_released = false;
  entry.reissue_checkpoint = false;
  entry.vacancy_deadline = absl::InfiniteFuture();
  entry.vacancy_reasons.clear();
  entry.first_report.reset();
}

void JobController::EndAttempt(JobEntry& entry) {
  v1::Job& job = entry.job;
  const v1::AttemptRef ref = Ref(job.id(), job.attempt());
  std::vector<std::string> ids(job.trainer_workers().begin(), job.trainer_workers().end());
  ids.insert(ids.end(), job.server_workers().begin(), job.server_workers().end());
  for (const std::string& id : ids) {
    auto it = workers_.find(id);
    if (it == workers_.end()) continue;
    Worker& worker = it->second;
    if (worker.job_id != job.id() || worker.attempt != job.attempt()) continue;
    // A trainer that reported its end has nothing left to stop; a server always drops the shard
    // job, so no trainer of this attempt can still step on it.
    const bool needs_stop =
        worker.delivered && !(worker.info.kind() == v1::WORKER_KIND_TRAINER && worker.finished);
    worker.job_id.clear();
    worker.attempt = 0;
    worker.delivered = worker.acknowledged = worker.finished = false;
    worker.pending_start.reset();
    if (needs_stop) {
      worker.pending_stop.push_back(ref);
      // Busy until a heartbeat shows the attempt gone: a worker never runs two at once.
      worker.other_running.push_back(ref);
    }
  }
  ResetAttempt(entry);
  entry.dirty = true;
  rendezvous_.erase({job.id(), job.attempt()});
  rendezvous_changed_.SignalAll();
}

void JobController::FinishAttempt(JobEntry& entry, v1::JobState to, std::string reason) {
  EndAttempt(entry);
  if (absl::Status s = SetState(entry, to, reason); !s.ok()) {
    LogError(s);
    return;
  }
  AddEvent(entry, std::move(reason));
}

void JobController::FailAttempt(JobEntry& entry, const std::string& why) {
  ++attempt_failures_;
  const v1::Job& job = entry.job;
  // A user who asked the job to stop gets the stop, however the attempt ended.
  if (job.request() == v1::JOB_REQUEST_CANCEL) {
    FinishAttempt(entry, v1::JOB_STATE_CANCELLED,
                  absl::StrCat("cancelled; the attempt ended with: ", why));
  } else if (job.request() == v1::JOB_REQUEST_PAUSE) {
    FinishAttempt(entry, v1::JOB_STATE_PAUSED,
                  absl::StrCat("paused; the attempt ended with: ", why));
  } else if (job.request() == v1::JOB_REQUEST_PREEMPT) {
    entry.job.set_preemptions(job.preemptions() + 1);
    FinishAttempt(
        entry, v1::JOB_STATE_PENDING,
        absl::StrCat("preempted for job ", job.preempted_for(), "; the attempt ended with: ", why));
  } else if (job.restarts() < job.spec().max_restarts() && !job.spec().checkpoint().dir().empty()) {
    entry.job.set_restarts(job.restarts() + 1);
    ++restarts_;
    FinishAttempt(entry, v1::JOB_STATE_PENDING,
                  absl::StrCat("restarting from the last checkpoint after: ", why, " (restart ",
                               entry.job.restarts(), " of ", entry.job.spec().max_restarts(), ")"));
  } else {
    FinishAttempt(entry, v1::JOB_STATE_FAILED, why);
  }
}

void JobController::OnAttemptResult(Worker& worker, const v1::AttemptResult& result) {
  if (worker.job_id.empty() || worker.job_id != result.attempt().job_id() ||
      worker.attempt != result.attempt().attempt()) {
    return;  // an attempt that already ended, or never was this worker's
  }
  auto it = jobs_.find(worker.job_id);
  if (it == jobs_.end() || !IsCurrent(it->second, worker.attempt)) return;
  JobEntry& entry = it->second;
  const v1::Job& job = entry.job;
  const std::string detail = result.message().empty() ? "" : absl::StrCat(": ", result.message());
  if (worker.info.kind() == v1::WORKER_KIND_OPTIMIZER_SERVER) {
    FailAttempt(entry,
                absl::StrCat("optimizer server ", Describe(worker), " for shard ", worker.slot,
                             " ended the attempt (code ", result.exit_code(), ")", detail));
    return;
  }
  worker.finished = true;
  const uint32_t rank = worker.slot;
  const int code = result.exit_code();
  if (code == 0 || code == 130) {
    // Rank 0 speaks for the attempt; the other ranks end with it.
    if (rank != 0) return;
    const uint64_t step = job.progress().step();
    if (code == 0) {
      FinishAttempt(entry, v1::JOB_STATE_SUCCEEDED, absl::StrCat("succeeded at step ", step));
    } else if (job.request() == v1::JOB_REQUEST_CANCEL) {
      FinishAttempt(entry, v1::JOB_STATE_CANCELLED, absl::StrCat("cancelled at step ", step));
    } else if (job.request() == v1::JOB_REQUEST_PAUSE) {
      FinishAttempt(entry, v1::JOB_STATE_PAUSED, absl::StrCat("paused at step ", step));
    } else if (job.request() == v1::JOB_REQUEST_PREEMPT) {
      entry.job.set_preemptions(job.preemptions() + 1);
      FinishAttempt(entry, v1::JOB_STATE_PENDING,
                    absl::StrCat("preempted at step ", step, " for job ", job.preempted_for(),
                                 "; resumes from its checkpoint when workers are free"));
    } else {
      FinishAttempt(entry, v1::JOB_STATE_PAUSED,
                    absl::StrCat("stopped by a signal at step ", step));
    }
    return;
  }
  FailAttempt(entry, absl::StrCat("rank ", rank, " on ", Describe(worker), " exited with code ",
                                  code, detail));
}

// ---------------------------------------------------------------------------------------------
// The worker protocol.

absl::StatusOr<v1::RegisterWorkerResponse> JobController::RegisterWorker(
    const v1::RegisterWorkerRequest& request) {
  const v1::WorkerInfo& info = request.worker();
  if (info.kind() != v1::WORKER_KIND_TRAINER && info.kind() != v1::WORKER_KIND_OPTIMIZER_SERVER) {
    return absl::InvalidArgumentError(
        "worker.kind: must be WORKER_KIND_TRAINER or WORKER_KIND_OPTIMIZER_SERVER");
  }
  if (info.kind() == v1::WORKER_KIND_OPTIMIZER_SERVER && info.address().empty()) {
    return absl::InvalidArgumentError(
        "worker.address: an optimizer server must give the host:port of its shard service");
  }
  for (const v1::Assignment& running : request.running()) {
    if (running.job_id().empty()) {
      return absl::InvalidArgumentError("running.job_id: every running assignment needs one");
    }
  }
  absl::MutexLock lock(&mu_);
  const uint64_t number = next_worker_number_++;
  const std::string id = absl::StrCat("w-", worker_id_tag_, "-", number);
  Worker& worker = workers_[id];
  worker.id = id;
  worker.number = number;
  worker.info = info;
  worker.last_heartbeat = options_.clock();
  for (const v1::Assignment& running : request.running()) TakeBack(worker, running);
  Schedule();
  // The registration itself is not durable; what it changed in jobs is written now or by the next
  // Tick, and Heartbeat hands out nothing before it is written.
  LogError(PersistDirty());
  v1::RegisterWorkerResponse response;
  response.set_worker_id(id);
  response.set_heartbeat_interval_ms(
      static_cast<uint32_t>(absl::ToInt64Milliseconds(options_.heartbeat_interval)));
  response.set_heartbeat_timeout_ms(
      static_cast<uint32_t>(absl::ToInt64Milliseconds(options_.heartbeat_timeout)));
  return response;
}

void JobController::VacateSlot(JobEntry& entry, const Worker& worker, absl::Time now) {
  const bool trainer = worker.info.kind() == v1::WORKER_KIND_TRAINER;
  google::protobuf::RepeatedPtrField<std::string>* slots =
      trainer ? entry.job.mutable_trainer_workers() : entry.job.mutable_server_workers();
  if (worker.slot >= static_cast<uint32_t>(slots->size()) || (*slots)[worker.slot] != worker.id) {
    return;
  }
  (*slots)[worker.slot].clear();
  const std::string slot = absl::StrCat(trainer ? "rank " : "optimizer shard ", worker.slot);
  // Twice the heartbeat timeout: a worker cut off for about one timeout can be silent for longer
  // (its beats wait behind TCP's backed-off retransmissions once the link is back) before its
  // next beat is answered NOT_FOUND and it registers again. A worker that died for real is
  // usually noticed sooner: its peers' collectives or shard calls fail and their workers say so.
  const absl::Duration grace = 2 * options_.heartbeat_timeout;
  const std::string timeout = absl::FormatDuration(grace);
  entry.vacancy_reasons[slot] = absl::StrCat(
      "worker ", Describe(worker), " lost its heartbeat and did not come back within ", timeout);
  entry.vacancy_deadline = std::min(entry.vacancy_deadline, now + grace);
  AddEvent(entry, absl::StrCat("worker ", Describe(worker), " of ", slot,
                               " lost its heartbeat; the attempt goes on if it registers again "
                               "within ",
                               timeout));
}

void JobController::TakeBack(Worker& worker, const v1::Assignment& running) {
  const v1::AttemptRef ref = Ref(running.job_id(), running.attempt());
  const bool trainer = worker.info.kind() == v1::WORKER_KIND_TRAINER;
  const uint32_t slot = trainer ? running.rank() : running.shard_index();
  auto it = jobs_.find(running.job_id());
  JobEntry* entry = it == jobs_.end() ? nullptr : &it->second;
  google::protobuf::RepeatedPtrField<std::string>* slots = nullptr;
  if (entry != nullptr && IsCurrent(*entry, running.attempt()) && worker.job_id.empty()) {
    slots = trainer ? entry->job.mutable_trainer_workers() : entry->job.mutable_server_workers();
    if (slot >= static_cast<uint32_t>(slots->size()) || !(*slots)[slot].empty()) slots = nullptr;
  }
  if (slots == nullptr) {
    worker.other_running.push_back(ref);
    worker.pending_stop.push_back(ref);
    return;
  }
  (*slots)[slot] = worker.id;
  worker.job_id = running.job_id();
  worker.attempt = running.attempt();
  worker.slot = slot;
  worker.delivered = worker.acknowledged = true;
  worker.finished = false;
  if (!trainer && slot < static_cast<uint32_t>(entry->job.shard_addresses_size())) {
    entry->job.set_shard_addresses(static_cast<int>(slot), worker.info.address());
  }
  AddEvent(*entry, absl::StrCat(trainer ? "rank " : "optimizer shard ", slot, " is back on ",
                                Describe(worker)));
  const auto vacant = [](const std::string& id) { return id.empty(); };
  if (std::none_of(entry->job.trainer_workers().begin(), entry->job.trainer_workers().end(),
                   vacant) &&
      std::none_of(entry->job.server_workers().begin(), entry->job.server_workers().end(),
                   vacant)) {
    entry->vacancy_deadline = absl::InfiniteFuture();
    entry->vacancy_reasons.clear();
  }
  // A server back before the trainers had their assignments lets them go now.
  if (!trainer) MaybeReleaseTrainers(*entry);
}

absl::StatusOr<v1::HeartbeatResponse> JobController::Heartbeat(
    const v1::HeartbeatRequest& request) {
  absl::MutexLock lock(&mu_);
  auto found = workers_.find(request.worker_id());
  if (found == workers_.end()) {
    return absl::NotFoundError("unknown worker; register again");
  }
  Worker& worker = found->second;
  worker.last_heartbeat = options_.clock();
  for (const v1::AttemptResult& result : request.finished()) OnAttemptResult(worker, result);
  worker.other_running.clear();
  for (const v1::AttemptRef& ref : request.running()) {
    if (!worker.job_id.empty() && ref.job_id() == worker.job_id &&
        ref.attempt() == worker.attempt) {
      worker.delivered = true;
      if (!worker.acknowledged) {
        worker.acknowledged = true;
        if (worker.info.kind() == v1::WORKER_KIND_OPTIMIZER_SERVER) {
          MaybeReleaseTrainers(jobs_.at(worker.job_id));
        }
      }
    } else {
      worker.other_running.push_back(ref);
    }
  }
  Schedule();
  // Nothing goes out before the changes behind it are stored: the pending starts and stops wait
  // for the next heartbeat.
  OFFLOAD_RETURN_IF_ERROR(PersistDirty());
  v1::HeartbeatResponse response;
  if (worker.pending_start.has_value()) {
    *response.add_start() = *std::move(worker.pending_start);
    worker.pending_start.reset();
    worker.delivered = true;
    worker.delivered_at = options_.clock();
  }
  std::set<std::pair<std::string, uint32_t>> stopped;
  auto stop = [&](const v1::AttemptRef& ref) {
    if (stopped.insert({ref.job_id(), ref.attempt()}).second) *response.add_stop() = ref;
  };
  for (const v1::AttemptRef& ref : worker.pending_stop) stop(ref);
  for (const v1::AttemptRef& ref : worker.other_running) stop(ref);
  worker.pending_stop.clear();
  return response;
}

absl::StatusOr<v1::ProgressReply> JobController::ReportProgress(const v1::ProgressReport& report) {
  absl::MutexLock lock(&mu_);
  OFFLOAD_ASSIGN_OR_RETURN(JobEntry * found, FindJob(report.attempt().job_id()));
  JobEntry& entry = *found;
  if (!IsCurrent(entry, report.attempt().attempt())) {
    return absl::FailedPreconditionError(absl::StrCat("attempt ", report.attempt().attempt(),
                                                      " of job ", entry.job.id(),
                                                      " is no longer current"));
  }
  const absl::Time now = options_.clock();
  if (report.rank() == 0) {
    if (entry.reissue_checkpoint) {
      entry.checkpoint_request =
          std::max(entry.checkpoint_request, report.checkpoint_request_done() + 1);
      entry.reissue_checkpoint = false;
    }
    // After a controller restart the counter starts again at 0: never ask for less than done.
    entry.checkpoint_request = std::max(entry.checkpoint_request, report.checkpoint_request_done());
    v1::JobProgress& p = *entry.job.mutable_progress();
    p.set_step(report.step());
    p.set_total_steps(report.total_steps());
    p.set_loss(report.loss());
    p.set_val_loss(report.val_loss());
    p.set_tokens_per_s(report.tokens_per_s());
    p.set_loss_scale(report.loss_scale());
    SetTimestamp(now, p.mutable_update_time());
    // The ETA extrapolates this attempt's own pace: it includes data loading and checkpoints,
    // which tokens/s of the last step does not.
    if (!entry.first_report.has_value()) entry.first_report = {now, report.step()};
    const double seconds = absl::ToDoubleSeconds(now - entry.first_report->first);
    const uint64_t steps =
        report.step() > entry.first_report->second ? report.step() - entry.first_report->second : 0;
    p.set_eta_seconds(steps > 0 && seconds > 0 && report.total_steps() > report.step()
                          ? static_cast<double>(report.total_steps() - report.step()) * seconds /
                                static_cast<double>(steps)
                          : 0.0);
    bool checkpointed = false;
    if (!report.checkpoint_dir().empty() && report.checkpoint_step() > p.last_checkpoint_step()) {
      p.set_last_checkpoint(report.checkpoint_dir());
      p.set_last_checkpoint_step(report.checkpoint_step());
      checkpointed = true;
    }
    entry.progress_dirty = true;
    if (checkpointed || now - entry.last_persist >= options_.progress_persist_interval) {
      entry.dirty = true;
    }
    if (entry.job.state() == v1::JOB_STATE_CHECKPOINTING && entry.checkpoint_request > 0 &&
        report.checkpoint_request_done() >= entry.checkpoint_request) {
      const std::string what =
          absl::StrCat("checkpoint at step ", p.last_checkpoint_step(), ": ", p.last_checkpoint());
      if (absl::Status s = SetState(entry, v1::JOB_STATE_RUNNING, ""); s.ok()) {
        AddEvent(entry, what);
      }
    }
    OFFLOAD_RETURN_IF_ERROR(Persist(entry));
  }
  v1::ProgressReply reply;
  // To the ranks a preemption is a pause: checkpoint and stop. What follows is the controller's.
  reply.set_request(entry.job.request() == v1::JOB_REQUEST_PREEMPT ? v1::JOB_REQUEST_PAUSE
                                                                   : entry.job.request());
  reply.set_checkpoint_request(entry.checkpoint_request);
  return reply;
}

absl::StatusOr<v1::RendezvousSetResponse> JobController::RendezvousSet(
    const v1::RendezvousSetRequest& request) {
  if (request.key().empty()) return absl::InvalidArgumentError("key: a key is required");
  absl::MutexLock lock(&mu_);
  OFFLOAD_ASSIGN_OR_RETURN(JobEntry * found, FindJob(request.attempt().job_id()));
  if (!IsCurrent(*found, request.attempt().attempt())) {
    return absl::FailedPreconditionError(absl::StrCat("attempt ", request.attempt().attempt(),
                                                      " of job ", request.attempt().job_id(),
                                                      " is no longer current"));
  }
  rendezvous_[{request.attempt().job_id(), request.attempt().attempt()}][request.key()] =
      request.value();
  rendezvous_changed_.SignalAll();
  return v1::RendezvousSetResponse();
}

absl::StatusOr<v1::RendezvousGetResponse> JobController::RendezvousGet(
    const v1::RendezvousGetRequest& request) {
  if (request.keys().empty()) return absl::InvalidArgumentError("keys: at least one is required");
  const absl::Duration wait =
      request.timeout_ms() == 0
          ? kMaxRendezvousWait
          : std::min(absl::Milliseconds(request.timeout_ms()), kMaxRendezvousWait);
  const absl::Time deadline = absl::Now() + wait;
  const std::string& job_id = request.attempt().job_id();
  const uint32_t attempt = request.attempt().attempt();
  absl::MutexLock lock(&mu_);
  while (true) {
    if (shutting_down_) return absl::UnavailableError("the job controller is shutting down");
    OFFLOAD_ASSIGN_OR_RETURN(JobEntry * found, FindJob(job_id));
    if (!IsCurrent(*found, attempt)) {
      return absl::FailedPreconditionError(
          absl::StrCat("attempt ", attempt, " of job ", job_id, " is no longer current"));
    }
    const std::string* missing = nullptr;
    auto store = rendezvous_.find({job_id, attempt});
    for (const std::string& key : request.keys()) {
      if (store == rendezvous_.end() || store->second.count(key) == 0) {
        missing = &key;
        break;
      }
    }
    if (missing == nullptr) {
      v1::RendezvousGetResponse response;
      for (const std::string& key : request.keys()) response.add_values(store->second.at(key));
      return response;
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("rendezvous of attempt ", attempt, " of job ", job_id, ": key '", *missing,
                       "' still missing after ", absl::FormatDuration(wait)));
    }
    rendezvous_changed_.WaitWithDeadline(&mu_, deadline);
  }
}

JobController::Stats JobController::GetStats() const {
  absl::MutexLock lock(&mu_);
  Stats stats;
  for (int state = v1::JobState_MIN; state <= v1::JobState_MAX; ++state) {
    if (state != v1::JOB_STATE_UNSPECIFIED && v1::JobState_IsValid(state)) {
      stats.jobs[static_cast<v1::JobState>(state)] = 0;
    }
  }
  for (const auto& [id, entry] : jobs_) ++stats.jobs[entry.job.state()];
  for (const auto& [id, worker] : workers_) {
    const bool busy = !worker.job_id.empty() || !worker.other_running.empty();
    ++stats.workers[KindIndex(worker.info.kind())][busy ? 1 : 0];
  }
  for (int k = 0; k < 2; ++k) stats.heartbeat_timeouts[k] = heartbeat_timeouts_[k];
  const std::shared_ptr<const TenantTable> tenants = Tenants();
  const std::map<std::string, TenantLoad> loads = Loads();
  std::map<std::string, double> weights;
  stats.tenants[kOperatorTenant];  // always there: the operator's jobs, and every job without
                                   // tenants
  for (const v1::TenantConfig& tenant : tenants->tenants) {
    weights[tenant.name()] = tenant.weight();
    stats.tenants[tenant.name()];
  }
  const PoolSize pool = Pool(options_.clock());
  const std::map<std::string, double> entitled = EntitledShares(loads, weights);
  for (const auto& [tenant, load] : loads) {
    Stats::Tenant& t = stats.tenants[tenant];
    t.load = load;
    t.fair_share_deficit = entitled.at(tenant) - DominantShare(load, pool);
  }
  for (const auto& [id, entry] : jobs_) {
    stats.tenants[TenantOf(entry.job)].preemptions += entry.job.preemptions();
  }
  stats.attempt_failures = attempt_failures_;
  stats.restarts = restarts_;
  return stats;
}

absl::Status JobController::Tick() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = options_.clock();
  std::vector<std::string> dead;
  for (const auto& [id, worker] : workers_) {
    if (!IsLive(worker, now)) dead.push_back(id);
  }
  for (const std::string& id : dead) {
    auto it = workers_.find(id);
    const Worker worker = std::move(it->second);
    workers_.erase(it);
    ++heartbeat_timeouts_[KindIndex(worker.info.kind())];
    if (worker.job_id.empty() || worker.finished) continue;
    auto job = jobs_.find(worker.job_id);
    if (job == jobs_.end() || !IsCurrent(job->second, worker.attempt)) continue;
    VacateSlot(job->second, worker, now);
  }
  // A worker that heartbeats but never lists the attempt it was given (stuck before starting it)
  // would hold the attempt forever: its trainers wait for a server that never acknowledges.
  std::vector<std::pair<std::string, std::string>> unacknowledged;  // (job id, why)
  for (const auto& [id, worker] : workers_) {
    if (worker.job_id.empty() || !worker.delivered || worker.acknowledged || worker.finished ||
        now - worker.delivered_at < options_.heartbeat_timeout) {
      continue;
    }
    auto job = jobs_.find(worker.job_id);
    if (job == jobs_.end() || !IsCurrent(job->second, worker.attempt)) continue;
    unacknowledged.emplace_back(
        worker.job_id,
        absl::StrCat("worker ", Describe(worker), " heartbeats but did not acknowledge attempt ",
                     worker.attempt, " within ", absl::FormatDuration(options_.heartbeat_timeout),
                     " of receiving it"));
  }
  for (const auto& [job_id, why] : unacknowledged) {
    JobEntry& entry = jobs_.at(job_id);
    if (IsActive(entry.job.state())) FailAttempt(entry, why);
  }
  for (auto& [id, entry] : jobs_) {
    if (IsActive(entry.job.state()) && now >= entry.vacancy_deadline) {
      std::string why;
      // Slots vacant since a controller restart have no reason recorded.
      // C++17 cannot capture a structured binding by name (gcc allows it, clang does not).
      auto reason = [&reasons = entry.vacancy_reasons](const std::string& slot,
                                                       const std::string& after_restart) {
        auto it = reasons.find(slot);
        return it != reasons.end() ? it->second : after_restart;
      };
      for (int rank = 0; rank < entry.job.trainer_workers_size() && why.empty(); ++rank) {
        if (entry.job.trainer_workers(rank).empty()) {
          why = reason(absl::StrCat("rank ", rank),
                       absl::StrCat("worker for rank ", rank,
                                    " did not come back after the controller restarted"));
        }
      }
      for (int shard = 0; shard < entry.job.server_workers_size() && why.empty(); ++shard) {
        if (entry.job.server_workers(shard).empty()) {
          why = reason(absl::StrCat("optimizer shard ", shard),
                       absl::StrCat("optimizer server for shard ", shard,
                                    " did not come back after the controller restarted"));
        }
      }
      entry.vacancy_deadline = absl::InfiniteFuture();
      entry.vacancy_reasons.clear();
      if (!why.empty()) FailAttempt(entry, why);
    }
    if (entry.progress_dirty && now - entry.last_persist >= options_.progress_persist_interval) {
      entry.dirty = true;
    }
  }
  Schedule();
  return PersistDirty();
}

void JobController::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutting_down_ = true;
  rendezvous_changed_.SignalAll();
}

}  // namespace offload
