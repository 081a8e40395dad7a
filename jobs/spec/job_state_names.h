// Job state names as people and URLs write them, shared by the controller, its REST gateway and
// offloadctl so that a state reads, and parses, the same everywhere.
#ifndef OFFLOAD_JOBS_SPEC_JOB_STATE_NAMES_H_
#define OFFLOAD_JOBS_SPEC_JOB_STATE_NAMES_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "offload/v1/job.pb.h"

namespace offload {

// Lower case without the prefix: "running", "checkpointing"; "state 42" for a value the enum
// does not name.
std::string StateName(v1::JobState state);

// The inverse for command lines and queries: "running", "RUNNING" and "JOB_STATE_RUNNING" all
// work; INVALID_ARGUMENT naming the text otherwise (UNSPECIFIED included: it is no state to ask
// for).
absl::StatusOr<v1::JobState> ParseStateName(absl::string_view text);

}  // namespace offload

#endif  // OFFLOAD_JOBS_SPEC_JOB_STATE_NAMES_H_
