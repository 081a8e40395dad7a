// The job controller's side of the pool's attempts (job_controller.h): the scheduler (fair shares,
// quotas, preemption), starting an attempt on the workers it takes, and ending it (results,
// failures, retries). The job API is job_controller.cc's, the worker protocol pool/workers.cc's.
#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/security/security.h"
#include "jobs/spec/job_spec.h"
#include "services/job_controller/job_controller.h"
#include "services/job_controller/job_state.h"
#include "services/job_controller/pool/job_facts.h"

namespace offload {
namespace {

// Any attempt after the first may have left a checkpoint (one the controller has not heard of
// yet, too), and gpu_trainer refuses to start over a checkpoint without --resume, while --resume
// over an empty directory starts fresh: so later attempts resume whenever there is a directory.
bool ResumesFromCheckpoint(const v1::Job& job) {
  const v1::CheckpointSpec& checkpoint = job.spec().checkpoint();
  if (checkpoint.resume()) return true;
  return !checkpoint.dir().empty() &&
         (job.progress().last_checkpoint_step() > 0 || job.attempt() > 1);
}

// Jobs without a checkpoint directory are never preempted: they would start over and lose what
// they trained.
bool Preemptible(const v1::Job& job) {
  return (!job.spec().has_preemptible() || job.spec().preemptible()) &&
         !job.spec().checkpoint().dir().empty();
}

constexpr absl::string_view kQuotaReason = "waiting for quota: ";

}  // namespace

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

}  // namespace offload
