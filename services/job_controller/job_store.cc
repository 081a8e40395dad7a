#include "services/job_controller/job_store.h"

#include <sqlite3.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/security/security.h"
#include "base/status_macros.h"
#include "google/protobuf/util/time_util.h"

namespace offload {
namespace {

// How long a write waits for another process's transaction before giving up with SQLITE_BUSY.
constexpr int kBusyTimeoutMs = 10000;

// A prepared statement that finalizes itself, so every early return releases it.
class Statement {
 public:
  Statement() = default;
  ~Statement() { sqlite3_finalize(stmt_); }
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;
  sqlite3_stmt** out() { return &stmt_; }
  sqlite3_stmt* get() const { return stmt_; }

 private:
  sqlite3_stmt* stmt_ = nullptr;
};

int64_t Micros(const google::protobuf::Timestamp& t) {
  return google::protobuf::util::TimeUtil::TimestampToMicroseconds(t);
}

}  // namespace

absl::StatusOr<std::unique_ptr<JobStore>> JobStore::Open(const std::string& path) {
  sqlite3* db = nullptr;
  const int rc =
      sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, nullptr);
  if (rc != SQLITE_OK) {
    std::string message = db != nullptr ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
    sqlite3_close(db);
    return absl::UnavailableError(absl::StrCat("job store ", path, ": cannot open: ", message));
  }
  sqlite3_busy_timeout(db, kBusyTimeoutMs);
  std::unique_ptr<JobStore> store(new JobStore(path, db));
  absl::MutexLock lock(&store->mu_);
  OFFLOAD_RETURN_IF_ERROR(store->Init());
  return store;
}

JobStore::~JobStore() {
  absl::MutexLock lock(&mu_);
  sqlite3_close(db_);
}

absl::Status JobStore::Error(const char* what) {
  const int code = sqlite3_errcode(db_);
  std::string message = absl::StrCat("job store ", path_, ": ", what, ": ", sqlite3_errmsg(db_));
  if (code == SQLITE_NOTADB || code == SQLITE_CORRUPT) {
    return absl::DataLossError(absl::StrCat(message, " (not a job store, or damaged)"));
  }
  if (code == SQLITE_BUSY || code == SQLITE_LOCKED) return absl::UnavailableError(message);
  return absl::InternalError(message);
}

absl::Status JobStore::Exec(const char* sql, const char* what) {
  if (sqlite3_exec(db_, sql, nullptr, nullptr, nullptr) != SQLITE_OK) return Error(what);
  return absl::OkStatus();
}

absl::Status JobStore::Init() {
  // WAL lets readers (a second controller process, offline tools) work beside the writer, and
  // synchronous=FULL syncs the log at every commit, which is what "acknowledged means durable"
  // needs.
  OFFLOAD_RETURN_IF_ERROR(Exec("PRAGMA journal_mode=WAL", "set WAL mode"));
  OFFLOAD_RETURN_IF_ERROR(Exec("PRAGMA synchronous=FULL", "set synchronous=FULL"));
  OFFLOAD_RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE", "begin the schema transaction"));
  absl::Status s = Exec(
      "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);"
      "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, job BLOB NOT NULL,"
      " state INTEGER NOT NULL, create_time INTEGER NOT NULL);"
      "CREATE TABLE IF NOT EXISTS events (job_id TEXT NOT NULL, sequence INTEGER NOT NULL,"
      " event BLOB NOT NULL, PRIMARY KEY (job_id, sequence));"
      // Added to version 1 without a new version: older controllers never read it.
      "CREATE TABLE IF NOT EXISTS secrets (name TEXT PRIMARY KEY, value BLOB NOT NULL);"
      // The same for the audit log. AUTOINCREMENT: a sequence is never handed out twice, even
      // after the newest records were removed by hand.
      "CREATE TABLE IF NOT EXISTS audit (sequence INTEGER PRIMARY KEY AUTOINCREMENT,"
      " record BLOB NOT NULL);"
      "INSERT OR IGNORE INTO meta (key, value) VALUES ('next_job_number', 1);",
      "create the schema");
  if (s.ok()) {
    const std::string version = absl::StrCat(
        "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ", kSchemaVersion, ")");
    s = Exec(version.c_str(), "record the schema version");
  }
  int64_t version = -1;
  if (s.ok()) {
    Statement stmt;
    if (sqlite3_prepare_v2(db_, "SELECT value FROM meta WHERE key = 'schema_version'", -1,
                           stmt.out(), nullptr) != SQLITE_OK ||
        sqlite3_step(stmt.get()) != SQLITE_ROW) {
      s = Error("read the schema version");
    } else {
      version = sqlite3_column_int64(stmt.get(), 0);
    }
  }
  if (s.ok() && version != kSchemaVersion) {
    s = absl::FailedPreconditionError(
        absl::StrCat("job store ", path_, ": schema version ", version,
                     ", but this job_controller reads version ", kSchemaVersion,
                     " (a newer or older controller wrote it)"));
  }
  if (!s.ok()) {
    sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
    return s;
  }
  return Exec("COMMIT", "commit the schema");
}

absl::Status JobStore::Commit(const v1::Job& job, const std::vector<v1::JobEvent>& new_events) {
  if (job.id().empty()) return absl::InvalidArgumentError("job store: a job without an id");
  std::string job_bytes;
  if (!job.SerializeToString(&job_bytes)) {
    return absl::InternalError(absl::StrCat("job store: cannot serialize job ", job.id()));
  }
  absl::MutexLock lock(&mu_);
  OFFLOAD_RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE", "begin a transaction"));
  absl::Status s = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    Statement upsert;
    if (sqlite3_prepare_v2(db_,
                           "INSERT INTO jobs (id, job, state, create_time) VALUES (?1, ?2, ?3, ?4)"
                           " ON CONFLICT (id) DO UPDATE SET job = excluded.job,"
                           " state = excluded.state",
                           -1, upsert.out(), nullptr) != SQLITE_OK) {
      return Error("prepare the job write");
    }
    sqlite3_bind_text(upsert.get(), 1, job.id().data(), static_cast<int>(job.id().size()),
                      SQLITE_STATIC);
    sqlite3_bind_blob(upsert.get(), 2, job_bytes.data(), static_cast<int>(job_bytes.size()),
                      SQLITE_STATIC);
    sqlite3_bind_int(upsert.get(), 3, static_cast<int>(job.state()));
    sqlite3_bind_int64(upsert.get(), 4, Micros(job.create_time()));
    if (sqlite3_step(upsert.get()) != SQLITE_DONE) return Error("write the job");
    if (new_events.empty()) return absl::OkStatus();
    Statement insert;
    if (sqlite3_prepare_v2(db_, "INSERT INTO events (job_id, sequence, event) VALUES (?1, ?2, ?3)",
                           -1, insert.out(), nullptr) != SQLITE_OK) {
      return Error("prepare the event write");
    }
    std::string event_bytes;
    for (const v1::JobEvent& event : new_events) {
      if (event.job_id() != job.id()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "job store: an event of job ", event.job_id(), " committed with job ", job.id()));
      }
      if (!event.SerializeToString(&event_bytes)) {
        return absl::InternalError("job store: cannot serialize an event");
      }
      sqlite3_reset(insert.get());
      sqlite3_bind_text(insert.get(), 1, job.id().data(), static_cast<int>(job.id().size()),
                        SQLITE_STATIC);
      sqlite3_bind_int64(insert.get(), 2, static_cast<int64_t>(event.sequence()));
      sqlite3_bind_blob(insert.get(), 3, event_bytes.data(), static_cast<int>(event_bytes.size()),
                        SQLITE_TRANSIENT);
      if (sqlite3_step(insert.get()) != SQLITE_DONE) return Error("write an event");
    }
    return absl::OkStatus();
  }();
  if (!s.ok()) {
    sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
    return s;
  }
  return Exec("COMMIT", "commit");
}

absl::StatusOr<std::vector<v1::Job>> JobStore::LoadJobs() {
  absl::MutexLock lock(&mu_);
  Statement stmt;
  if (sqlite3_prepare_v2(db_, "SELECT id, job FROM jobs ORDER BY create_time, rowid", -1,
                         stmt.out(), nullptr) != SQLITE_OK) {
    return Error("prepare the job read");
  }
  std::vector<v1::Job> jobs;
  int rc;
  while ((rc = sqlite3_step(stmt.get())) == SQLITE_ROW) {
    v1::Job job;
    const void* blob = sqlite3_column_blob(stmt.get(), 1);
    const int size = sqlite3_column_bytes(stmt.get(), 1);
    if (!job.ParseFromArray(blob, size)) {
      return absl::DataLossError(absl::StrCat(
          "job store ", path_, ": the record of job ",
          reinterpret_cast<const char*>(sqlite3_column_text(stmt.get(), 0)), " does not parse"));
    }
    jobs.push_back(std::move(job));
  }
  if (rc != SQLITE_DONE) return Error("read the jobs");
  return jobs;
}

absl::StatusOr<std::vector<v1::JobEvent>> JobStore::Events(const std::string& job_id,
                                                           uint64_t after_sequence) {
  absl::MutexLock lock(&mu_);
  Statement stmt;
  if (sqlite3_prepare_v2(db_,
                         "SELECT event FROM events WHERE job_id = ?1 AND sequence > ?2"
                         " ORDER BY sequence",
                         -1, stmt.out(), nullptr) != SQLITE_OK) {
    return Error("prepare the event read");
  }
  sqlite3_bind_text(stmt.get(), 1, job_id.data(), static_cast<int>(job_id.size()), SQLITE_STATIC);
  sqlite3_bind_int64(stmt.get(), 2, static_cast<int64_t>(after_sequence));
  std::vector<v1::JobEvent> events;
  int rc;
  while ((rc = sqlite3_step(stmt.get())) == SQLITE_ROW) {
    v1::JobEvent event;
    if (!event.ParseFromArray(sqlite3_column_blob(stmt.get(), 0),
                              sqlite3_column_bytes(stmt.get(), 0))) {
      return absl::DataLossError(
          absl::StrCat("job store ", path_, ": an event of job ", job_id, " does not parse"));
    }
    events.push_back(std::move(event));
  }
  if (rc != SQLITE_DONE) return Error("read the events");
  return events;
}

absl::StatusOr<uint64_t> JobStore::LastSequence(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  Statement stmt;
  if (sqlite3_prepare_v2(db_, "SELECT MAX(sequence) FROM events WHERE job_id = ?1", -1, stmt.out(),
                         nullptr) != SQLITE_OK) {
    return Error("prepare the last sequence read");
  }
  sqlite3_bind_text(stmt.get(), 1, job_id.data(), static_cast<int>(job_id.size()), SQLITE_STATIC);
  if (sqlite3_step(stmt.get()) != SQLITE_ROW) return Error("read the last sequence");
  // MAX over no rows is NULL, which reads as 0: the same as an empty history.
  const int64_t last = sqlite3_column_int64(stmt.get(), 0);
  if (sqlite3_step(stmt.get()) != SQLITE_DONE) return Error("read the last sequence");
  return static_cast<uint64_t>(last);
}

absl::StatusOr<uint64_t> JobStore::NextJobNumber() {
  absl::MutexLock lock(&mu_);
  Statement stmt;
  // One statement is one atomic write: two controllers on the same file never draw the same
  // number.
  if (sqlite3_prepare_v2(db_,
                         "UPDATE meta SET value = value + 1 WHERE key = 'next_job_number'"
                         " RETURNING value - 1",
                         -1, stmt.out(), nullptr) != SQLITE_OK) {
    return Error("prepare the job number update");
  }
  if (sqlite3_step(stmt.get()) != SQLITE_ROW) return Error("draw a job number");
  const int64_t number = sqlite3_column_int64(stmt.get(), 0);
  if (sqlite3_step(stmt.get()) != SQLITE_DONE) return Error("draw a job number");
  return static_cast<uint64_t>(number);
}

absl::StatusOr<uint64_t> JobStore::AppendAudit(const v1::AuditRecord& record) {
  v1::AuditRecord stored = record;
  stored.clear_sequence();  // the row id is the sequence; the blob does not repeat it
  std::string bytes;
  if (!stored.SerializeToString(&bytes)) {
    return absl::InternalError("job store: cannot serialize an audit record");
  }
  absl::MutexLock lock(&mu_);
  Statement insert;
  if (sqlite3_prepare_v2(db_, "INSERT INTO audit (record) VALUES (?1)", -1, insert.out(),
                         nullptr) != SQLITE_OK) {
    return Error("prepare the audit write");
  }
  sqlite3_bind_blob(insert.get(), 1, bytes.data(), static_cast<int>(bytes.size()), SQLITE_STATIC);
  if (sqlite3_step(insert.get()) != SQLITE_DONE) return Error("write an audit record");
  return static_cast<uint64_t>(sqlite3_last_insert_rowid(db_));
}

absl::StatusOr<std::vector<v1::AuditRecord>> JobStore::Audit(uint64_t after_sequence,
                                                             uint32_t limit) {
  absl::MutexLock lock(&mu_);
  Statement stmt;
  if (sqlite3_prepare_v2(db_,
                         "SELECT sequence, record FROM audit WHERE sequence > ?1"
                         " ORDER BY sequence LIMIT ?2",
                         -1, stmt.out(), nullptr) != SQLITE_OK) {
    return Error("prepare the audit read");
  }
  sqlite3_bind_int64(stmt.get(), 1, static_cast<int64_t>(after_sequence));
  sqlite3_bind_int64(stmt.get(), 2, static_cast<int64_t>(limit));
  std::vector<v1::AuditRecord> records;
  int rc;
  while ((rc = sqlite3_step(stmt.get())) == SQLITE_ROW) {
    v1::AuditRecord record;
    if (!record.ParseFromArray(sqlite3_column_blob(stmt.get(), 1),
                               sqlite3_column_bytes(stmt.get(), 1))) {
      return absl::DataLossError(absl::StrCat("job store ", path_, ": audit record ",
                                              sqlite3_column_int64(stmt.get(), 0),
                                              " does not parse"));
    }
    record.set_sequence(static_cast<uint64_t>(sqlite3_column_int64(stmt.get(), 0)));
    records.push_back(std::move(record));
  }
  if (rc != SQLITE_DONE) return Error("read the audit log");
  return records;
}

absl::StatusOr<std::string> JobStore::AttemptKey() {
  OFFLOAD_ASSIGN_OR_RETURN(std::string fresh, RandomKey());
  absl::MutexLock lock(&mu_);
  // Insert-if-absent, then read: two controllers opening one file at once agree on the key.
  Statement insert;
  if (sqlite3_prepare_v2(db_,
                         "INSERT OR IGNORE INTO secrets (name, value) VALUES ('attempt_key', ?1)",
                         -1, insert.out(), nullptr) != SQLITE_OK) {
    return Error("prepare the attempt key write");
  }
  sqlite3_bind_blob(insert.get(), 1, fresh.data(), static_cast<int>(fresh.size()),
                    SQLITE_TRANSIENT);
  if (sqlite3_step(insert.get()) != SQLITE_DONE) return Error("write the attempt key");
  Statement select;
  if (sqlite3_prepare_v2(db_, "SELECT value FROM secrets WHERE name = 'attempt_key'", -1,
                         select.out(), nullptr) != SQLITE_OK ||
      sqlite3_step(select.get()) != SQLITE_ROW) {
    return Error("read the attempt key");
  }
  const int size = sqlite3_column_bytes(select.get(), 0);
  const void* bytes = sqlite3_column_blob(select.get(), 0);
  if (size < 16 || bytes == nullptr) {
    return absl::DataLossError(
        absl::StrCat("job store ", path_, ": the attempt key is ", size, " bytes, fewer than 16"));
  }
  return std::string(static_cast<const char*>(bytes), static_cast<size_t>(size));
}

}  // namespace offload
