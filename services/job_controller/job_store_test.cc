#include "services/job_controller/job_store.h"

#include <sqlite3.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

using google::protobuf::util::MessageDifferencer;

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  std::string path = std::string(dir != nullptr ? dir : "/tmp") + "/job_store_test_" +
                     std::to_string(getpid()) + "_" + name;
  for (const char* suffix : {"", "-wal", "-shm"}) std::remove((path + suffix).c_str());
  return path;
}

v1::Job MakeJob(const std::string& id, v1::JobState state, int64_t created) {
  v1::Job job;
  job.set_id(id);
  job.set_state(state);
  job.mutable_spec()->set_name("name of " + id);
  job.mutable_create_time()->set_seconds(created);
  return job;
}

v1::JobEvent MakeEvent(const std::string& id, uint64_t sequence, const std::string& message) {
  v1::JobEvent event;
  event.set_job_id(id);
  event.set_sequence(sequence);
  event.set_message(message);
  return event;
}

TEST(JobStoreTest, AttemptKeyIsMadeOnceAndKept) {
  const std::string path = TempPath("key.db");
  std::string key;
  {
    absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    absl::StatusOr<std::string> first = (*store)->AttemptKey();
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_EQ(first->size(), 32u);
    EXPECT_EQ(*(*store)->AttemptKey(), *first);
    key = *first;
  }
  absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ(*(*store)->AttemptKey(), key);
  // Another store has another key.
  absl::StatusOr<std::unique_ptr<JobStore>> other = JobStore::Open(TempPath("key2.db"));
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_NE(*(*other)->AttemptKey(), key);
}

TEST(JobStoreTest, ReopenReturnsWhatWasCommitted) {
  const std::string path = TempPath("reopen.db");
  v1::Job a = MakeJob("job-1", v1::JOB_STATE_PENDING, 100);
  v1::Job b = MakeJob("job-2", v1::JOB_STATE_RUNNING, 200);
  {
    absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    EXPECT_EQ(*(*store)->NextJobNumber(), 1u);
    EXPECT_EQ(*(*store)->NextJobNumber(), 2u);
    ASSERT_TRUE((*store)->Commit(a, {MakeEvent("job-1", 1, "submitted")}).ok());
    ASSERT_TRUE((*store)->Commit(b, {MakeEvent("job-2", 1, "submitted")}).ok());
    a.set_state(v1::JOB_STATE_RUNNING);
    ASSERT_TRUE((*store)
                    ->Commit(a, {MakeEvent("job-1", 2, "started"), MakeEvent("job-1", 3, "more")})
                    .ok());
  }
  absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  absl::StatusOr<std::vector<v1::Job>> jobs = (*store)->LoadJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->size(), 2u);
  EXPECT_TRUE(MessageDifferencer::Equals((*jobs)[0], a)) << (*jobs)[0].DebugString();
  EXPECT_TRUE(MessageDifferencer::Equals((*jobs)[1], b));
  absl::StatusOr<std::vector<v1::JobEvent>> events = (*store)->Events("job-1", 0);
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->size(), 3u);
  EXPECT_EQ((*events)[0].message(), "submitted");
  EXPECT_EQ((*events)[2].message(), "more");
  events = (*store)->Events("job-1", 2);
  ASSERT_EQ(events->size(), 1u);
  EXPECT_EQ((*events)[0].sequence(), 3u);
  EXPECT_TRUE((*store)->Events("job-9", 0)->empty());
  // The counter is durable: no number is handed out twice.
  EXPECT_EQ(*(*store)->NextJobNumber(), 3u);
}

TEST(JobStoreTest, LastSequenceIsTheHighestOrZero) {
  const std::string path = TempPath("last_sequence.db");
  absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  v1::Job job = MakeJob("job-1", v1::JOB_STATE_PENDING, 1);
  ASSERT_TRUE((*store)->Commit(job, {}).ok());
  // No events: 0, so a reload numbers the next event 1, as it did from an empty history.
  absl::StatusOr<uint64_t> last = (*store)->LastSequence("job-1");
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(*last, 0u);
  EXPECT_EQ(*(*store)->LastSequence("job-9"), 0u);
  ASSERT_TRUE((*store)
                  ->Commit(job, {MakeEvent("job-1", 1, "submitted"), MakeEvent("job-1", 2, "more")})
                  .ok());
  ASSERT_TRUE(
      (*store)
          ->Commit(MakeJob("job-2", v1::JOB_STATE_PENDING, 2), {MakeEvent("job-2", 7, "other job")})
          .ok());
  last = (*store)->LastSequence("job-1");
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(*last, 2u);
  EXPECT_EQ(*last, (*store)->Events("job-1", 0)->back().sequence());
  EXPECT_EQ(*(*store)->LastSequence("job-2"), 7u);
}

TEST(JobStoreTest, ACommitIsAllOrNothing) {
  const std::string path = TempPath("atomic.db");
  absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  v1::Job job = MakeJob("job-1", v1::JOB_STATE_PENDING, 1);
  ASSERT_TRUE((*store)->Commit(job, {MakeEvent("job-1", 1, "submitted")}).ok());
  job.set_state(v1::JOB_STATE_RUNNING);
  // Sequence 1 again violates the primary key: the job update must not land either.
  absl::Status s = (*store)->Commit(job, {MakeEvent("job-1", 2, "ok"), MakeEvent("job-1", 1, "x")});
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find(path), std::string::npos) << s;
  EXPECT_NE(s.message().find("UNIQUE"), std::string::npos) << s;
  EXPECT_EQ((*store)->LoadJobs()->at(0).state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ((*store)->Events("job-1", 0)->size(), 1u);
}

TEST(JobStoreTest, TwoOpenersShareTheFile) {
  const std::string path = TempPath("shared.db");
  absl::StatusOr<std::unique_ptr<JobStore>> first = JobStore::Open(path);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::unique_ptr<JobStore>> second = JobStore::Open(path);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE((*first)->Commit(MakeJob("job-1", v1::JOB_STATE_PENDING, 1), {}).ok());
  ASSERT_EQ((*second)->LoadJobs()->size(), 1u);
  ASSERT_TRUE((*second)->Commit(MakeJob("job-2", v1::JOB_STATE_PENDING, 2), {}).ok());
  EXPECT_EQ((*first)->LoadJobs()->size(), 2u);
  EXPECT_EQ(*(*first)->NextJobNumber(), 1u);
  EXPECT_EQ(*(*second)->NextJobNumber(), 2u);
}

TEST(JobStoreTest, NotADatabaseIsAClearError) {
  const std::string path = TempPath("garbage.db");
  {
    std::ofstream out(path);
    out << std::string(4096, 'x');
  }
  absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(path);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kDataLoss) << store.status();
  EXPECT_NE(store.status().message().find(path), std::string::npos);
  EXPECT_NE(store.status().message().find("not a database"), std::string::npos) << store.status();
}

TEST(JobStoreTest, MissingDirectoryNamesTheFile) {
  const std::string path = "/nonexistent-dir-for-job-store-test/x.db";
  absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(path);
  ASSERT_FALSE(store.ok());
  EXPECT_NE(store.status().message().find(path), std::string::npos) << store.status();
}

TEST(JobStoreTest, UnknownSchemaVersionIsRefused) {
  const std::string path = TempPath("version.db");
  ASSERT_TRUE(JobStore::Open(path).ok());
  {
    absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(path);
    ASSERT_TRUE(store.ok());
  }
  // Rewrite the version behind the store's back with sqlite3 itself.
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db, "UPDATE meta SET value = 99 WHERE key = 'schema_version'", nullptr,
                         nullptr, nullptr),
            SQLITE_OK);
  sqlite3_close(db);
  absl::StatusOr<std::unique_ptr<JobStore>> store = JobStore::Open(path);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(store.status().message().find("schema version 99"), std::string::npos)
      << store.status();
}

}  // namespace
}  // namespace offload
