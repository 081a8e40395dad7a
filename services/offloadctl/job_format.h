// How offloadctl shows jobs to people (tables, durations, one line per progress change) and to
// scripts (protobuf JSON with the .proto field names, the same mapping the REST gateway serves).
#ifndef OFFLOAD_SERVICES_OFFLOADCTL_JOB_FORMAT_H_
#define OFFLOAD_SERVICES_OFFLOADCTL_JOB_FORMAT_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "google/protobuf/message.h"
#include "google/protobuf/timestamp.pb.h"
#include "jobs/spec/job_state_names.h"  // IWYU pragma: export (StateName, ParseStateName)
#include "offload/v1/job.pb.h"

namespace offload {

// Columns padded to their widest cell and separated by two spaces; the first row is the header.
// No trailing spaces, every line ends in '\n'. Rows shorter than the header get empty cells.
std::string RenderTable(const std::vector<std::vector<std::string>>& rows);

// Compact durations for ETA and AGE columns: "42s", "5m07s", "3h20m", "2d04h"; "-" for negative,
// infinite or NaN seconds. Not FormatDuration: gpu_trainer's progress.h has one that formats
// differently, and one binary must never see two definitions of the same name.
std::string FormatCompactDuration(double seconds);

// A comma-separated list of ParseStateName names; empty text is an empty list.
absl::StatusOr<std::vector<v1::JobState>> ParseStateList(absl::string_view text);

// Progress cells: "-" until there is something to show.
std::string FormatSteps(const v1::JobProgress& progress);  // "120/1000"
std::string FormatLoss(float loss);                        // "3.4121"
std::string FormatRate(double tokens_per_s);               // "850", "12.3k", "1.25M"
std::string FormatEta(const v1::Job& job);                 // only while the job runs

absl::Time ToTime(const google::protobuf::Timestamp& timestamp);
// "2024-05-01 13:02:11" in `zone`; "-" for an unset timestamp.
std::string FormatTimestamp(const google::protobuf::Timestamp& timestamp, absl::TimeZone zone);

// The `offloadctl list` table: ID, NAME, STATE, STEP/TOTAL, LOSS, VAL, TOK/S, ETA, AGE.
std::vector<std::string> JobTableHeader();
std::vector<std::string> JobRow(const v1::Job& job, absl::Time now);
std::string JobTable(const std::vector<v1::Job>& jobs, absl::Time now);

// The `offloadctl get` view: one "Label:  value" line per aspect of the job.
std::string JobDetails(const v1::Job& job, absl::Time now, absl::TimeZone zone);

// One `offloadctl watch` line, without a timestamp, so that equal lines mean nothing changed:
// "running  step 120/1000  loss 3.4121  val 3.5012  12.3k tok/s  ETA 5m07s".
std::string WatchLine(const v1::Job& job);

// One `offloadctl logs` line: time, state, attempt, message.
std::string EventLine(const v1::JobEvent& event, absl::TimeZone zone);

// One `offloadctl audit` line: sequence, time, who (tenant, "(admin)"), action, job, outcome.
std::string AuditLine(const v1::AuditRecord& record, absl::TimeZone zone);

// Protobuf JSON with the .proto field names; indented for people, or on one line (for output
// with one object per line). Always valid input to JsonStringToMessage.
std::string ToJson(const google::protobuf::Message& message, bool one_line);

}  // namespace offload

#endif  // OFFLOAD_SERVICES_OFFLOADCTL_JOB_FORMAT_H_
