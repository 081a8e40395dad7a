#include "services/job_controller/job_state.h"

#include <initializer_list>

#include "absl/strings/str_cat.h"

namespace offload {
namespace {

using v1::JobState;

bool OneOf(JobState to, std::initializer_list<JobState> allowed) {
  for (JobState s : allowed) {
    if (s == to) return true;
  }
  return false;
}

}  // namespace

absl::Status CheckTransition(JobState from, JobState to) {
  bool allowed = false;
  switch (from) {
    case v1::JOB_STATE_PENDING:
      allowed = OneOf(to, {v1::JOB_STATE_RUNNING, v1::JOB_STATE_CANCELLED, v1::JOB_STATE_FAILED,
                           v1::JOB_STATE_PAUSED});
      break;
    case v1::JOB_STATE_RUNNING:
      allowed =
          OneOf(to, {v1::JOB_STATE_CHECKPOINTING, v1::JOB_STATE_PAUSED, v1::JOB_STATE_SUCCEEDED,
                     v1::JOB_STATE_FAILED, v1::JOB_STATE_CANCELLED, v1::JOB_STATE_PENDING});
      break;
    case v1::JOB_STATE_CHECKPOINTING:
      allowed = OneOf(to, {v1::JOB_STATE_RUNNING, v1::JOB_STATE_PAUSED, v1::JOB_STATE_SUCCEEDED,
                           v1::JOB_STATE_FAILED, v1::JOB_STATE_CANCELLED, v1::JOB_STATE_PENDING});
      break;
    case v1::JOB_STATE_PAUSED:
      allowed = OneOf(to, {v1::JOB_STATE_PENDING, v1::JOB_STATE_CANCELLED});
      break;
    default:
      allowed = false;
  }
  if (allowed) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("a ", StateName(from), " job cannot become ", StateName(to)));
}

bool IsTerminal(JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

bool IsActive(JobState state) {
  return state == v1::JOB_STATE_RUNNING || state == v1::JOB_STATE_CHECKPOINTING;
}

}  // namespace offload
