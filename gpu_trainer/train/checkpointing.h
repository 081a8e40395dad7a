// A training checkpoint on disk (ARCHITECTURE.md section 6): the trainer's 16-bit model weights in
// GPT-2 naming (model.safetensors), each shard's fp32 master weights and Adam moments
// (shard-<k>.safetensors, pulled from the shard chunk by chunk), and the manifest that ties them
// together. Staged and committed by CheckpointStaging, so a crash leaves the previous one intact.
#ifndef OFFLOAD_GPU_TRAINER_TRAIN_CHECKPOINTING_H_
#define OFFLOAD_GPU_TRAINER_TRAIN_CHECKPOINTING_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "model_spec/gpt2_config.h"
#include "offload/v1/checkpoint.pb.h"
#include "optimizer_client/backends/optimizer_backend.h"

namespace offload {

// `manifest` carries everything but the file names, which this fills in. weights16 is
// (padded_length,) in manifest.param_dtype, or null to write the rounding of the shards' master
// weights instead, read range by range (ZeRO-3, where no rank holds the whole model; the same
// bits without the delayed update); counters are the shards' after the last step.
// Returns the committed checkpoint directory.
absl::StatusOr<std::string> SaveCheckpoint(const std::string& root, v1::CheckpointManifest manifest,
                                           const uint16_t* weights16, OptimizerBackend* backend,
                                           const StepCounters& counters, int keep);

// Restores a checkpoint read with ReadManifest: the 16-bit weights into weights16
// (padded_length,), and every shard's state and step counters through `backend`, whose job
// must exist with the manifest's partition map. The caller checks the files first
// (VerifyCheckpointFiles, before it creates that job), so a truncated or altered file is refused
// before anything changes.
absl::Status RestoreCheckpoint(const std::string& dir, const v1::CheckpointManifest& manifest,
                               uint16_t* weights16, OptimizerBackend* backend);

// Model weights trained elsewhere, in GPT-2 naming (a Hugging Face GPT-2 model.safetensors,
// with or without the "transformer." prefix, or our own model.safetensors), as fp32 into
// params (num_params,). Every tensor must be there with the shape the config implies.
absl::Status LoadGpt2Weights(const std::string& path, const Gpt2Config& config, float* params);

Gpt2Config ModelConfigFromProto(const v1::ModelConfig& m);
v1::ModelConfig ModelConfigToProto(const Gpt2Config& c);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_TRAIN_CHECKPOINTING_H_
