#include "services/job_controller/job_controller.h"

#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/job_controller/controller_metrics.h"
#include "services/job_controller/job_store.h"

namespace offload {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// The tests of the controller's own behaviour act as the operator; tenancy_test covers tenants.
const Caller kOperator = Caller::Operator();

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  std::string path = std::string(dir != nullptr ? dir : "/tmp") + "/job_controller_test_" +
                     std::to_string(getpid()) + "_" + name + ".db";
  for (const char* suffix : {"", "-wal", "-shm"}) std::remove((path + suffix).c_str());
  return path;
}

v1::JobSpec Spec(uint32_t ranks = 1, uint32_t servers = 1, const std::string& checkpoint_dir = "",
                 uint32_t max_restarts = 0) {
  v1::JobSpec spec;
  spec.set_name("test job");
  spec.mutable_data()->set_path("/data/tiny.txt");
  spec.mutable_training()->set_steps(100);
  spec.mutable_parallel()->set_ranks(ranks);
  spec.mutable_parallel()->set_optimizer_servers(servers);
  if (!checkpoint_dir.empty()) spec.mutable_checkpoint()->set_dir(checkpoint_dir);
  spec.set_max_restarts(max_restarts);
  return spec;
}

v1::AttemptRef Ref(const std::string& job_id, uint32_t attempt) {
  v1::AttemptRef ref;
  ref.set_job_id(job_id);
  ref.set_attempt(attempt);
  return ref;
}

v1::AttemptResult Result(const std::string& job_id, uint32_t attempt, int exit_code,
                         const std::string& message = "") {
  v1::AttemptResult result;
  *result.mutable_attempt() = Ref(job_id, attempt);
  result.set_exit_code(exit_code);
  result.set_message(message);
  return result;
}

class JobControllerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = TempPath(::testing::UnitTest::GetInstance()->current_test_info()->name());
    Restart();
  }

  void TearDown() override {
    controller_.reset();
    store_.reset();
    for (const char* suffix : {"", "-wal", "-shm"}) std::remove((path_ + suffix).c_str());
  }

  // A fresh store connection and controller over the same file, as after kill -9 and a restart.
  void Restart() {
    controller_.reset();
    store_.reset();
    absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(path_);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
    JobControllerOptions options;
    options.store = store_.get();
    options.heartbeat_interval = absl::Seconds(1);
    options.heartbeat_timeout = absl::Seconds(10);
    options.clock = [this] { return now_; };
    absl::StatusOr<std::unique_ptr<JobController>> controller = JobController::Create(options);
    ASSERT_TRUE(controller.ok()) << controller.status();
    controller_ = *std::move(controller);
  }

  std::string Register(v1::WorkerKind kind, const std::string& name,
                       const std::vector<v1::Assignment>& running = {}) {
    v1::RegisterWorkerRequest request;
    request.mutable_worker()->set_kind(kind);
    request.mutable_worker()->set_name(name);
    if (kind == v1::WORKER_KIND_OPTIMIZER_SERVER) {
      request.mutable_worker()->set_address(name + ":50051");
    }
    for (const v1::Assignment& a : running) *request.add_running() = a;
    absl::StatusOr<v1::RegisterWorkerResponse> response = controller_->RegisterWorker(request);
    EXPECT_TRUE(response.ok()) << response.status();
    if (!response.ok()) return "";
    EXPECT_EQ(response->heartbeat_interval_ms(), 1000u);
    EXPECT_EQ(response->heartbeat_timeout_ms(), 10000u);
    return response->worker_id();
  }
  std::string Server(const std::string& name) {
    return Register(v1::WORKER_KIND_OPTIMIZER_SERVER, name);
  }
  std::string Trainer(const std::string& name) { return Register(v1::WORKER_KIND_TRAINER, name); }

  v1::HeartbeatResponse Beat(const std::string& worker,
                             const std::vector<v1::AttemptRef>& running = {},
                             const std::vector<v1::AttemptResult>& finished = {}) {
    v1::HeartbeatRequest request;
    request.set_worker_id(worker);
    for (const v1::AttemptRef& ref : running) *request.add_running() = ref;
    for (const v1::AttemptResult& result : finished) *request.add_finished() = result;
    absl::StatusOr<v1::HeartbeatResponse> response = controller_->Heartbeat(request);
    EXPECT_TRUE(response.ok()) << response.status();
    return response.ok() ? *response : v1::HeartbeatResponse();
  }

  v1::Job Submit(const v1::JobSpec& spec) {
    v1::SubmitJobRequest request;
    *request.mutable_spec() = spec;
    absl::StatusOr<v1::Job> job = controller_->SubmitJob(kOperator, request);
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? *job : v1::Job();
  }

  v1::Job Get(const std::string& id) {
    v1::GetJobRequest request;
    request.set_id(id);
    absl::StatusOr<v1::Job> job = controller_->GetJob(kOperator, request);
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? *job : v1::Job();
  }

  v1::JobActionRequest Action(const std::string& id, const std::string& reason = "") {
    v1::JobActionRequest request;
    request.set_id(id);
    request.set_reason(reason);
    return request;
  }

  std::vector<std::string> Events(const std::string& id) {
    v1::ListJobEventsRequest request;
    request.set_id(id);
    absl::StatusOr<v1::ListJobEventsResponse> response =
        controller_->ListJobEvents(kOperator, request);
    EXPECT_TRUE(response.ok()) << response.status();
    std::vector<std::string> messages;
    if (!response.ok()) return messages;
    uint64_t sequence = 0;
    for (const v1::JobEvent& event : response->events()) {
      EXPECT_EQ(event.sequence(), sequence + 1);
      sequence = event.sequence();
      messages.push_back(event.message());
    }
    return messages;
  }

  absl::StatusOr<v1::ProgressReply> Report(const std::string& job_id, uint32_t attempt,
                                           uint32_t rank, uint64_t step,
                                           uint64_t checkpoint_done = 0,
                                           const std::string& checkpoint_dir = "",
                                           uint64_t checkpoint_step = 0) {
    v1::ProgressReport report;
    *report.mutable_attempt() = Ref(job_id, attempt);
    report.set_rank(rank);
    report.set_step(step);
    report.set_total_steps(100);
    report.set_loss(2.5f);
    report.set_tokens_per_s(1000);
    report.set_loss_scale(65536);
    report.set_checkpoint_request_done(checkpoint_done);
    report.set_checkpoint_dir(checkpoint_dir);
    report.set_checkpoint_step(checkpoint_step);
    return controller_->ReportProgress(report);
  }

  // Takes `job_id`'s attempt through the hand-out: the server gets and acknowledges its
  // assignment, then the trainer gets its own. Returns the trainer's.
  v1::Assignment Handout(const std::string& server, const std::string& trainer,
                         const std::string& job_id, uint32_t attempt) {
    v1::HeartbeatResponse s = Beat(server);
    EXPECT_EQ(s.start_size(), 1);
    v1::HeartbeatResponse early = Beat(trainer);
    EXPECT_EQ(early.start_size(), 0) << "a trainer before its server acknowledged";
    Beat(server, {Ref(job_id, attempt)});
    v1::HeartbeatResponse t = Beat(trainer);
    EXPECT_EQ(t.start_size(), 1);
    return t.start_size() == 1 ? t.start(0) : v1::Assignment();
  }

  absl::Time now_ = absl::FromUnixSeconds(1700000000);
  std::string path_;
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<JobController> controller_;
};

TEST_F(JobControllerTest, SubmitStoresAPendingJob) {
  v1::Job job = Submit(Spec(2, 2));
  EXPECT_EQ(job.id(), "job-1");
  EXPECT_EQ(job.state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(job.attempt(), 0u);
  EXPECT_EQ(job.partition().world_size(), 2u);
  EXPECT_EQ(job.partition().num_shards(), 2u);
  EXPECT_GT(job.partition().num_params(), 0u);
  EXPECT_EQ(job.progress().total_steps(), 100u);
  EXPECT_EQ(job.create_time().seconds(), 1700000000);
  EXPECT_THAT(Events("job-1"), ElementsAre("submitted: test job"));
  EXPECT_EQ(Submit(Spec()).id(), "job-2");
  // Stored before SubmitJob returned: another connection sees it.
  absl::StatusOr<std::unique_ptr<JobStore>> other = JobStore::Open(path_);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ((*other)->LoadJobs()->size(), 2u);
}

TEST_F(JobControllerTest, BadSpecsNameTheField) {
  v1::SubmitJobRequest request;
  request.mutable_spec()->set_name("x");
  absl::StatusOr<v1::Job> job = controller_->SubmitJob(kOperator, request);
  ASSERT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(job.status().message(), HasSubstr("data.path"));

  *request.mutable_spec() = Spec();
  request.mutable_spec()->mutable_parallel()->set_ranks(0);
  job = controller_->SubmitJob(kOperator, request);
  ASSERT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(job.status().message(), HasSubstr("parallel.ranks"));

  *request.mutable_spec() = Spec();
  request.mutable_spec()->mutable_model()->set_channels(100);
  request.mutable_spec()->mutable_model()->set_heads(3);
  job = controller_->SubmitJob(kOperator, request);
  ASSERT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(job.status().message(), HasSubstr("model"));

  // No job was created by any of them.
  v1::ListJobsRequest list;
  EXPECT_EQ(controller_->ListJobs(kOperator, list)->jobs_size(), 0);
}

TEST_F(JobControllerTest, PartitionUsesTheTrainerDefaultsAndOverrides) {
  absl::StatusOr<v1::PartitionMap> demo = PartitionForSpec(Spec());
  ASSERT_TRUE(demo.ok()) << demo.status();
  v1::JobSpec bigger = Spec();
  bigger.mutable_model()->set_layers(8);
  absl::StatusOr<v1::PartitionMap> more = PartitionForSpec(bigger);
  ASSERT_TRUE(more.ok());
  EXPECT_GT(more->num_params(), demo->num_params());
  v1::JobSpec bad = Spec();
  bad.mutable_model()->set_preset("gpt5");
  EXPECT_THAT(PartitionForSpec(bad).status().message(), HasSubstr("model.preset"));
}

// A torch job: no model to lay out (its script's front end does that on the servers), assigned
// like gpu_trainer's, its TorchSpec handed to the trainer worker whole.
TEST_F(JobControllerTest, TorchJobsTakeServersAndTrainersFromThePool) {
  v1::JobSpec spec;
  spec.mutable_torch()->add_command("python3");
  spec.mutable_torch()->add_command("/data/train.py");
  spec.mutable_parallel()->set_ranks(2);
  spec.mutable_parallel()->set_optimizer_servers(2);
  absl::StatusOr<v1::PartitionMap> partition = PartitionForSpec(spec);
  ASSERT_TRUE(partition.ok()) << partition.status();
  EXPECT_EQ(partition->num_params(), 0u);
  EXPECT_EQ(partition->world_size(), 2u);
  EXPECT_EQ(partition->num_shards(), 2u);
  const std::string job_id = Submit(spec).id();
  const std::string s0 = Server("s0"), s1 = Server("s1");
  const std::string t0 = Trainer("t0"), t1 = Trainer("t1");
  ASSERT_EQ(Get(job_id).state(), v1::JOB_STATE_RUNNING);
  Beat(s0);
  Beat(s1);
  Beat(s0, {Ref(job_id, 1)});
  Beat(s1, {Ref(job_id, 1)});
  v1::HeartbeatResponse t = Beat(t0);
  ASSERT_EQ(t.start_size(), 1);
  EXPECT_THAT(t.start(0).spec().torch().command(), ElementsAre("python3", "/data/train.py"));
  EXPECT_EQ(t.start(0).world_size(), 2u);
  EXPECT_THAT(t.start(0).shard_addresses(), ElementsAre("s0:50051", "s1:50051"));
  EXPECT_FALSE(t.start(0).shard_secret().empty());

  v1::JobSpec no_command = spec;
  no_command.mutable_torch()->clear_command();
  v1::SubmitJobRequest request;
  *request.mutable_spec() = no_command;
  absl::StatusOr<v1::Job> refused = controller_->SubmitJob(kOperator, request);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("torch.command: required"));
}

TEST_F(JobControllerTest, ServersGetTheirAssignmentBeforeTrainers) {
  const std::string job_id = Submit(Spec()).id();
  const std::string server = Server("s0");
  const std::string trainer = Trainer("t0");
  v1::Job job = Get(job_id);
  ASSERT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job.attempt(), 1u);
  EXPECT_THAT(job.trainer_workers(), ElementsAre(trainer));
  EXPECT_THAT(job.server_workers(), ElementsAre(server));
  EXPECT_THAT(job.shard_addresses(), ElementsAre("s0:50051"));

  EXPECT_EQ(Beat(trainer).start_size(), 0);
  v1::HeartbeatResponse s = Beat(server);
  ASSERT_EQ(s.start_size(), 1);
  EXPECT_EQ(s.start(0).shard_job_id(), job_id + ".1");
  EXPECT_EQ(s.start(0).shard_index(), 0u);
  EXPECT_EQ(s.start(0).partition().num_shards(), 1u);
  // Given once: the next heartbeat does not repeat it.
  EXPECT_EQ(Beat(server).start_size(), 0);
  EXPECT_EQ(Beat(trainer).start_size(), 0);
  Beat(server, {Ref(job_id, 1)});
  v1::HeartbeatResponse t = Beat(trainer);
  ASSERT_EQ(t.start_size(), 1);
  const v1::Assignment& a = t.start(0);
  EXPECT_EQ(a.job_id(), job_id);
  EXPECT_EQ(a.attempt(), 1u);
  EXPECT_EQ(a.shard_job_id(), job_id + ".1");
  EXPECT_EQ(a.rank(), 0u);
  EXPECT_EQ(a.world_size(), 1u);
  EXPECT_THAT(a.shard_addresses(), ElementsAre("s0:50051"));
  EXPECT_FALSE(a.resume());
  EXPECT_EQ(a.spec().data().path(), "/data/tiny.txt");
  EXPECT_THAT(Events(job_id)[1], HasSubstr("attempt 1 started"));
}

// The attempt's shard secret: the same for its ranks and its shards, another for every attempt,
// and nowhere in the job or its events.
TEST_F(JobControllerTest, EachAttemptHasItsOwnShardSecret) {
  const std::string job_id = Submit(Spec()).id();
  const std::string server = Server("s0"), trainer = Trainer("t0");
  v1::HeartbeatResponse s = Beat(server);
  ASSERT_EQ(s.start_size(), 1);
  const std::string secret = s.start(0).shard_secret();
  EXPECT_EQ(secret.size(), 64u);  // HMAC-SHA256 in hex
  Beat(server, {Ref(job_id, 1)});
  v1::HeartbeatResponse t = Beat(trainer);
  ASSERT_EQ(t.start_size(), 1);
  EXPECT_EQ(t.start(0).shard_secret(), secret);
  EXPECT_EQ(Get(job_id).DebugString().find(secret), std::string::npos);
  for (const std::string& event : Events(job_id)) EXPECT_EQ(event.find(secret), std::string::npos);

  // Another attempt of the same job: another secret.
  ASSERT_TRUE(controller_->PauseJob(kOperator, Action(job_id)).ok());
  Beat(trainer, {}, {Result(job_id, 1, 130)});
  ASSERT_EQ(Get(job_id).state(), v1::JOB_STATE_PAUSED);
  EXPECT_EQ(Beat(server, {Ref(job_id, 1)}).stop_size(), 1);
  Beat(server);
  ASSERT_TRUE(controller_->ResumeJob(kOperator, Action(job_id)).ok());
  v1::HeartbeatResponse s2 = Beat(server);
  ASSERT_EQ(s2.start_size(), 1);
  EXPECT_EQ(s2.start(0).attempt(), 2u);
  EXPECT_NE(s2.start(0).shard_secret(), secret);
  Beat(server, {Ref(job_id, 2)});
  v1::HeartbeatResponse t2 = Beat(trainer);
  ASSERT_EQ(t2.start_size(), 1);
  EXPECT_EQ(t2.start(0).shard_secret(), s2.start(0).shard_secret());
}

TEST_F(JobControllerTest, TwoRanksTwoShards) {
  const std::string job_id = Submit(Spec(2, 2)).id();
  const std::string s0 = Server("s0"), s1 = Server("s1");
  const std::string t0 = Trainer("t0"), t1 = Trainer("t1");
  ASSERT_EQ(Get(job_id).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Beat(s0).start(0).shard_index(), 0u);
  EXPECT_EQ(Beat(s1).start(0).shard_index(), 1u);
  Beat(s0, {Ref(job_id, 1)});
  // One server acknowledged of two: the trainers still wait.
  EXPECT_EQ(Beat(t0).start_size(), 0);
  Beat(s1, {Ref(job_id, 1)});
  v1::HeartbeatResponse r0 = Beat(t0), r1 = Beat(t1);
  ASSERT_EQ(r0.start_size(), 1);
  ASSERT_EQ(r1.start_size(), 1);
  EXPECT_EQ(r0.start(0).rank(), 0u);
  EXPECT_EQ(r1.start(0).rank(), 1u);
  EXPECT_EQ(r1.start(0).world_size(), 2u);
  EXPECT_THAT(r1.start(0).shard_addresses(), ElementsAre("s0:50051", "s1:50051"));
}

TEST_F(JobControllerTest, RanksOnOneHostLearnTheirPlaceAmongThem) {
  // Three ranks on host a (a pod of several GPUs, its workers sharing the pod's address) and one
  // on host b: each CUDA rank takes the GPU of its place on its host.
  const std::string s0 = Server("s0");
  std::vector<std::string> trainers(4);
  const char* hosts[4] = {"10.0.0.1", "10.0.0.2", "10.0.0.1", "10.0.0.1"};
  for (int index = 0; index < 4; ++index) {
    v1::RegisterWorkerRequest request;
    request.mutable_worker()->set_kind(v1::WORKER_KIND_TRAINER);
    request.mutable_worker()->set_name(absl::StrCat("t", index));
    request.mutable_worker()->set_hostname(hosts[index]);
    request.mutable_worker()->set_index(index);
    absl::StatusOr<v1::RegisterWorkerResponse> r = controller_->RegisterWorker(request);
    ASSERT_TRUE(r.ok()) << r.status();
    trainers[index] = r->worker_id();
  }
  const std::string job_id = Submit(Spec(4, 1)).id();
  Beat(s0);
  Beat(s0, {Ref(job_id, 1)});
  const uint32_t local_rank[4] = {0, 0, 1, 2}, local_ranks[4] = {3, 1, 3, 3};
  for (int index = 0; index < 4; ++index) {
    v1::HeartbeatResponse r = Beat(trainers[index]);
    ASSERT_EQ(r.start_size(), 1);
    EXPECT_EQ(r.start(0).rank(), static_cast<uint32_t>(index));
    EXPECT_EQ(r.start(0).local_rank(), local_rank[index]) << index;
    EXPECT_EQ(r.start(0).local_ranks(), local_ranks[index]) << index;
  }
}

TEST_F(JobControllerTest, RanksFollowWorkerIndexes) {
  // Pods of an Indexed Job register in any order; rank i goes to the worker with index i.
  const std::string s0 = Server("s0");
  std::vector<std::string> trainers(3);
  for (int index : {2, 0, 1}) {
    v1::RegisterWorkerRequest request;
    request.mutable_worker()->set_kind(v1::WORKER_KIND_TRAINER);
    request.mutable_worker()->set_name(absl::StrCat("pod-", index));
    request.mutable_worker()->set_index(index);
    absl::StatusOr<v1::RegisterWorkerResponse> r = controller_->RegisterWorker(request);
    ASSERT_TRUE(r.ok()) << r.status();
    trainers[index] = r->worker_id();
  }
  const std::string job_id = Submit(Spec(3, 1)).id();
  ASSERT_EQ(Get(job_id).state(), v1::JOB_STATE_RUNNING);
  Beat(s0);
  Beat(s0, {Ref(job_id, 1)});
  for (uint32_t index = 0; index < 3; ++index) {
    v1::HeartbeatResponse r = Beat(trainers[index]);
    ASSERT_EQ(r.start_size(), 1);
    EXPECT_EQ(r.start(0).rank(), index);
  }
}

TEST_F(JobControllerTest, ProgressUpdatesTheJob) {
  const std::string job_id = Submit(Spec()).id();
  const std::string server = Server("s0"), trainer = Trainer("t0");
  Handout(server, trainer, job_id, 1);
  absl::StatusOr<v1::ProgressReply> reply = Report(job_id, 1, 0, 10);
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->request(), v1::JOB_REQUEST_NONE);
  EXPECT_EQ(reply->checkpoint_request(), 0u);
  now_ += absl::Seconds(10);
  ASSERT_TRUE(Report(job_id, 1, 0, 20).ok());
  v1::JobProgress p = Get(job_id).progress();
  EXPECT_EQ(p.step(), 20u);
  EXPECT_EQ(p.total_steps(), 100u);
  EXPECT_FLOAT_EQ(p.loss(), 2.5f);
  EXPECT_DOUBLE_EQ(p.tokens_per_s(), 1000);
  EXPECT_FLOAT_EQ(p.loss_scale(), 65536);
  // 10 steps in 10 s, 80 to go.
  EXPECT_NEAR(p.eta_seconds(), 80, 1e-9);
  // Other ranks are heard but do not speak for the job.
  ASSERT_TRUE(Report(job_id, 1, 1, 99).ok());
  EXPECT_EQ(Get(job_id).progress().step(), 20u);
  // A stale attempt is told so.
  absl::StatusOr<v1::ProgressReply> stale = Report(job_id, 7, 0, 1);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(stale.status().message(), "attempt 7 of job " + job_id + " is no longer current");
  EXPECT_EQ(Report("job-99", 1, 0, 1).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(JobControllerTest, ProgressIsPersistedAtMostOncePerSecond) {
  const std::string job_id = Submit(Spec(1, 1, "/ckpt")).id();
  const std::string server = Server("s0"), trainer = Trainer("t0");
  Handout(server, trainer, job_id, 1);
  absl::StatusOr<std::unique_ptr<JobStore>> other = JobStore::Open(path_);
  ASSERT_TRUE(other.ok());
  auto stored_step = [&] { return (*other)->LoadJobs()->at(0).progress().step(); };
  ASSERT_TRUE(Report(job_id, 1, 0, 1).ok());
  EXPECT_EQ(stored_step(), 0u);  // same instant as the last write
  now_ += absl::Milliseconds(1500);
  ASSERT_TRUE(Report(job_id, 1, 0, 2).ok());
  EXPECT_EQ(stored_step(), 2u);
  now_ += absl::Milliseconds(100);
  ASSERT_TRUE(Report(job_id, 1, 0, 3).ok());
  EXPECT_EQ(stored_step(), 2u);
  // A checkpoint is written at once.
  ASSERT_TRUE(Report(job_id, 1, 0, 4, 0, "/ckpt/step-4", 4).ok());
  EXPECT_EQ(stored_step(), 4u);
  EXPECT_EQ((*other)->LoadJobs()->at(0).progress().last_checkpoint(), "/ckpt/step-4");
  // Tick writes what the throttle held back.
  ASSERT_TRUE(Report(job_id, 1, 0, 5).ok());
  EXPECT_EQ(stored_step(), 4u);
  now_ += absl::Seconds(2);
  ASSERT_TRUE(controller_->Tick().ok());
  EXPECT_EQ(stored_step(), 5u);
}

TEST_F(JobControllerTest, SuccessFreesTheWorkers) {
  const std::string job_id = Submit(Spec()).id();
  const std::string server = Server("s0"), trainer = Trainer("t0");
  Handout(server, trainer, job_id, 1);
  ASSERT_TRUE(Report(job_id, 1, 0, 100).ok());
  EXPECT_THAT(Beat(trainer, {}, {Result(job_id, 1, 0)}).stop(), IsEmpty());
  v1::Job job = Get(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(job.reason(), "succeeded at step 100");
  EXPECT_THAT(job.trainer_workers(), IsEmpty());
  EXPECT_THAT(job.server_workers(), IsEmpty());
  EXPECT_THAT(job.shard_addresses(), IsEmpty());
  // The server drops the shard job.
  v1::HeartbeatResponse s = Beat(server, {Ref(job_id, 1)});
  ASSERT_EQ(s.stop_size(), 1);
  EXPECT_EQ(s.stop(0).job_id(), job_id);
  // Both are free again: the next job takes them.
  Beat(server);
  const std::string next = Submit(Spec()).id();
  job = Get(next);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(job.trainer_workers(), ElementsAre(trainer));
  EXPECT_THAT(job.server_workers(), ElementsAre(server));
  // Finished jobs take no more actions.
  EXPECT_EQ(controller_->CancelJob(kOperator, Action(job_id)).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(JobControllerTest, PauseThenResumeStartsANewAttemptThatResumes) {
  const std::string job_id = Submit(Spec(1, 1, "/ckpt")).id();
  const std::string server = Server("s0"), trainer = Trainer("t0");
  Handout(server, trainer, job_id, 1);
  absl::StatusOr<v1::Job> paused = controller_->PauseJob(kOperator, Action(job_id, "maintenance"));
  ASSERT_TRUE(paused.ok()) << paused.status();
  EXPECT_EQ(paused->state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(paused->request(), v1::JOB_REQUEST_PAUSE);
  EXPECT_EQ(Report(job_id, 1, 0, 30)->request(), v1::JOB_REQUEST_PAUSE);
  // Pausing twice is harmless; resuming a job that is still stopping is not allowed.
  EXPECT_TRUE(controller_->PauseJob(kOperator, Action(job_id)).ok());
  EXPECT_EQ(controller_->ResumeJob(kOperator, Action(job_id)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  Beat(trainer, {}, {Result(job_id, 1, 130)});
  EXPECT_EQ(Get(job_id).state(), v1::JOB_STATE_PAUSED);
  EXPECT_EQ(Get(job_id).reason(), "paused at step 30");
  EXPECT_EQ(Get(job_id).request(), v1::JOB_REQUEST_NONE);
  EXPECT_EQ(Beat(server, {Ref(job_id, 1)}).stop_size(), 1);
  Beat(server);
  EXPECT_EQ(Get(job_id).state(), v1::JOB_STATE_PAUSED);  // free workers do not restart it

  absl::StatusOr<v1::Job> resumed = controller_->ResumeJob(kOperator, Action(job_id, "back"));
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  // Resumed to PENDING and at once scheduled on the free workers.
  EXPECT_EQ(resumed->state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(resumed->attempt(), 2u);
  v1::Assignment a = Handout(server, trainer, job_id, 2);
  EXPECT_TRUE(a.resume());
  EXPECT_EQ(a.shard_job_id(), job_id + ".2");
  std::vector<std::string> events = Events(job_id);
  EXPECT_THAT(events, ::testing::Contains("pause requested: maintenance"));
  EXPECT_THAT(events, ::testing::Contains("paused at step 30"));
  EXPECT_THAT(events, ::testing::Contains("resumed: back"));
}

TEST_F(JobControllerTest, ASignalledTrainerPausesTheJob) {
  const std::string job_id = Submit(Spec()).id();
  const std::string server = Server("s0"), trainer = Trainer("t0");
  Handout(server, trainer, job_id, 1);
  Beat(trainer, {}, {Result(job_id, 1, 130)});
  EXPECT_EQ(Get(job_id).state(), v1::JOB_STATE_PAUSED);
  EXPECT_THAT(Get(job_id).reason(), HasSubstr("stopped by a signal"));
}

TEST_F(JobControllerTest, PausingAPendingJobIsImmediate) {
  const std::string job_id = Submit(Spec()).id();
  absl::StatusOr<v1::Job> job = controller_->PauseJob(kOperator, Action(job_id));
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->state(), v1::JOB_STATE_PAUSED);
  Server("s0");
  Trainer("t0");
  EXPECT_EQ(Get(job_id).state(), v1::JOB_STATE_PAUSED);
  job = controller_->ResumeJob(kOperator, Action(job_id));
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job->attempt(), 1u);
}

TEST_F(JobControllerTest, CheckpointRequests) {
  const std::string no_dir = Submit(Spec()).id();
  EXPECT_EQ(controller_->CheckpointJob(kOperator, Action(no_dir)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  controller_->CancelJob(kOperator, Action(no_dir)).IgnoreError();

  const std::string job_id = Submit(Spec(1, 1, "/ckpt")).id();
  // Not running yet.
  EXPECT_EQ(controller_->CheckpointJob(kOperator, Action(job_id)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  const std::string server = Server("s0"), trainer = Trainer("t0");
  Handout(server, trainer, job_id, 1);
  absl::StatusOr<v1::Job> job =
      controller_->CheckpointJob(kOperator, Action(job_id, "before upgrade"));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::JOB_STATE_CHECKPOINTING);
  EXPECT_EQ(controller_->CheckpointJob(kOperator, Action(job_id)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Report(job_id, 1, 0, 5)->checkpoint_request(), 1u);
  EXPECT_EQ(Get(job_id).state(), v1::JOB_STATE_CHECKPOINTING);
  absl::StatusOr<v1::ProgressReply> reply = Report(job_id, 1, 0, 6, 1, "/ckpt/step-6", 6);
  ASSERT_TRUE(reply.ok());
  EXPECT_EQ(reply->checkpoint_request(), 1u);
  job = Get(job_id);
  EXPECT_EQ(job->state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job->progress().last_checkpoint(), "/ckpt/step-6");
  EXPECT_EQ(job->progress().last_checkpoint_step(), 6u);
  EXPECT_THAT(Events(job_id), ::testing::Contains("checkpoint at step 6: /ckpt/step-6"));
  // The counter goes on with the next request.
  ASSERT_TRUE(controller_->CheckpointJob(kOperator, Action(job_id)).ok());
  EXPECT_EQ(Report(job_id, 1, 0, 7, 1)->checkpoint_request(), 2u);
}

TEST_F(JobControllerTest, Cancel) {
  const std::string pending = Submit(Spec()).id();
  absl::StatusOr<v1::Job> job = controller_->CancelJob(kOperator, Action(pending, "typo"));
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(job->reason(), "cancelled: typo");
  EXPECT_EQ(controller_->CancelJob(kOperator, Action(pending)).status().code(),
            absl::StatusCode::kFailedPrecondition);

  const std::string running = Submit(Spec()).id();
  const std::string server = Server("s0"), trainer = Trainer("t0");
  Handout(server, trainer, running, 1);
  job = controller_->CancelJob(kOperator, Action(running));
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job->request(), v1::JOB_REQUEST_CANCEL);
  EXPECT_EQ(Report(running, 1, 0, 3)->request(), v1::JOB_REQUEST_CANCEL);
  Beat(trainer, {}, {Result(running, 1, 130)});
  EXPECT_EQ(Get(running).state(), v1::JOB_STATE_CANCELLED);
}

TEST_F(JobControllerTest, StoppingBeforeAnyRankStartedEndsTheAttemptAtOnce) {
  const std::string job_id = Submit(Spec()).id();
  const std::string server = Server("s0"), trainer = Trainer("t0");
  ASSERT_EQ(Beat(server).start_size(), 1);  // the server has its assignment, the trainer not yet
  absl::StatusOr<v1::Job> job = controller_->CancelJob(kOperator, Action(job_id, "wrong data"));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(job->reason(), "cancelled: wrong data");
  EXPECT_THAT(job->server_workers(), IsEmpty());
  v1::HeartbeatResponse r = Beat(server, {Ref(job_id, 1)});
  EXPECT_EQ(r.start_size(), 0);
  ASSERT_EQ(r.stop_size(), 1);
  r = Beat(trainer);
  EXPECT_EQ(r.start_size(), 0);
  EXPECT_EQ(r.stop_size(), 0);

  const std::string second = Submit(Spec()).id();
  Beat(server);
  ASSERT_EQ(Get(second).state(), v1::JOB_STATE_RUNNING);
  job = controller_->PauseJob(kOperator, Action(second));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::JOB_STATE_PAUSED);
}

TEST_F(JobControllerTest, AWorkerIsNeverInTwoJobs) {
  const std::string first = Submit(Spec()).id();
  const std::string second = Submit(Spec()).id();
  const std::string s0 = Server("s0"), s1 = Server("s1");
  const std::string trainer = Trainer("t0");
  EXPECT_EQ(Get(first).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Get(second).state(), v1::JOB_STATE_PENDING);
  EXPECT_THAT(Get(first).trainer_workers(), ElementsAre(trainer));
  Handout(s0, trainer, first, 1);
  Beat(s1);
  EXPECT_EQ(Get(second).state(), v1::JOB_STATE_PENDING);
  // The trainer is still busy with the first job: nothing for it.
  EXPECT_EQ(Beat(trainer, {Ref(first, 1)}).start_size(), 0);
  Beat(trainer, {}, {Result(first, 1, 0)});
  v1::Job job = Get(second);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(job.trainer_workers(), ElementsAre(trainer));
  EXPECT_THAT(job.server_workers(), ElementsAre(s1));
}

// A server that keeps heartbeating but never lists the attempt it was handed (stuck before it
// started it) fails the attempt a heartbeat timeout after the hand-out, instead of holding its
// trainers back forever.
TEST_F(JobControllerTest, AnUnacknowledgedAssignmentFailsTheAttempt) {
  const std::string job_id = Submit(Spec()).id();
  const std::string server = Server("s0"), trainer = Trainer("t0");
  ASSERT_EQ(Beat(server).start_size(), 1);
  for (int i = 0; i < 9; ++i) {
    now_ += absl::Seconds(1);
    Beat(server);  // alive, but not running it
    EXPECT_EQ(Beat(trainer).start_size(), 0);
    ASSERT_TRUE(controller_->Tick().ok());
  }
  EXPECT_EQ(Get(job_id).state(), v1::JOB_STATE_RUNNING);  // within the timeout: still waiting
  now_ += absl::Seconds(2);
  Beat(server);
  Beat(trainer);
  ASSERT_TRUE(controller_->Tick().ok());
  v1::Job job = Get(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(job.reason(), HasSubstr("worker " + server +
                                      " (s0) heartbeats but did not acknowledge attempt 1 within "
                                      "10s of receiving it"));
}

// A worker cut off from the controller longer than the heartbeat timeout, whose rank still reaches
// its shards, registers again when the link is back and keeps its attempt: no restart.
TEST_F(JobControllerTest, AWorkerBackWithinTheGraceKeepsItsAttempt) {
  const std::string job_id = Submit(Spec(1, 1, "/ckpt", 1)).id();
  const std::string server = Server("s0"), trainer = Trainer("t0");
  v1::Assignment a = Handout(server, trainer, job_id, 1);
  now_ += absl::Seconds(11);
  Beat(server, {Ref(job_id, 1)});
  ASSERT_TRUE(controller_->Tick().ok());
  EXPECT_THAT(Get(job_id).trainer_workers(), ElementsAre(""));
  EXPECT_THAT(Events(job_id).back(), HasSubstr("lost its heartbeat; the attempt goes on"));
  // The link is back: its heartbeat is unknown, so it registers again with what it runs.
  v1::HeartbeatRequest request;
  request.set_worker_id(trainer);
  EXPECT_EQ(controller_->Heartbeat(request).status().code(), absl::StatusCode::kNotFound);
  now_ += absl::Seconds(4);
  const std::string again = Register(v1::WORKER_KIND_TRAINER, "t0", {a});
  v1::HeartbeatResponse r = Beat(again, {Ref(job_id, 1)});
  EXPECT_EQ(r.stop_size(), 0);
  now_ += absl::Seconds(20);  // past the slot's deadline, which no longer applies
  Beat(server, {Ref(job_id, 1)});
  Beat(again, {Ref(job_id, 1)});
  ASSERT_TRUE(controller_->Tick().ok());
  now_ += absl::Seconds(5);
  Beat(server, {Ref(job_id, 1)});
  Beat(again, {Ref(job_id, 1)});
  ASSERT_TRUE(controller_->Tick().ok());
  v1::Job job = Get(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job.attempt(), 1u);
  EXPECT_EQ(job.restarts(), 0u);
  EXPECT_THAT(job.trainer_workers(), ElementsAre(again));
}

// The whole pool cut off at once: every slot waits, the server comes back first, then the trainer.
TEST_F(JobControllerTest, EveryWorkerBackWithinTheGraceKeepsTheAttempt) {
  const std::string job_id = Submit(Spec(1, 1, "/ckpt", 1)).id();
  const std::string server = Server("s0"), trainer = Trainer("t0");
  v1::Assignment t = Handout(server, trainer, job_id, 1);
  v1::Assignment s;
  s.set_job_id(job_id);
  s.set_attempt(1);
  s.set_shard_index(0);
  now_ += absl::Seconds(11);
  ASSERT_TRUE(controller_->Tick().ok());
  EXPECT_THAT(Get(job_id).trainer_workers(), ElementsAre(""));
  EXPECT_THAT(Get(job_id).server_workers(), ElementsAre(""));
  now_ += absl::Seconds(3);
  const std::string server2 = Register(v1::WORKER_KIND_OPTIMIZER_SERVER, "s0", {s});
  EXPECT_EQ(Beat(server2, {Ref(job_id, 1)}).stop_size(), 0);
  now_ += absl::Seconds(1);
  const std::string trainer2 = Register(v1::WORKER_KIND_TRAINER, "t0", {t});
  EXPECT_EQ(Beat(trainer2, {Ref(job_id, 1)}).stop_size(), 0);
  now_ += absl::Seconds(30);
  for (int i = 0; i < 3; ++i) {
    Beat(server2, {Ref(job_id, 1)});
    Beat(trainer2, {Ref(job_id, 1)});
    ASSERT_TRUE(controller_->Tick().ok());
    now_ += absl::Seconds(1);
  }
  v1::Job job = Get(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job.restarts(), 0u);
  EXPECT_THAT(job.trainer_workers(), ElementsAre(trainer2));
  EXPECT_THAT(job.server_workers(), ElementsAre(server2));
}

// The rank finished while its worker was cut off: the worker registers again still claiming the
// attempt (its result is not delivered yet), and the result its next heartbeat carries ends the
// job as it would have without the cut.
TEST_F(JobControllerTest, AResultFromAWorkerBackAfterTheCutEndsTheJob) {
  const std::string job_id = Submit(Spec(1, 1, "/ckpt", 1)).id();
  const std::string server = Server("s0"), trainer = Trainer("t0");
  v1::Assignment t = Handout(server, trainer, job_id, 1);
  ASSERT_TRUE(Report(job_id, 1, 0, 100).ok());
  now_ += absl::Seconds(11);
  Beat(server, {Ref(job_id, 1)});
  ASSERT_TRUE(controller_->Tick().ok());
  const std::string again = Register(v1::WORKER_KIND_TRAINER, "t0", {t});
  EXPECT_EQ(Beat(again, {}, {Result(job_id, 1, 0)}).stop_size(), 0);
  v1::Job job = Get(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(job.restarts(), 0u);
}

TEST_F(JobControllerTest, ALostWorkerRestartsTheJobThenFailsIt) {
  const std::string job_id = Submit(Spec(1, 1, "/ckpt", 1)).id();
  const std::string server = Server("s0");
  std::string trainer = Trainer("t0");
  Handout(server, trainer, job_id, 1);
  ASSERT_TRUE(Report(job_id, 1, 0, 10, 0, "/ckpt/step-10", 10).ok());
  now_ += absl::Seconds(6);
  Beat(server, {Ref(job_id, 1)});
  now_ += absl::Seconds(6);
  ASSERT_TRUE(controller_->Tick().ok());
  // Its slot waits twice the heartbeat timeout for it (a cut link is not a death)...
  v1::Job job = Get(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(job.trainer_workers(), ElementsAre(""));
  for (int i = 0; i < 3; ++i) {
    now_ += absl::Seconds(5);
    Beat(server, {Ref(job_id, 1)});
    ASSERT_TRUE(controller_->Tick().ok());
    EXPECT_EQ(Get(job_id).state(), v1::JOB_STATE_RUNNING);
  }
  // ...and the attempt restarts when it has not come back by then.
  now_ += absl::Seconds(5);
  Beat(server, {Ref(job_id, 1)});
  ASSERT_TRUE(controller_->Tick().ok());
  job = Get(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(job.restarts(), 1u);
  EXPECT_THAT(job.reason(),
              HasSubstr("restarting from the last checkpoint after: worker " + trainer +
                        " (t0) lost its heartbeat and did not come back within 20s"));
  // The dead worker is gone; the server stops its shard job.
  v1::HeartbeatRequest request;
  request.set_worker_id(trainer);
  absl::StatusOr<v1::HeartbeatResponse> gone = controller_->Heartbeat(request);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(gone.status().message(), "unknown worker; register again");
  EXPECT_EQ(Beat(server, {Ref(job_id, 1)}).stop_size(), 1);
  Beat(server);

  trainer = Trainer("t1");
  job = Get(job_id);
  ASSERT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job.attempt(), 2u);
  EXPECT_TRUE(Handout(server, trainer, job_id, 2).resume());
  // Attempt 1's ranks, if any are left, are turned away.
  EXPECT_EQ(Report(job_id, 1, 0, 11).status().code(), absl::StatusCode::kFailedPrecondition);

  now_ += absl::Seconds(6);
  Beat(server, {Ref(job_id, 2)});
  now_ += absl::Seconds(6);
  ASSERT_TRUE(controller_->Tick().ok());
  for (int i = 0; i < 4; ++i) {
    now_ += absl::Seconds(5);
    Beat(server, {Ref(job_id, 2)});
    ASSERT_TRUE(controller_->Tick().ok());
  }
  job = Get(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.reason(),
            "worker " + trainer + " (t1) lost its heartbeat and did not come back within 20s");

  // What the metrics read: both losses, one restart, the job failed, the server still there.
  const JobController::Stats stats = controller_->GetStats();
  EXPECT_EQ(stats.heartbeat_timeouts[0], 2u);  // trainers
  EXPECT_EQ(stats.heartbeat_timeouts[1], 0u);
  EXPECT_EQ(stats.attempt_failures, 2u);
  EXPECT_EQ(stats.restarts, 1u);
  EXPECT_EQ(stats.jobs.at(v1::JOB_STATE_FAILED), 1);
  EXPECT_EQ(stats.jobs.at(v1::JOB_STATE_RUNNING), 0);
  EXPECT_EQ(stats.jobs.size(), 7u);  // every state, zeros included
  EXPECT_EQ(stats.workers[0][0] + stats.workers[0][1], 0);
  EXPECT_EQ(stats.workers[1][0] + stats.workers[1][1], 1);
}

TEST(ControllerMetricsTest, StateLabels) {
  EXPECT_EQ(JobStateLabel(v1::JOB_STATE_PENDING), "pending");
  EXPECT_EQ(JobStateLabel(v1::JOB_STATE_CHECKPOINTING), "checkpointing");
}

TEST_F(JobControllerTest, ARankErrorFailsAJobWithoutCheckpoints) {
  const std::string job_id = Submit(Spec(1, 1, "", 3)).id();
  const std::string server = Server("s0"), trainer = Trainer("t0");
  Handout(server, trainer, job_id, 1);
  Beat(trainer, {}, {Result(job_id, 1, 1, "out of memory")});
  v1::Job job = Get(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job.reason(), "rank 0 on " + trainer + " (t0) exited with code 1: out of memory");
  EXPECT_EQ(job.restarts(), 0u);
}

TEST_F(JobControllerTest, AControllerRestartLosesNothing) {
  const std::string running = Submit(Spec(1, 1, "/ckpt")).id();
  const std::string server = Server("s0"), trainer = Trainer("t0");
  Handout(server, trainer, running, 1);
  v1::Assignment server_assignment;
  {
    // What the server runs: the assignment it got (re-made here from the job).
    v1::Job job = Get(running);
    server_assignment.set_job_id(running);
    server_assignment.set_attempt(1);
    server_assignment.set_shard_index(0);
  }
  v1::Assignment trainer_assignment;
  trainer_assignment.set_job_id(running);
  trainer_assignment.set_attempt(1);
  trainer_assignment.set_rank(0);
  ASSERT_TRUE(Report(running, 1, 0, 10, 0, "/ckpt/step-10", 10).ok());
  const std::string pending = Submit(Spec()).id();
  const std::string paused = Submit(Spec()).id();
  ASSERT_TRUE(controller_->PauseJob(kOperator, Action(paused)).ok());
  const std::vector<std::string> events_before = Events(running);

  now_ += absl::Seconds(30);
  Restart();
  EXPECT_EQ(Get(pending).state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(Get(paused).state(), v1::JOB_STATE_PAUSED);
  v1::Job job = Get(running);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job.attempt(), 1u);
  EXPECT_EQ(job.progress().last_checkpoint_step(), 10u);
  EXPECT_THAT(job.trainer_workers(), ElementsAre(""));
  std::vector<std::string> events_after = Events(running);
  ASSERT_GT(events_after.size(), events_before.size());
  EXPECT_TRUE(std::equal(events_before.begin(), events_before.end(), events_after.begin()));
  // The old worker ids mean nothing to the new controller.
  v1::HeartbeatRequest old;
  old.set_worker_id(server);
  EXPECT_EQ(controller_->Heartbeat(old).status().code(), absl::StatusCode::kNotFound);
  // The job counter goes on where it was.
  EXPECT_EQ(Submit(Spec()).id(), "job-4");

  const std::string server2 = Register(v1::WORKER_KIND_OPTIMIZER_SERVER, "s0", {server_assignment});
  const std::string trainer2 = Register(v1::WORKER_KIND_TRAINER, "t0", {trainer_assignment});
  job = Get(running);
  EXPECT_THAT(job.trainer_workers(), ElementsAre(trainer2));
  EXPECT_THAT(job.server_workers(), ElementsAre(server2));
  // Taken back: no start, no stop.
  v1::HeartbeatResponse r = Beat(trainer2, {Ref(running, 1)});
  EXPECT_EQ(r.start_size(), 0);
  EXPECT_EQ(r.stop_size(), 0);
  EXPECT_TRUE(Report(running, 1, 0, 11).ok());
  now_ += absl::Seconds(11);
  Beat(server2, {Ref(running, 1)});
  Beat(trainer2, {Ref(running, 1)});
  ASSERT_TRUE(controller_->Tick().ok());
  EXPECT_EQ(Get(running).state(), v1::JOB_STATE_RUNNING);
  // A second worker claiming the same slot is told to stop.
  const std::string impostor = Register(v1::WORKER_KIND_TRAINER, "t9", {trainer_assignment});
  r = Beat(impostor, {Ref(running, 1)});
  ASSERT_EQ(r.stop_size(), 1);
  EXPECT_EQ(r.stop(0).job_id(), running);
}

TEST_F(JobControllerTest, AVacantSlotAfterARestartFailsTheAttempt) {
  const std::string job_id = Submit(Spec(1, 1, "/ckpt", 1)).id();
  const std::string server = Server("s0"), trainer = Trainer("t0");
  Handout(server, trainer, job_id, 1);
  Restart();
  v1::Assignment a;
  a.set_job_id(job_id);
  a.set_attempt(1);
  a.set_shard_index(0);
  const std::string server2 = Register(v1::WORKER_KIND_OPTIMIZER_SERVER, "s0", {a});
  now_ += absl::Seconds(5);
  Beat(server2, {Ref(job_id, 1)});
  ASSERT_TRUE(controller_->Tick().ok());
  EXPECT_EQ(Get(job_id).state(), v1::JOB_STATE_RUNNING);
  now_ += absl::Seconds(6);
  Beat(server2, {Ref(job_id, 1)});
  ASSERT_TRUE(controller_->Tick().ok());
  v1::Job job = Get(job_id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_PENDING);
  EXPECT_THAT(job.reason(),
              HasSubstr("worker for rank 0 did not come back after the controller restarted"));
  EXPECT_EQ(Beat(server2, {Ref(job_id, 1)}).stop_size(), 1);
}

TEST_F(JobControllerTest, Rendezvous) {
  const std::string job_id = Submit(Spec(2, 1)).id();
  const std::string server = Server("s0"), t0 = Trainer("t0"), t1 = Trainer("t1");
  ASSERT_EQ(Get(job_id).state(), v1::JOB_STATE_RUNNING);
  v1::RendezvousSetRequest set;
  *set.mutable_attempt() = Ref(job_id, 1);
  set.set_key("rank0");
  set.set_value("10.0.0.1:4000");
  ASSERT_TRUE(controller_->RendezvousSet(set).ok());

  v1::RendezvousGetRequest get;
  *get.mutable_attempt() = Ref(job_id, 1);
  get.add_keys("rank0");
  get.set_timeout_ms(1000);
  absl::StatusOr<v1::RendezvousGetResponse> got = controller_->RendezvousGet(get);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_THAT(got->values(), ElementsAre("10.0.0.1:4000"));

  // A get waits for a key set later by another rank.
  get.add_keys("rank1");
  get.set_timeout_ms(10000);
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(50));
    v1::RendezvousSetRequest later = set;
    later.set_key("rank1");
    later.set_value("10.0.0.2:4000");
    EXPECT_TRUE(controller_->RendezvousSet(later).ok());
  });
  got = controller_->RendezvousGet(get);
  setter.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_THAT(got->values(), ElementsAre("10.0.0.1:4000", "10.0.0.2:4000"));

  get.add_keys("never");
  get.set_timeout_ms(30);
  got = controller_->RendezvousGet(get);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(got.status().message(), HasSubstr("'never'"));

  v1::RendezvousGetRequest stale = get;
  *stale.mutable_attempt() = Ref(job_id, 2);
  EXPECT_EQ(controller_->RendezvousGet(stale).status().code(),
            absl::StatusCode::kFailedPrecondition);

  // A waiting get learns that its attempt ended.
  get.set_timeout_ms(10000);
  std::thread ender([&] {
    absl::SleepFor(absl::Milliseconds(50));
    Beat(t1, {}, {Result(job_id, 1, 2, "boom")});
  });
  got = controller_->RendezvousGet(get);
  ender.join();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
  EXPECT_EQ(Get(job_id).state(), v1::JOB_STATE_FAILED);
}

TEST_F(JobControllerTest, ListJobsNewestFirstWithPagesAndFilters) {
  for (int i = 0; i < 5; ++i) Submit(Spec());
  ASSERT_TRUE(controller_->CancelJob(kOperator, Action("job-2")).ok());
  v1::ListJobsRequest request;
  request.set_page_size(2);
  absl::StatusOr<v1::ListJobsResponse> page = controller_->ListJobs(kOperator, request);
  ASSERT_TRUE(page.ok());
  ASSERT_EQ(page->jobs_size(), 2);
  EXPECT_EQ(page->jobs(0).id(), "job-5");
  EXPECT_EQ(page->jobs(1).id(), "job-4");
  std::vector<std::string> ids;
  while (true) {
    for (const v1::Job& job : page->jobs()) ids.push_back(job.id());
    if (page->next_page_token().empty()) break;
    request.set_page_token(page->next_page_token());
    page = controller_->ListJobs(kOperator, request);
    ASSERT_TRUE(page.ok());
  }
  EXPECT_THAT(ids, ElementsAre("job-5", "job-4", "job-3", "job-2", "job-1"));

  v1::ListJobsRequest cancelled;
  cancelled.add_states(v1::JOB_STATE_CANCELLED);
  page = controller_->ListJobs(kOperator, cancelled);
  ASSERT_EQ(page->jobs_size(), 1);
  EXPECT_EQ(page->jobs(0).id(), "job-2");

  request.set_page_token("garbage");
  EXPECT_EQ(controller_->ListJobs(kOperator, request).status().code(),
            absl::StatusCode::kInvalidArgument);

  v1::GetJobRequest get;
  EXPECT_EQ(controller_->GetJob(kOperator, get).status().code(),
            absl::StatusCode::kInvalidArgument);
  get.set_id("job-77");
  EXPECT_EQ(controller_->GetJob(kOperator, get).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(controller_->GetJob(kOperator, get).status().message(), "job job-77 not found");
}

TEST_F(JobControllerTest, RegisterValidatesTheWorker) {
  v1::RegisterWorkerRequest request;
  EXPECT_EQ(controller_->RegisterWorker(request).status().code(),
            absl::StatusCode::kInvalidArgument);
  request.mutable_worker()->set_kind(v1::WORKER_KIND_OPTIMIZER_SERVER);
  absl::StatusOr<v1::RegisterWorkerResponse> response = controller_->RegisterWorker(request);
  EXPECT_EQ(response.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(response.status().message(), HasSubstr("worker.address"));
  // Stale assignments of a worker that registers again are stopped.
  v1::Assignment old;
  old.set_job_id("job-404");
  old.set_attempt(3);
  const std::string trainer = Register(v1::WORKER_KIND_TRAINER, "t0", {old});
  v1::HeartbeatResponse r = Beat(trainer);
  ASSERT_EQ(r.stop_size(), 1);
  EXPECT_EQ(r.stop(0).job_id(), "job-404");
}

}  // namespace
}  // namespace offload
