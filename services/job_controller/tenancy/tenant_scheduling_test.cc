// Fair shares, quotas and preemption in the controller's scheduler, with a fake clock and workers
// driven by hand (the way job_controller_test drives them).
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/job_controller/controller_metrics.h"
#include "services/job_controller/job_controller.h"
#include "services/job_controller/job_store.h"
#include "services/job_controller/tenancy/identities.h"

namespace offload {
namespace {

using ::testing::HasSubstr;

const Caller kA = Caller::Tenant("team-a");
const Caller kB = Caller::Tenant("team-b");

v1::AttemptRef Ref(const std::string& job_id, uint32_t attempt) {
  v1::AttemptRef ref;
  ref.set_job_id(job_id);
  ref.set_attempt(attempt);
  return ref;
}

class TenantSchedulingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* dir = std::getenv("TEST_TMPDIR");
    const std::string base = std::string(dir != nullptr ? dir : "/tmp") + "/tenant_scheduling_" +
                             std::to_string(getpid()) + "_" +
                             ::testing::UnitTest::GetInstance()->current_test_info()->name();
    path_ = base + ".db";
    tenants_path_ = base + ".json";
    for (const char* suffix : {"", "-wal", "-shm"}) std::remove((path_ + suffix).c_str());
    SetTenants(R"({"name": "team-a"}, {"name": "team-b"})");
    identities_ = *Identities::Create(BearerTokens(), tenants_path_);
    store_ = *JobStore::Open(path_);
    JobControllerOptions options;
    options.store = store_.get();
    options.clock = [this] { return now_; };
    options.identities = identities_.get();
    controller_ = *JobController::Create(options);
  }

  void TearDown() override {
    controller_.reset();
    store_.reset();
    for (const char* suffix : {"", "-wal", "-shm"}) std::remove((path_ + suffix).c_str());
    std::remove(tenants_path_.c_str());
  }

  // Replaces the tenants file and, once the controller runs, reloads it as its binary does.
  void SetTenants(const std::string& tenants) {
    std::ofstream(tenants_path_ + ".tmp") << R"({"tenants": [)" << tenants << "]}";
    std::rename((tenants_path_ + ".tmp").c_str(), tenants_path_.c_str());
    if (identities_ != nullptr) {
      ASSERT_TRUE(identities_->Reload().ok());
      ASSERT_TRUE(controller_->Tick().ok());
    }
  }

  std::string Register(v1::WorkerKind kind, const std::string& name) {
    v1::RegisterWorkerRequest request;
    request.mutable_worker()->set_kind(kind);
    request.mutable_worker()->set_name(name);
    if (kind == v1::WORKER_KIND_OPTIMIZER_SERVER) {
      request.mutable_worker()->set_address(name + ":50051");
    }
    absl::StatusOr<v1::RegisterWorkerResponse> response = controller_->RegisterWorker(request);
    EXPECT_TRUE(response.ok()) << response.status();
    return response.ok() ? response->worker_id() : "";
  }

  // `n` trainers and `n` servers, paired: pair i runs one job of one rank and one shard.
  void Pool(int n) {
    for (int i = 0; i < n; ++i) {
      trainers_.push_back(Register(v1::WORKER_KIND_TRAINER, absl::StrCat("t", i)));
      servers_.push_back(Register(v1::WORKER_KIND_OPTIMIZER_SERVER, absl::StrCat("s", i)));
    }
  }

  v1::HeartbeatResponse Beat(const std::string& worker, const std::vector<v1::AttemptRef>& running,
                             const std::vector<v1::AttemptResult>& finished = {}) {
    v1::HeartbeatRequest request;
    request.set_worker_id(worker);
    for (const v1::AttemptRef& ref : running) *request.add_running() = ref;
    for (const v1::AttemptResult& result : finished) *request.add_finished() = result;
    absl::StatusOr<v1::HeartbeatResponse> response = controller_->Heartbeat(request);
    EXPECT_TRUE(response.ok()) << response.status();
    return response.ok() ? *response : v1::HeartbeatResponse();
  }

  // Every worker heartbeats with what it runs (what it was told to start, less what it was told
  // to stop), twice: starts go out on the beat after they are stored, and a server's
  // acknowledgement releases its trainers.
  void BeatAll() {
    for (int round = 0; round < 3; ++round) {
      for (const std::vector<std::string>* kind : {&servers_, &trainers_}) {
        for (const std::string& id : *kind) {
          std::vector<v1::AttemptRef> running;
          if (auto it = running_.find(id); it != running_.end()) running.push_back(it->second);
          v1::HeartbeatResponse response = Beat(id, running);
          for (const v1::AttemptRef& stop : response.stop()) {
            auto it = running_.find(id);
            if (it != running_.end() && it->second.job_id() == stop.job_id()) running_.erase(it);
          }
          for (const v1::Assignment& start : response.start()) {
            running_[id] = Ref(start.job_id(), start.attempt());
            if (start.resume() && kind == &trainers_) resumed_.push_back(start.job_id());
          }
        }
      }
    }
  }

  // The trainer of `job`'s rank 0 reports its end with `exit_code`, and the pool settles.
  void Finish(const std::string& job, int exit_code) {
    const v1::Job j = Get(job);
    ASSERT_EQ(j.trainer_workers_size(), 1);
    const std::string trainer = j.trainer_workers(0);
    v1::AttemptResult result;
    *result.mutable_attempt() = Ref(job, j.attempt());
    result.set_exit_code(exit_code);
    running_.erase(trainer);
    Beat(trainer, {}, {result});
    BeatAll();
  }

  std::string Submit(const Caller& caller, int priority = 0, bool checkpoints = true,
                     bool preemptible = true) {
    v1::SubmitJobRequest request;
    v1::JobSpec& spec = *request.mutable_spec();
    spec.mutable_data()->set_path("/data/tiny.txt");
    if (checkpoints) spec.mutable_checkpoint()->set_dir("/ckpt");
    spec.set_priority(priority);
    if (!preemptible) spec.set_preemptible(false);
    absl::StatusOr<v1::Job> job = controller_->SubmitJob(caller, request);
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? job->id() : "";
  }

  v1::Job Get(const std::string& id) {
    v1::GetJobRequest request;
    request.set_id(id);
    return *controller_->GetJob(Caller::Operator(), request);
  }
  v1::JobState State(const std::string& id) { return Get(id).state(); }

  std::string path_, tenants_path_;
  std::unique_ptr<Identities> identities_;
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<JobController> controller_;
  absl::Time now_ = absl::FromUnixSeconds(1700000000);
  std::vector<std::string> trainers_, servers_;
  std::map<std::string, v1::AttemptRef> running_;  // worker -> the attempt it runs
  std::vector<std::string> resumed_;               // jobs whose start said resume
};

TEST_F(TenantSchedulingTest, AFreedServerGoesToTheTenantFurthestBelowItsShare) {
  Pool(2);
  std::vector<std::string> a;
  for (int i = 0; i < 6; ++i) a.push_back(Submit(kA));
  BeatAll();
  const std::string b1 = Submit(kB);
  const std::string b2 = Submit(kB);
  BeatAll();
  EXPECT_EQ(State(a[0]), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(State(a[1]), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(State(b1), v1::JOB_STATE_PENDING);
  // A holds the whole pool; B holds nothing: the first server freed is B's.
  Finish(a[0], 0);
  EXPECT_EQ(State(a[0]), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(State(b1), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(State(a[2]), v1::JOB_STATE_PENDING);
  // Now each holds half: equal shares, so age decides, and A's third job is older than B's second.
  Finish(a[1], 0);
  EXPECT_EQ(State(a[2]), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(State(b2), v1::JOB_STATE_PENDING);
  // B's first ends: B holds nothing again and goes first.
  Finish(b1, 0);
  EXPECT_EQ(State(b2), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(State(a[3]), v1::JOB_STATE_PENDING);
}

TEST_F(TenantSchedulingTest, WeightsAndPriorityOrderTheQueue) {
  SetTenants(R"({"name": "team-a", "weight": 3}, {"name": "team-b"})");
  Pool(4);
  std::vector<std::string> a;
  for (int i = 0; i < 4; ++i) a.push_back(Submit(kA));
  BeatAll();
  const std::string b_low = Submit(kB);
  const std::string b_high = Submit(kB, /*priority=*/5, /*checkpoints=*/true);
  BeatAll();
  // A (weight 3) holds 4/4 = 1.0, over 3 that is 0.33; B holds nothing. B goes first, and within B
  // the job of higher priority, though it is younger.
  Finish(a[0], 0);
  EXPECT_EQ(State(b_high), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(State(b_low), v1::JOB_STATE_PENDING);
  // B now holds 1/4 = 0.25; A 3/4 over 3 = 0.25. Equal: the older job, B's low one (A has none
  // left waiting anyway); then with A holding 2/4 / 3 = 0.17 < B's 0.5, an A job would go first.
  Finish(a[1], 0);
  EXPECT_EQ(State(b_low), v1::JOB_STATE_RUNNING);
}

TEST_F(TenantSchedulingTest, QuotasAreNeverExceededAndAReloadAppliesNewOnes) {
  SetTenants(R"({"name": "team-a", "max_running_jobs": 1}, {"name": "team-b"})");
  Pool(3);
  const std::string a1 = Submit(kA);
  const std::string a2 = Submit(kA);
  BeatAll();
  EXPECT_EQ(State(a1), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(State(a2), v1::JOB_STATE_PENDING);
  EXPECT_THAT(Get(a2).reason(), HasSubstr("quota"));
  // The free workers are not held for A: B runs beside it.
  const std::string b1 = Submit(kB);
  BeatAll();
  EXPECT_EQ(State(b1), v1::JOB_STATE_RUNNING);
  // A job that can never fit its tenant's quota is refused at once, and nothing is stored.
  SetTenants(R"({"name": "team-a", "max_optimizer_servers": 2}, {"name": "team-b"})");
  v1::SubmitJobRequest big;
  big.mutable_spec()->mutable_data()->set_path("/data/tiny.txt");
  big.mutable_spec()->mutable_parallel()->set_optimizer_servers(3);
  absl::StatusOr<v1::Job> refused = controller_->SubmitJob(kA, big);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("quota of 2"));
  // The reload lifted the running-jobs quota: A's second starts on the free pair.
  BeatAll();
  EXPECT_EQ(State(a2), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(Get(a2).reason(), ::testing::Not(HasSubstr("quota")));
  const JobController::Stats stats = controller_->GetStats();
  EXPECT_EQ(stats.tenants.at("team-a").load.running_jobs, 2u);
  EXPECT_EQ(stats.tenants.at("team-a").load.servers, 2u);
  EXPECT_EQ(stats.tenants.at("team-b").load.running_jobs, 1u);
}

TEST_F(TenantSchedulingTest, AJobOfHigherPriorityPreemptsAndTheVictimResumesFromItsCheckpoint) {
  Pool(1);
  const std::string low = Submit(kA);
  BeatAll();
  ASSERT_EQ(State(low), v1::JOB_STATE_RUNNING);
  const std::string high = Submit(kB, /*priority=*/10);
  // The victim's ranks are asked to checkpoint and stop: to them, a pause.
  v1::Job victim = Get(low);
  EXPECT_EQ(victim.request(), v1::JOB_REQUEST_PREEMPT);
  EXPECT_EQ(victim.preempted_for(), high);
  v1::ProgressReport report;
  *report.mutable_attempt() = Ref(low, 1);
  report.set_step(7);
  absl::StatusOr<v1::ProgressReply> reply = controller_->ReportProgress(report);
  ASSERT_TRUE(reply.ok());
  EXPECT_EQ(reply->request(), v1::JOB_REQUEST_PAUSE);
  // Its rank 0 stops (exit 130 after the checkpoint): back to the queue, and the workers go to
  // the job it made room for, not back to it.
  Finish(low, 130);
  victim = Get(low);
  EXPECT_EQ(victim.state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(victim.preemptions(), 1u);
  EXPECT_THAT(victim.reason(), HasSubstr("preempted at step 7"));
  EXPECT_EQ(State(high), v1::JOB_STATE_RUNNING);
  // The urgent job ends; the victim starts again, from its checkpoint.
  Finish(high, 0);
  EXPECT_EQ(State(high), v1::JOB_STATE_SUCCEEDED);
  victim = Get(low);
  EXPECT_EQ(victim.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(victim.attempt(), 2u);
  EXPECT_EQ(victim.restarts(), 0u);  // a preemption is not a failure
  EXPECT_EQ(resumed_, std::vector<std::string>{low});
  EXPECT_EQ(controller_->GetStats().tenants.at("team-a").preemptions, 1u);
}

TEST_F(TenantSchedulingTest, NotPreemptibleJobsAndJobsWithoutCheckpointsKeepTheirWorkers) {
  Pool(2);
  const std::string pinned = Submit(kA, 0, /*checkpoints=*/true, /*preemptible=*/false);
  const std::string no_checkpoints = Submit(kA, 0, /*checkpoints=*/false);
  BeatAll();
  const std::string high = Submit(kB, /*priority=*/1000);
  BeatAll();
  EXPECT_EQ(Get(pinned).request(), v1::JOB_REQUEST_NONE);
  EXPECT_EQ(Get(no_checkpoints).request(), v1::JOB_REQUEST_NONE);
  EXPECT_EQ(State(high), v1::JOB_STATE_PENDING);
  // Nor is a job preempted for one of equal priority.
  Finish(no_checkpoints, 0);
  EXPECT_EQ(State(high), v1::JOB_STATE_RUNNING);
  const std::string same = Submit(kA, /*priority=*/1000);
  BeatAll();
  EXPECT_EQ(Get(high).request(), v1::JOB_REQUEST_NONE);
  EXPECT_EQ(State(same), v1::JOB_STATE_PENDING);
}

// Fair share would give a freed pair to B's preemptible job, which A's job of higher priority would
// stop before it trained a step: the urgent job takes it instead.
TEST_F(TenantSchedulingTest, AFreedWorkerGoesToAJobThatWouldPreemptItsFairShareWinner) {
  Pool(2);
  const std::string a_running = Submit(kA, 0, /*checkpoints=*/false);
  const std::string c_running = Submit(Caller::Operator(), 0, /*checkpoints=*/false);
  BeatAll();
  const std::string a_urgent = Submit(kA, /*priority=*/10);
  const std::string b_low = Submit(kB, /*priority=*/0);
  const std::string b_pinned = Submit(kB, /*priority=*/0, true, /*preemptible=*/false);
  BeatAll();
  Finish(c_running, 0);
  EXPECT_EQ(State(a_urgent), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(State(b_low), v1::JOB_STATE_PENDING);
  EXPECT_EQ(Get(b_low).attempt(), 0u);  // never started, so never preempted
  EXPECT_EQ(Get(b_low).preemptions(), 0u);
  // Next, with nothing more urgent waiting: B is furthest below its share, its older job goes.
  Finish(a_running, 0);
  EXPECT_EQ(State(b_low), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(State(b_pinned), v1::JOB_STATE_PENDING);
}

// A job the urgent one could not preempt keeps its fair-share turn.
TEST_F(TenantSchedulingTest, AFairShareWinnerThatCannotBePreemptedKeepsItsTurn) {
  Pool(2);
  const std::string a_running = Submit(kA, 0, /*checkpoints=*/false);
  const std::string c_running = Submit(Caller::Operator(), 0, /*checkpoints=*/false);
  BeatAll();
  const std::string a_urgent = Submit(kA, /*priority=*/10);
  const std::string b_pinned = Submit(kB, /*priority=*/0, true, /*preemptible=*/false);
  BeatAll();
  Finish(c_running, 0);
  EXPECT_EQ(State(b_pinned), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(State(a_urgent), v1::JOB_STATE_PENDING);
  EXPECT_EQ(Get(b_pinned).request(), v1::JOB_REQUEST_NONE);
}

TEST_F(TenantSchedulingTest, PreemptionStopsOnlyWhatTheUrgentJobNeeds) {
  Pool(3);
  const std::string old_low = Submit(kA, /*priority=*/1);
  const std::string lowest = Submit(kA, /*priority=*/0);
  const std::string new_low = Submit(kA, /*priority=*/1);
  BeatAll();
  const std::string high = Submit(kB, /*priority=*/9);
  // One pair is needed: the lowest priority goes first.
  EXPECT_EQ(Get(lowest).request(), v1::JOB_REQUEST_PREEMPT);
  EXPECT_EQ(Get(old_low).request(), v1::JOB_REQUEST_NONE);
  EXPECT_EQ(Get(new_low).request(), v1::JOB_REQUEST_NONE);
  // Heartbeats while the victim checkpoints stop nothing more.
  BeatAll();
  EXPECT_EQ(Get(old_low).request(), v1::JOB_REQUEST_NONE);
  EXPECT_EQ(Get(new_low).request(), v1::JOB_REQUEST_NONE);
  // A second urgent job: of the two of priority 1 the one started last goes.
  const std::string high2 = Submit(kB, /*priority=*/9);
  EXPECT_EQ(Get(new_low).request(), v1::JOB_REQUEST_PREEMPT);
  EXPECT_EQ(Get(old_low).request(), v1::JOB_REQUEST_NONE);
  Finish(lowest, 130);
  Finish(new_low, 130);
  EXPECT_EQ(State(high), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(State(high2), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(State(lowest), v1::JOB_STATE_PENDING);
  EXPECT_EQ(State(new_low), v1::JOB_STATE_PENDING);
}

TEST_F(TenantSchedulingTest, APreemptedJobThatFailsWhileStoppingStillGoesBackToTheQueue) {
  Pool(1);
  const std::string low = Submit(kA);
  BeatAll();
  Submit(kB, /*priority=*/3);
  ASSERT_EQ(Get(low).request(), v1::JOB_REQUEST_PREEMPT);
  Finish(low, 1);  // the rank died on the way out
  const v1::Job victim = Get(low);
  EXPECT_EQ(victim.state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(victim.restarts(), 0u);
  EXPECT_EQ(victim.preemptions(), 1u);
}

TEST_F(TenantSchedulingTest, TenantMetricsSayWhoHoldsWhat) {
  Pool(2);
  Submit(kA);
  Submit(kA);
  Submit(kA);
  BeatAll();
  Submit(kB);
  const JobController::Stats stats = controller_->GetStats();
  const auto& a = stats.tenants.at("team-a");
  const auto& b = stats.tenants.at("team-b");
  EXPECT_EQ(a.load.servers, 2u);
  EXPECT_EQ(a.load.ranks, 2u);
  EXPECT_EQ(a.load.running_jobs, 2u);
  EXPECT_EQ(a.load.queued_jobs, 1u);
  EXPECT_EQ(b.load.queued_jobs, 1u);
  // Each is owed half; A holds all of it, B none.
  EXPECT_DOUBLE_EQ(a.fair_share_deficit, -0.5);
  EXPECT_DOUBLE_EQ(b.fair_share_deficit, 0.5);
}

}  // namespace
}  // namespace offload
