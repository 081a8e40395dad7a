#include "services/trainer_worker/torch_attempt.h"

#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "jobs/spec/job_spec.h"

namespace offload {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

v1::Assignment Assignment(std::vector<std::string> command) {
  v1::Assignment a;
  a.set_job_id("job-7");
  a.set_attempt(2);
  a.set_shard_job_id(ShardJobId("job-7", 2));
  a.set_shard_secret("the-secret");
  a.set_rank(0);
  a.set_world_size(1);
  a.add_shard_addresses("10.0.0.1:50051");
  a.add_shard_addresses("10.0.0.2:50051");
  a.mutable_spec()->mutable_checkpoint()->set_dir("/ckpt/job-7");
  for (std::string& arg : command) a.mutable_spec()->mutable_torch()->add_command(std::move(arg));
  return a;
}

// No controller listens there: the progress client's calls fail, which a run must survive.
TorchAttemptOptions Options() {
  TorchAttemptOptions options;
  options.channel = grpc::CreateChannel("127.0.0.1:1", grpc::InsecureChannelCredentials());
  options.rank_address = "127.0.0.1";
  options.stop_grace = absl::Seconds(5);
  options.kill_grace = absl::Seconds(5);
  return options;
}

TEST(TorchAttemptTest, EnvironmentSetsEveryJobVariableOnce) {
  const v1::Assignment a = Assignment({"python3"});
  const std::vector<std::string> env = TorchEnvironment(a, "/tmp/control", "host0:29500");
  std::set<std::string> names;
  for (const std::string& entry : env) {
    EXPECT_TRUE(names.insert(entry.substr(0, entry.find('='))).second) << entry;
  }
  std::set<std::string> expected;
  for (absl::string_view name : TorchJobVariables()) {
    // With TLS only; with the spec's floor only.
    if (name.rfind("OFFLOAD_TLS_", 0) != 0 && name != "OFFLOAD_STEP_TIMEOUT_FLOOR") {
      expected.insert(std::string(name));
    }
  }
  EXPECT_EQ(names, expected);
  EXPECT_THAT(env, testing::Contains("OFFLOAD_SERVERS=10.0.0.1:50051,10.0.0.2:50051"));
  EXPECT_THAT(env, testing::Contains("OFFLOAD_TOKEN=the-secret"));
  EXPECT_THAT(env, testing::Contains("OFFLOAD_JOB_ID=job-7.2"));
  EXPECT_THAT(env, testing::Contains("OFFLOAD_CHECKPOINT_DIR=/ckpt/job-7"));
  EXPECT_THAT(env, testing::Contains("MASTER_ADDR=host0"));
  EXPECT_THAT(env, testing::Contains("MASTER_PORT=29500"));
  EXPECT_THAT(env, testing::Contains("WORLD_SIZE=1"));
}

TEST(TorchAttemptTest, TheSpecsStepTimeoutFloorReachesTheScriptInSeconds) {
  v1::Assignment a = Assignment({"python3"});
  a.mutable_spec()->mutable_parallel()->set_shard_step_timeout_floor("1m30s");
  EXPECT_THAT(TorchEnvironment(a, "/tmp/control", ""),
              testing::Contains("OFFLOAD_STEP_TIMEOUT_FLOOR=90"));
  a.mutable_spec()->mutable_parallel()->set_shard_step_timeout_floor("250ms");
  EXPECT_THAT(TorchEnvironment(a, "/tmp/control", ""),
              testing::Contains("OFFLOAD_STEP_TIMEOUT_FLOOR=0.25"));
}

TEST(TorchAttemptTest, TlsFlagsBecomeTheScriptsVariables) {
  EXPECT_THAT(TorchTlsEnvironment(
                  {"--token_file=/t", "--tls_ca=/ca.pem", "--tls_cert=/c.pem", "--tls_key=/k.pem",
                   "--tls_client_auth=require", "--tls_server_name=shard"},
                  /*client_identity=*/true),
              testing::ElementsAre("OFFLOAD_TLS_CA=/ca.pem", "OFFLOAD_TLS_CERT=/c.pem",
                                   "OFFLOAD_TLS_KEY=/k.pem", "OFFLOAD_TLS_SERVER_NAME=shard"));
  // A script of its own user gets what verifies the servers, not the worker's identity.
  EXPECT_THAT(TorchTlsEnvironment({"--tls_ca=/ca.pem", "--tls_cert=/c.pem", "--tls_key=/k.pem",
                                   "--tls_server_name=shard"},
                                  /*client_identity=*/false),
              testing::ElementsAre("OFFLOAD_TLS_CA=/ca.pem", "OFFLOAD_TLS_SERVER_NAME=shard"));
  EXPECT_TRUE(TorchTlsEnvironment({"--token_file=/t"}, true).empty());
}

TEST(TorchAttemptTest, ResolvesTheProgramOnPathOrRelativeToTheWorkingDirectory) {
  absl::StatusOr<std::string> sh = ResolveProgram("sh", "/nonexistent:/bin:/usr/bin", "");
  ASSERT_TRUE(sh.ok()) << sh.status();
  EXPECT_EQ(*sh, "/bin/sh");
  absl::StatusOr<std::string> relative = ResolveProgram("./sh", "", "/bin");
  ASSERT_TRUE(relative.ok()) << relative.status();
  EXPECT_EQ(*relative, "/bin/./sh");
  absl::StatusOr<std::string> missing = ResolveProgram("no-such-program", "/bin:/usr/bin", "");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("no-such-program is not on the worker's PATH"));
  EXPECT_FALSE(ResolveProgram("/bin", "", "").ok());  // a directory is no program
}

TEST(TorchAttemptTest, ParsesProgressAndRefusesWhatIsNotProgress) {
  absl::StatusOr<v1::ScriptProgress> p =
      ParseScriptProgress(R"({"step": 12, "loss": 2.5, "tokens": 4096, "checkpoint_dir": "/c",
                              "checkpointStep": 10})");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->step(), 12u);
  EXPECT_FLOAT_EQ(p->loss(), 2.5f);
  EXPECT_EQ(p->checkpoint_step(), 10u);
  const v1::ProgressReport report = ReportOf(*p);
  EXPECT_EQ(report.step(), 12u);
  EXPECT_EQ(report.checkpoint_dir(), "/c");
  EXPECT_FALSE(ParseScriptProgress(R"({"stepz": 1})").ok());
  EXPECT_FALSE(ParseScriptProgress("not json").ok());
  EXPECT_FALSE(ParseScriptProgress(std::string(1 << 20, ' ')).ok());
}

TEST(TorchAttemptTest, RequestJsonNamesEveryField) {
  v1::ProgressReply reply;
  EXPECT_THAT(RequestJson(reply), HasSubstr("\"request\":\"JOB_REQUEST_NONE\""));
  reply.set_request(v1::JOB_REQUEST_PAUSE);
  reply.set_checkpoint_request(3);
  const std::string json = RequestJson(reply);
  EXPECT_THAT(json, HasSubstr("JOB_REQUEST_PAUSE"));
  EXPECT_THAT(json, HasSubstr("\"checkpoint_request\":\"3\""));
}

TEST(TorchAttemptTest, TailKeepsTheLastLines) {
  OutputTail tail(2, 5);
  tail.Add("one");
  tail.Add("two");
  tail.Add("three and more");
  EXPECT_EQ(tail.Text(), "two\nthree\n");
}

TEST(TorchAttemptTest, RunsTheCommandWithTheJobsEnvironment) {
  v1::Assignment a = Assignment(
      {"sh", "-c",
       "echo servers=$OFFLOAD_SERVERS job=$OFFLOAD_JOB_ID dir=$(pwd) extra=$EXTRA; "
       "printf '{\"step\": 3, \"tokens\": 96, \"loss\": 1.5}' > $OFFLOAD_CONTROL_DIR/p.tmp && "
       "mv $OFFLOAD_CONTROL_DIR/p.tmp $OFFLOAD_CONTROL_DIR/progress.json; sleep 0.6; "
       "test -f $OFFLOAD_CONTROL_DIR/request.json || exit 4; exit 3"});
  a.mutable_spec()->mutable_torch()->set_working_dir("/usr");
  a.mutable_spec()->mutable_torch()->add_env("EXTRA=yes");
  TorchAttemptOptions options = Options();
  std::vector<v1::ScriptProgress> seen;
  options.on_progress = [&seen](const v1::ScriptProgress& p) { seen.push_back(p); };
  const v1::AttemptResult result = RunTorchAttempt(a, options);
  EXPECT_EQ(result.attempt().job_id(), "job-7");
  EXPECT_EQ(result.attempt().attempt(), 2u);
  EXPECT_EQ(result.exit_code(), 3);
  EXPECT_THAT(result.message(), HasSubstr("exited with status 3"));
  EXPECT_THAT(result.message(),
              HasSubstr("servers=10.0.0.1:50051,10.0.0.2:50051 job=job-7.2 dir=/usr extra=yes"));
  EXPECT_THAT(result.message(), Not(HasSubstr("the-secret")));
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.back().step(), 3u);
  EXPECT_EQ(seen.back().tokens(), 96);
}

TEST(TorchAttemptTest, SuccessHasNoMessageAndAMissingProgramIs127) {
  v1::AttemptResult result = RunTorchAttempt(Assignment({"true"}), Options());
  EXPECT_EQ(result.exit_code(), 0);
  EXPECT_EQ(result.message(), "");
  result = RunTorchAttempt(Assignment({"no-such-program-here"}), Options());
  EXPECT_EQ(result.exit_code(), 127);
  EXPECT_THAT(result.message(), HasSubstr("no-such-program-here is not on the worker's PATH"));
  v1::Assignment a = Assignment({"true"});
  a.mutable_spec()->mutable_torch()->set_working_dir("/nonexistent/dir");
  result = RunTorchAttempt(a, Options());
  EXPECT_EQ(result.exit_code(), 127);
  EXPECT_THAT(result.message(), HasSubstr("/nonexistent/dir"));
}

TEST(TorchAttemptTest, KilledWhenWithdrawnAndInterruptedWhenTheWorkerStops) {
  TorchAttemptOptions options = Options();
  options.withdrawn = [] { return true; };
  const absl::Time start = absl::Now();
  v1::AttemptResult result = RunTorchAttempt(Assignment({"sleep", "30"}), options);
  EXPECT_EQ(result.exit_code(), 128 + SIGKILL);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));

  options = Options();
  volatile std::sig_atomic_t stop = 1;
  options.stop = &stop;
  result = RunTorchAttempt(Assignment({"sleep", "30"}), options);
  EXPECT_EQ(result.exit_code(), 130);  // SIGINT: stopped as asked
  EXPECT_EQ(result.message(), "");
}

}  // namespace
}  // namespace offload
