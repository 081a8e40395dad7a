// The named GPT-2 shapes the trainer, the job controller and job files refer to.
#ifndef OFFLOAD_MODEL_SPEC_MODEL_PRESET_H_
#define OFFLOAD_MODEL_SPEC_MODEL_PRESET_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "model_spec/gpt2_config.h"

namespace offload {

// True for an llm.c GPT-2 token shard (".bin") or a glob of them; false for a text file.
bool IsTokenShards(const std::string& data);

// The shape a job asks for, as gpu_trainer's flags (--model --vocab --layers --heads --channels
// --context) and a job file's model section both give it: a preset, any of whose dimensions may
// be replaced (0 keeps the preset's).
struct ModelShape {
  // "demo" (4 layers, 128 channels: learns the bundled text in minutes on 2 cores), "gpt2"
  // (124M), "gpt2-medium", "gpt2-large", "gpt2-xl".
  std::string preset = "demo";
  int vocab = 0;  // 0: 256 for text, 50257 for token shards
  int layers = 0;
  int heads = 0;
  int channels = 0;
  int context = 0;
};

// The shape's GPT-2 config for training on `data`, validated (ValidateGpt2Config). Errors are
// INVALID_ARGUMENT and name the setting as the caller's user wrote it: an unknown preset
// `preset_field` ("--model", "model.preset"), a bad shape `shape_field` ("model"; none if empty).
absl::StatusOr<Gpt2Config> ResolveModel(const ModelShape& shape, const std::string& data,
                                        absl::string_view preset_field,
                                        absl::string_view shape_field);

}  // namespace offload

#endif  // OFFLOAD_MODEL_SPEC_MODEL_PRESET_H_
