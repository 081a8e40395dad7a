// The trainer's command-line settings and model presets, turned into TrainerOptions.
#ifndef OFFLOAD_GPU_TRAINER_TRAIN_TRAINER_CONFIG_H_
#define OFFLOAD_GPU_TRAINER_TRAIN_TRAINER_CONFIG_H_

#include <string>

#include "absl/status/statusor.h"
#include "gpu_trainer/train/trainer.h"

namespace offload {

// "demo" (4 layers, 128 channels: learns the bundled text in minutes on 2 cores), "gpt2"
// (124M), "gpt2-medium", "gpt2-large", "gpt2-xl". vocab 0: 256 for text, 50257 for token shards.
absl::StatusOr<Gpt2Config> ModelPreset(const std::string& name, int vocab_size,
                                       const std::string& data);

// Reads the --model/--data/--steps/... flags defined in trainer_config.cc.
absl::StatusOr<TrainerOptions> TrainerOptionsFromFlags();

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_TRAIN_TRAINER_CONFIG_H_
