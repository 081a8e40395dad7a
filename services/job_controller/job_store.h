// The durable job store (ARCHITECTURE.md section 7): every job, its event history and the audit
// log in one SQLite file in WAL mode with synchronous=FULL, so a state change the controller
// acknowledged survives kill -9 and a power cut, and a restarted controller reloads every job.
#ifndef OFFLOAD_SERVICES_JOB_CONTROLLER_JOB_STORE_H_
#define OFFLOAD_SERVICES_JOB_CONTROLLER_JOB_STORE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "offload/v1/job.pb.h"

struct sqlite3;

namespace offload {

class JobStore {
 public:
  // The schema this code reads and writes; a file with another version is refused rather than
  // misread.
  static constexpr int kSchemaVersion = 1;

  // Opens or creates the store at `path`. Errors name the file and carry SQLite's message (a file
  // that is not a database, a directory that does not exist, an unknown schema version).
  static absl::StatusOr<std::unique_ptr<JobStore>> Open(const std::string& path);
  ~JobStore();
  JobStore(const JobStore&) = delete;
  JobStore& operator=(const JobStore&) = delete;

  // Writes the job (insert or replace) and appends `new_events` in one transaction: both are on
  // disk when this returns OK, or neither is.
  absl::Status Commit(const v1::Job& job, const std::vector<v1::JobEvent>& new_events);
  // Every job, in submit order.
  absl::StatusOr<std::vector<v1::Job>> LoadJobs();
  // The events of `job_id` with sequence > after_sequence, in order.
  absl::StatusOr<std::vector<v1::JobEvent>> Events(const std::string& job_id,
                                                   uint64_t after_sequence);
  // The highest event sequence of `job_id`, 0 when it has none: what a reload needs, without
  // parsing the whole history.
  absl::StatusOr<uint64_t> LastSequence(const std::string& job_id);
  // 1, 2, 3, ...: never the same number twice, across restarts and concurrent openers.
  absl::StatusOr<uint64_t> NextJobNumber();
  // The key the controller derives attempt secrets from (DeriveSecret): 32 random bytes made the
  // first time and kept, so a restarted controller hands a running attempt the same secret.
  absl::StatusOr<std::string> AttemptKey();

  // Appends one record to the audit log (its sequence is assigned here and returned); on disk
  // when this returns OK.
  absl::StatusOr<uint64_t> AppendAudit(const v1::AuditRecord& record);
  // At most `limit` records with sequence > after_sequence, oldest first.
  absl::StatusOr<std::vector<v1::AuditRecord>> Audit(uint64_t after_sequence, uint32_t limit);

  const std::string& path() const { return path_; }

 private:
  JobStore(std::string path, sqlite3* db) : path_(std::move(path)), db_(db) {}
  absl::Status Init() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Exec(const char* sql, const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Error(const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  // One connection, used by one thread at a time: SQLite's own locking then only has to arbitrate
  // between processes.
  absl::Mutex mu_;
  sqlite3* const db_ ABSL_PT_GUARDED_BY(mu_);
};

}  // namespace offload

#endif  // OFFLOAD_SERVICES_JOB_CONTROLLER_JOB_STORE_H_
