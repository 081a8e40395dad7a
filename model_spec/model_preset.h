// The named GPT-2 shapes the trainer, the job controller and job files refer to.
#ifndef OFFLOAD_MODEL_SPEC_MODEL_PRESET_H_
#define OFFLOAD_MODEL_SPEC_MODEL_PRESET_H_

#include <string>

#include "absl/status/statusor.h"
#include "model_spec/gpt2_config.h"

namespace offload {

// True for an llm.c GPT-2 token shard (".bin") or a glob of them; false for a text file.
bool IsTokenShards(const std::string& data);

// "demo" (4 layers, 128 channels: learns the bundled text in minutes on 2 cores), "gpt2"
// (124M), "gpt2-medium", "gpt2-large", "gpt2-xl". vocab 0: 256 for text, 50257 for token shards.
absl::StatusOr<Gpt2Config> ModelPreset(const std::string& name, int vocab_size,
                                       const std::string& data);

}  // namespace offload

#endif  // OFFLOAD_MODEL_SPEC_MODEL_PRESET_H_
