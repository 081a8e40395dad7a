// The job state machine of ARCHITECTURE.md section 7: which state changes are legal, so the
// controller can never write a history that skips from a finished job back into a running one.
#ifndef OFFLOAD_SERVICES_JOB_CONTROLLER_JOB_STATE_H_
#define OFFLOAD_SERVICES_JOB_CONTROLLER_JOB_STATE_H_

#include "absl/status/status.h"
#include "jobs/spec/job_state_names.h"  // IWYU pragma: export (StateName)
#include "offload/v1/job.pb.h"

namespace offload {

// OK when a job may go from `from` to `to`; FAILED_PRECONDITION naming both otherwise.
//   PENDING       -> RUNNING | CANCELLED | FAILED | PAUSED
//   RUNNING       -> CHECKPOINTING | PAUSED | SUCCEEDED | FAILED | CANCELLED | PENDING (restart)
//   CHECKPOINTING -> RUNNING | PAUSED | SUCCEEDED | FAILED | CANCELLED | PENDING (restart)
//   PAUSED        -> PENDING (resume) | CANCELLED
// SUCCEEDED, FAILED and CANCELLED are final.
absl::Status CheckTransition(v1::JobState from, v1::JobState to);

// SUCCEEDED, FAILED or CANCELLED.
bool IsTerminal(v1::JobState state);

// RUNNING or CHECKPOINTING: an attempt holds workers.
bool IsActive(v1::JobState state);

}  // namespace offload

#endif  // OFFLOAD_SERVICES_JOB_CONTROLLER_JOB_STATE_H_
