#include "services/offloadctl/job_format.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

const absl::Time kNow = absl::FromUnixSeconds(1'700'000'000);

google::protobuf::Timestamp At(absl::Time time) {
  google::protobuf::Timestamp t;
  t.set_seconds(absl::ToUnixSeconds(time));
  return t;
}

v1::Job RunningJob() {
  v1::Job job;
  job.set_id("job-7");
  job.mutable_spec()->set_name("gpt2-small");
  job.mutable_spec()->mutable_parallel()->set_ranks(2);
  job.mutable_spec()->set_max_restarts(3);
  job.set_state(v1::JOB_STATE_RUNNING);
  job.set_attempt(1);
  v1::JobProgress* progress = job.mutable_progress();
  progress->set_step(120);
  progress->set_total_steps(1000);
  progress->set_loss(3.41214f);
  progress->set_tokens_per_s(12345);
  progress->set_eta_seconds(307);
  progress->set_last_checkpoint("/ckpt/step_00100");
  progress->set_last_checkpoint_step(100);
  *job.mutable_create_time() = At(kNow - absl::Minutes(90));
  return job;
}

// Where each header word starts in the header line, and the same for cells of `line`.
std::vector<size_t> ColumnStarts(const std::string& line) {
  std::vector<size_t> starts;
  for (size_t i = 0; i < line.size(); ++i) {
    if (line[i] != ' ' && (i == 0 || (line[i - 1] == ' ' && i >= 2 && line[i - 2] == ' '))) {
      starts.push_back(i);
    }
  }
  return starts;
}

TEST(RenderTableTest, AlignsColumnsWithoutTrailingBlanks) {
  const std::string table = RenderTable(
      {{"ID", "NAME", "STATE"}, {"job-100", "a", "running"}, {"j", "a-much-longer-name", ""}});
  EXPECT_EQ(table,
            "ID       NAME                STATE\n"
            "job-100  a                   running\n"
            "j        a-much-longer-name\n");
}

TEST(RenderTableTest, ShortRowsAndEmptyTable) {
  EXPECT_EQ(RenderTable({}), "");
  EXPECT_EQ(RenderTable({{"A", "B"}, {"x"}}), "A  B\nx\n");
}

TEST(FormatCompactDurationTest, Units) {
  EXPECT_EQ(FormatCompactDuration(0), "0s");
  EXPECT_EQ(FormatCompactDuration(42.4), "42s");
  EXPECT_EQ(FormatCompactDuration(59.6), "1m00s");
  EXPECT_EQ(FormatCompactDuration(307), "5m07s");
  EXPECT_EQ(FormatCompactDuration(3600), "1h00m");
  EXPECT_EQ(FormatCompactDuration(12000), "3h20m");
  EXPECT_EQ(FormatCompactDuration(2 * 86400 + 4 * 3600 + 59), "2d04h");
  EXPECT_EQ(FormatCompactDuration(-1), "-");
  EXPECT_EQ(FormatCompactDuration(std::numeric_limits<double>::infinity()), "-");
  EXPECT_EQ(FormatCompactDuration(std::nan("")), "-");
}

TEST(FormatEtaTest, OnlyWhileRunning) {
  v1::Job job = RunningJob();
  EXPECT_EQ(FormatEta(job), "5m07s");
  job.set_state(v1::JOB_STATE_CHECKPOINTING);
  EXPECT_EQ(FormatEta(job), "5m07s");
  job.set_state(v1::JOB_STATE_PAUSED);
  EXPECT_EQ(FormatEta(job), "-");
  job.set_state(v1::JOB_STATE_RUNNING);
  job.mutable_progress()->set_eta_seconds(0);
  EXPECT_EQ(FormatEta(job), "-");
}

TEST(FormatCellsTest, ProgressCells) {
  v1::JobProgress progress;
  EXPECT_EQ(FormatSteps(progress), "-");
  progress.set_step(5);
  EXPECT_EQ(FormatSteps(progress), "5");
  progress.set_total_steps(10);
  EXPECT_EQ(FormatSteps(progress), "5/10");
  EXPECT_EQ(FormatLoss(0), "-");
  EXPECT_EQ(FormatLoss(3.41214f), "3.4121");
  EXPECT_EQ(FormatLoss(std::nanf("")), "nan");
  EXPECT_EQ(FormatRate(0), "-");
  EXPECT_EQ(FormatRate(850.2), "850");
  EXPECT_EQ(FormatRate(12345), "12.3k");
  EXPECT_EQ(FormatRate(1.25e6), "1.25M");
}

TEST(StateNameTest, RoundTrips) {
  EXPECT_EQ(StateName(v1::JOB_STATE_CHECKPOINTING), "checkpointing");
  for (const char* text : {"running", "RUNNING", "JOB_STATE_RUNNING", " Running "}) {
    absl::StatusOr<v1::JobState> state = ParseStateName(text);
    ASSERT_TRUE(state.ok()) << text;
    EXPECT_EQ(*state, v1::JOB_STATE_RUNNING);
  }
  EXPECT_FALSE(ParseStateName("unspecified").ok());
  const absl::Status bad = ParseStateName("sleeping").status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("sleeping"), std::string::npos);

  absl::StatusOr<std::vector<v1::JobState>> list = ParseStateList("running, paused");
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(*list, (std::vector<v1::JobState>{v1::JOB_STATE_RUNNING, v1::JOB_STATE_PAUSED}));
  EXPECT_TRUE(ParseStateList("")->empty());
  EXPECT_FALSE(ParseStateList("running,nope").ok());
}

TEST(JobTableTest, RowsAlignUnderTheHeader) {
  v1::Job pending;
  pending.set_id("job-10");
  pending.set_state(v1::JOB_STATE_PENDING);
  *pending.mutable_create_time() = At(kNow - absl::Seconds(5));
  const std::string table = JobTable({RunningJob(), pending}, kNow);
  const std::vector<std::string> lines = absl::StrSplit(table, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u) << table;
  EXPECT_EQ(lines[0].substr(0, 2), "ID");
  const std::vector<size_t> header = ColumnStarts(lines[0]);
  ASSERT_EQ(header.size(), 9u) << lines[0];
  EXPECT_EQ(ColumnStarts(lines[1]), header) << table;
  EXPECT_EQ(ColumnStarts(lines[2]), header) << table;
  const std::vector<std::string> running = absl::StrSplit(lines[1], ' ', absl::SkipEmpty());
  EXPECT_EQ(running, (std::vector<std::string>{"job-7", "gpt2-small", "running", "120/1000",
                                               "3.4121", "-", "12.3k", "5m07s", "1h30m"}));
  const std::vector<std::string> waiting = absl::StrSplit(lines[2], ' ', absl::SkipEmpty());
  EXPECT_EQ(waiting,
            (std::vector<std::string>{"job-10", "-", "pending", "-", "-", "-", "-", "-", "5s"}));
}

TEST(JobDetailsTest, ShowsReasonAttemptProgressAndCheckpoint) {
  v1::Job job = RunningJob();
  job.set_reason("restarted after worker w3 was lost");
  job.set_attempt(2);
  job.set_restarts(1);
  job.set_request(v1::JOB_REQUEST_PAUSE);
  const std::string details = JobDetails(job, kNow, absl::UTCTimeZone());
  for (const char* expected :
       {"ID:", "job-7", "restarted after worker w3 was lost", "Request:", "pause",
        "2 (restarts 1 of 3 allowed)", "120/1000 (12%)", "3.4121", "12.3k", "5m07s",
        "/ckpt/step_00100 (step 100)", "2 trainer rank(s), 1 optimizer server(s), ZeRO stage 2",
        "2023-11-14 20:43:20 (1h30m ago)"}) {
    EXPECT_NE(details.find(expected), std::string::npos) << expected << " in\n" << details;
  }
  v1::Job stage3 = job;
  stage3.mutable_spec()->mutable_parallel()->set_zero_stage(3);
  EXPECT_NE(JobDetails(stage3, kNow, absl::UTCTimeZone()).find("ZeRO stage 3 (window 2 layers)"),
            std::string::npos);
  v1::Job torch = job;
  torch.mutable_spec()->mutable_torch()->add_command("python3");
  torch.mutable_spec()->mutable_torch()->add_command("/data/train.py");
  const std::string torch_details = JobDetails(torch, kNow, absl::UTCTimeZone());
  for (const char* expected :
       {"Command:", "python3 /data/train.py", "1 optimizer server(s), a torch script"}) {
    EXPECT_NE(torch_details.find(expected), std::string::npos) << expected << " in\n"
                                                               << torch_details;
  }
  // Values start in one column.
  const std::vector<std::string> lines = absl::StrSplit(details, '\n', absl::SkipEmpty());
  const size_t value_column = lines[0].find("job-7");
  for (const std::string& line : lines) {
    EXPECT_NE(line[value_column - 1], ':') << line;
    EXPECT_NE(line[value_column], ' ') << line;
    EXPECT_EQ(line[value_column - 1], ' ') << line;
  }
}

TEST(JobDetailsTest, ShowsTenantPriorityAndPreemptions) {
  v1::Job job = RunningJob();
  job.set_tenant("vision");
  job.mutable_spec()->mutable_checkpoint()->set_dir("/ckpt");
  job.mutable_spec()->set_priority(7);
  job.set_preemptions(2);
  std::string details = JobDetails(job, kNow, absl::UTCTimeZone());
  EXPECT_NE(details.find("Tenant:"), std::string::npos) << details;
  EXPECT_NE(details.find("vision"), std::string::npos) << details;
  EXPECT_NE(details.find("7, preempted 2x"), std::string::npos) << details;
  job.mutable_spec()->set_preemptible(false);
  details = JobDetails(job, kNow, absl::UTCTimeZone());
  EXPECT_NE(details.find("7, not preemptible"), std::string::npos) << details;
  // Jobs stored before tenants belong to the operator's.
  EXPECT_NE(JobDetails(v1::Job(), kNow, absl::UTCTimeZone()).find("default"), std::string::npos);
}

TEST(AuditLineTest, SaysWhoDidWhatAndTheOutcome) {
  v1::AuditRecord record;
  record.set_sequence(12);
  record.mutable_time()->set_seconds(1700000000);
  record.set_tenant("ops");
  record.set_admin(true);
  record.set_action("cancel");
  record.set_job_id("job-3");
  record.set_code("NOT_FOUND");
  record.set_message("job job-3 not found");
  EXPECT_EQ(AuditLine(record, absl::UTCTimeZone()),
            "12      2023-11-14 22:13:20  ops (admin)           cancel      job-3         "
            "NOT_FOUND: job job-3 not found");
  record.clear_tenant();
  record.set_admin(false);
  EXPECT_NE(AuditLine(record, absl::UTCTimeZone()).find("(no token)"), std::string::npos);
}

TEST(WatchLineTest, ChangesWithProgressAndState) {
  v1::Job job = RunningJob();
  EXPECT_EQ(WatchLine(job), "running  step 120/1000  loss 3.4121  12.3k tok/s  ETA 5m07s");
  const std::string before = WatchLine(job);
  job.mutable_progress()->set_step(121);
  EXPECT_NE(WatchLine(job), before);
  job.set_state(v1::JOB_STATE_FAILED);
  job.set_reason("rank 1 exited with status 1");
  job.set_attempt(2);
  EXPECT_EQ(WatchLine(job),
            "failed: rank 1 exited with status 1  attempt 2  step 121/1000  loss 3.4121  "
            "12.3k tok/s");
}

TEST(EventLineTest, TimeStateAttemptMessage) {
  v1::JobEvent event;
  event.set_sequence(3);
  *event.mutable_time() = At(kNow);
  event.set_state(v1::JOB_STATE_PAUSED);
  event.set_attempt(1);
  event.set_message("paused at step 200 (user: maintenance)");
  EXPECT_EQ(EventLine(event, absl::UTCTimeZone()),
            "2023-11-14 22:13:20  paused         attempt 1    paused at step 200 (user: "
            "maintenance)");
}

TEST(ToJsonTest, IsProtobufJsonThatParsesBack) {
  const v1::Job job = RunningJob();
  for (bool one_line : {false, true}) {
    const std::string json = ToJson(job, one_line);
    EXPECT_NE(json.find("\"total_steps\""), std::string::npos) << json;
    EXPECT_NE(json.find("\"JOB_STATE_RUNNING\""), std::string::npos) << json;
    EXPECT_EQ(json.find('\n') == std::string::npos, one_line) << json;
    v1::Job parsed;
    google::protobuf::util::JsonParseOptions options;
    options.ignore_unknown_fields = false;
    ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &parsed, options).ok()) << json;
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(parsed, job)) << json;
  }
  v1::ListJobsResponse list;
  *list.add_jobs() = job;
  v1::ListJobsResponse parsed;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(ToJson(list, false), &parsed).ok());
  EXPECT_EQ(parsed.jobs_size(), 1);
}

}  // namespace
}  // namespace offload
