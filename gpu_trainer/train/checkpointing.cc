#include "gpu_trainer/train/checkpointing.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "base/status_macros.h"
#include "model_spec/param_layout.h"
#include "model_spec/partition.h"
#include "optimizer_client/checkpoint/checkpoint_dir.h"
#include "optimizer_client/checkpoint/safetensors.h"
#include "optimizer_client/checkpoint/state_tensor_names.h"

namespace offload {
namespace {

TensorDType SafetensorsDType(v1::DType d) {
  return d == v1::DTYPE_BF16 ? TensorDType::kBF16 : TensorDType::kF16;
}

std::string ShardFileName(int shard) { return absl::StrCat("shard-", shard, ".safetensors"); }

v1::FileDigest DigestProto(const FileChecksum& c) {
  v1::FileDigest d;
  d.set_bytes(static_cast<uint64_t>(c.bytes));
  d.set_crc32(c.crc32);
  return d;
}

}  // namespace

Gpt2Config ModelConfigFromProto(const v1::ModelConfig& m) {
  Gpt2Config c;
  c.vocab_size = static_cast<int>(m.vocab_size());
  c.context_length = static_cast<int>(m.context_length());
  c.num_layers = static_cast<int>(m.num_layers());
  c.num_heads = static_cast<int>(m.num_heads());
  c.channels = static_cast<int>(m.channels());
  return c;
}

v1::ModelConfig ModelConfigToProto(const Gpt2Config& c) {
  v1::ModelConfig m;
  m.set_vocab_size(c.vocab_size);
  m.set_context_length(c.context_length);
  m.set_num_layers(c.num_layers);
  m.set_num_heads(c.num_heads);
  m.set_channels(c.channels);
  return m;
}

absl::StatusOr<std::string> SaveCheckpoint(const std::string& root, v1::CheckpointManifest manifest,
                                           const uint16_t* weights16, OptimizerBackend* backend,
                                           const StepCounters& counters, int keep) {
  absl::StatusOr<CheckpointStaging> staging = CheckpointStaging::Begin(root, manifest.step());
  if (!staging.ok()) return staging.status();

  // The model as the trainer computes with it: 16-bit, GPT-2 names and shapes.
  const Gpt2Config config = ModelConfigFromProto(manifest.model());
  std::vector<SafetensorsTensor> model_tensors;
  for (const ParamTensor& p : Gpt2ParamLayout(config)) {
    SafetensorsTensor t;
    t.name = p.name;
    t.dtype = SafetensorsDType(manifest.param_dtype());
    t.shape = p.shape;
    if (weights16 != nullptr) {
      t.data = weights16 + p.offset;
    } else {
      const DType dtype = manifest.param_dtype() == v1::DTYPE_BF16 ? DType::kBf16 : DType::kFp16;
      t.fill = [backend, dtype, first = p.offset](int64_t byte_offset, int64_t nbytes, void* out) {
        const int64_t n = nbytes / 2;
        std::vector<float> master(n);  // (n,) one fill's worth, at most 8 Mi elements
        OFFLOAD_RETURN_IF_ERROR(backend->ReadRange(v1::STATE_TENSOR_MASTER_WEIGHTS,
                                                   first + byte_offset / 2, n, master.data()));
        ConvertFromFloat(master.data(), n, dtype, out);
        return absl::OkStatus();
      };
    }
    model_tensors.push_back(std::move(t));
  }
  manifest.set_model_file("model.safetensors");
  // Each file's size and CRC-32 as it streamed out, which a resume checks before loading it.
  FileChecksum checksum;
  OFFLOAD_RETURN_IF_ERROR(WriteSafetensors(staging->PathOf(manifest.model_file()), model_tensors,
                                           {{"format", "pt"}}, &checksum));
  *manifest.mutable_model_file_digest() = DigestProto(checksum);

  // Each shard's fp32 state, streamed from the shard in chunks straight into its file.
  const v1::PartitionMap& map = backend->partition();
  manifest.clear_shard_files();
  for (int shard = 0; shard < static_cast<int>(map.num_shards()); ++shard) {
    std::vector<SafetensorsTensor> tensors;
    for (int i = 0; i < map.slices_size(); ++i) {
      const v1::ShardSlice& slice = map.slices(i);
      if (static_cast<int>(slice.shard_index()) != shard) continue;
      for (const StateTensorName& st : kStateTensorNames) {
        SafetensorsTensor t;
        t.name = absl::StrCat(st.name, ".", slice.range_index());
        t.dtype = TensorDType::kF32;
        t.shape = {static_cast<int64_t>(slice.length())};
        const v1::StateTensor tensor = st.tensor;
        const int64_t first = slice.offset();
        t.fill = [backend, i, tensor, first](int64_t byte_offset, int64_t nbytes, void* out) {
          return backend->ReadSliceState(i, tensor, first + byte_offset / 4, nbytes / 4,
                                         static_cast<float*>(out));
        };
        tensors.push_back(std::move(t));
      }
    }
    v1::ShardFile* file = manifest.add_shard_files();
    file->set_shard_index(shard);
    file->set_file(ShardFileName(shard));
    file->set_completed_step(counters.completed_step);
    file->set_adam_step(counters.adam_step);
    OFFLOAD_RETURN_IF_ERROR(WriteSafetensors(staging->PathOf(file->file()), tensors,
                                             {{"shard_index", absl::StrCat(shard)}}, &checksum));
    *file->mutable_digest() = DigestProto(checksum);
  }
  return staging->Commit(manifest, keep);
}

absl::Status RestoreCheckpoint(const std::string& dir, const v1::CheckpointManifest& manifest,
                               uint16_t* weights16, OptimizerBackend* backend) {
  const v1::PartitionMap& map = backend->partition();
  if (manifest.partition().SerializeAsString() != map.SerializeAsString()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", dir, " has a different partition map (", manifest.partition().num_shards(),
        " shards, ", manifest.partition().world_size(), " ranks) from this run (", map.num_shards(),
        " shards, ", map.world_size(), " ranks); re-sharding a checkpoint is not supported yet"));
  }
  // Model weights: the exact 16-bit values.
  const std::string model_path = absl::StrCat(dir, "/", manifest.model_file());
  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> model,
                           SafetensorsReader::Open(model_path));
  const TensorDType want = SafetensorsDType(manifest.param_dtype());
  std::memset(weights16, 0, map.padded_length() * sizeof(uint16_t));
  for (const ParamTensor& p : Gpt2ParamLayout(ModelConfigFromProto(manifest.model()))) {
    const SafetensorsEntry* e = model->Find(p.name);
    if (e == nullptr || e->dtype != want || e->shape != p.shape) {
      return absl::DataLossError(absl::StrCat(model_path, ": tensor ", p.name,
                                              " is missing or has the wrong dtype or shape"));
    }
    std::memcpy(weights16 + p.offset, model->Data(*e), p.numel * sizeof(uint16_t));
  }
  // Shard state: one all-or-nothing load per shard, step counters included.
  if (manifest.shard_files_size() != static_cast<int>(map.num_shards())) {
    return absl::DataLossError(absl::StrCat("checkpoint ", dir, " names ",
                                            manifest.shard_files_size(), " shard files for ",
                                            map.num_shards(), " shards"));
  }
  std::vector<bool> seen(map.num_shards(), false);
  for (const v1::ShardFile& file : manifest.shard_files()) {
    if (file.shard_index() >= map.num_shards() || seen[file.shard_index()]) {
      return absl::DataLossError(absl::StrCat("checkpoint ", dir, ": shard_files name shard ",
                                              file.shard_index(), " twice or out of range"));
    }
    seen[file.shard_index()] = true;
  }
  for (const v1::ShardFile& file : manifest.shard_files()) {
    const std::string path = absl::StrCat(dir, "/", file.file());
    absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
    if (!reader.ok()) return reader.status();
    std::vector<StateSliceRef> refs;
    for (const v1::ShardSlice& slice : SlicesOfShard(map, file.shard_index())) {
      for (const StateTensorName& st : kStateTensorNames) {
        const std::string name = absl::StrCat(st.name, ".", slice.range_index());
        const SafetensorsEntry* e = (*reader)->Find(name);
        if (e == nullptr || e->dtype != TensorDType::kF32 ||
            e->shape != std::vector<int64_t>{static_cast<int64_t>(slice.length())}) {
          return absl::DataLossError(
              absl::StrCat(path, ": tensor ", name, " is missing or has the wrong dtype or shape"));
        }
        refs.push_back(StateSliceRef{st.tensor, static_cast<int64_t>(slice.offset()),
                                     static_cast<const float*>((*reader)->Data(*e)),
                                     static_cast<int64_t>(slice.length())});
      }
    }
    const StepCounters counters{file.completed_step(), file.adam_step()};
    OFFLOAD_RETURN_IF_ERROR(backend->LoadShardState(file.shard_index(), refs, &counters));
  }
  return absl::OkStatus();
}

absl::Status LoadGpt2Weights(const std::string& path, const Gpt2Config& config, float* params) {
  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> reader,
                           SafetensorsReader::Open(path));
  for (const ParamTensor& p : Gpt2ParamLayout(config)) {
    std::string name = p.name;
    if (reader->Find(name) == nullptr) name = absl::StrCat("transformer.", p.name);
    if (reader->Find(name) == nullptr) {
      return absl::NotFoundError(absl::StrCat(path, ": no tensor ", p.name, " (GPT-2 naming)"));
    }
    OFFLOAD_RETURN_IF_ERROR(reader->ReadAsFloat(name, p.shape, params + p.offset));
  }
  return absl::OkStatus();
}

}  // namespace offload
