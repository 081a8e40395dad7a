#include "jobs/spec/job_state_names.h"

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace offload {

std::string StateName(v1::JobState state) {
  const std::string& name = v1::JobState_Name(state);
  if (name.empty()) return absl::StrCat("state ", static_cast<int>(state));
  return absl::AsciiStrToLower(absl::StripPrefix(name, "JOB_STATE_"));
}

absl::StatusOr<v1::JobState> ParseStateName(absl::string_view text) {
  std::string name = absl::AsciiStrToUpper(absl::StripAsciiWhitespace(text));
  if (!absl::StartsWith(name, "JOB_STATE_")) name = absl::StrCat("JOB_STATE_", name);
  v1::JobState state;
  if (name == "JOB_STATE_UNSPECIFIED" || !v1::JobState_Parse(name, &state)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown job state '", text,
                     "' (pending, running, paused, checkpointing, succeeded, failed, cancelled)"));
  }
  return state;
}

}  // namespace offload
