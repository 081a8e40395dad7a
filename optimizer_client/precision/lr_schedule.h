// Learning-rate schedule: linear warm-up to max_lr, then cosine decay to the min_lr floor at
// total_steps, flat after that (nanoGPT's schedule).
#ifndef OFFLOAD_OPTIMIZER_CLIENT_PRECISION_LR_SCHEDULE_H_
#define OFFLOAD_OPTIMIZER_CLIENT_PRECISION_LR_SCHEDULE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "offload/v1/checkpoint.pb.h"

namespace offload {

absl::Status ValidateLrSchedule(const v1::LrSchedule& schedule);

// The lr of 1-based step `step`.
float ScheduledLr(const v1::LrSchedule& schedule, uint64_t step);

}  // namespace offload

#endif  // OFFLOAD_OPTIMIZER_CLIENT_PRECISION_LR_SCHEDULE_H_
