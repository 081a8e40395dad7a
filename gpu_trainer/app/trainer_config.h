// The trainer's command-line settings and model presets, turned into TrainerOptions.
#ifndef OFFLOAD_GPU_TRAINER_APP_TRAINER_CONFIG_H_
#define OFFLOAD_GPU_TRAINER_APP_TRAINER_CONFIG_H_

#include <string>

#include "absl/status/statusor.h"
#include "gpu_trainer/train/trainer.h"

namespace offload {

// Reads the --model/--data/--steps/... flags defined in trainer_config.cc.
absl::StatusOr<TrainerOptions> TrainerOptionsFromFlags();

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_APP_TRAINER_CONFIG_H_
