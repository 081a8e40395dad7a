// The job controller's side of the worker protocol (job_controller.h): registration, heartbeats
// (a dead worker's slot vacated), rank 0's progress and the controller's requests, the rendezvous
// store, the pool's statistics, and the periodic Tick.
#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "services/job_controller/job_controller.h"
#include "services/job_controller/job_state.h"
#include "services/job_controller/pool/job_facts.h"

namespace offload {
namespace {

// The index of Stats' per-kind arrays.
int KindIndex(v1::WorkerKind kind) { return kind == v1::WORKER_KIND_OPTIMIZER_SERVER ? 1 : 0; }

// Rendezvous waits are capped so a forgotten rank cannot hold a server thread for ever.
constexpr absl::Duration kMaxRendezvousWait = absl::Minutes(10);

}  // namespace

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
