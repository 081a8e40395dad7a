// The on-disk layout of checkpoints and how one is committed so that a crash never loses the
// previous one:
//
//   <root>/step-00000100/{manifest.json, model.safetensors, shard-0.safetensors, ...}
//   <root>/latest            text file naming the current step dir ("step-00000100")
//
// A checkpoint is staged in <root>/step-00000100.tmp and becomes visible in one rename; `latest`
// is then replaced atomically. Readers go through `latest` only, so a half-written staging dir
// is never seen. One writer per root at a time.
#ifndef OFFLOAD_OPTIMIZER_CLIENT_CHECKPOINT_CHECKPOINT_DIR_H_
#define OFFLOAD_OPTIMIZER_CLIENT_CHECKPOINT_CHECKPOINT_DIR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "offload/v1/checkpoint.pb.h"

namespace offload {

inline constexpr char kManifestFileName[] = "manifest.json";
inline constexpr char kLatestFileName[] = "latest";

// "step-00000100": the directory name of a step's checkpoint.
std::string StepDirName(uint64_t step);

class CheckpointStaging {
 public:
  // Creates root if missing and a fresh staging dir for `step`. Staging dirs left over from a
  // crash (any step) are removed first.
  static absl::StatusOr<CheckpointStaging> Begin(const std::string& root, uint64_t step);

  CheckpointStaging(CheckpointStaging&&) = default;
  CheckpointStaging& operator=(CheckpointStaging&&) = default;
  CheckpointStaging(const CheckpointStaging&) = delete;
  CheckpointStaging& operator=(const CheckpointStaging&) = delete;

  // Where to write a file of this checkpoint.
  std::string PathOf(absl::string_view file) const;
  const std::string& staging_dir() const { return staging_dir_; }

  // Validates the manifest (its step must be this checkpoint's, and every file it names must
  // have been written), writes it, fsyncs every file and the dir, renames the dir to its final
  // name, rewrites `latest`, then removes step dirs older than the new one beyond the `keep`
  // most recent (the new one included). Step dirs newer than the new one (left by a run that
  // was rewound to an older checkpoint) are never removed. Returns the final dir.
  absl::StatusOr<std::string> Commit(const v1::CheckpointManifest& manifest, int keep = 2);
  // The same for any manifest (param_state/'s): `manifest_json` is written as manifest.json, and
  // `files` are the files it names, each of which must have been written.
  absl::StatusOr<std::string> Commit(const std::string& manifest_json,
                                     const std::vector<std::string>& files, int keep);

 private:
  CheckpointStaging(std::string root, uint64_t step, std::string staging_dir)
      : root_(std::move(root)), step_(step), staging_dir_(std::move(staging_dir)) {}

  std::string root_;
  uint64_t step_ = 0;
  std::string staging_dir_;
  bool committed_ = false;
};

// The step dir `latest` points to, or NotFound if root has no checkpoint yet.
absl::StatusOr<std::string> LatestCheckpointDir(const std::string& root);

// Reads and strictly parses <checkpoint_dir>/manifest.json.
absl::StatusOr<v1::CheckpointManifest> ReadManifest(const std::string& checkpoint_dir);

// DataLoss naming the file unless `path` holds exactly digest.bytes() bytes (checked first: both
// sizes are named) whose CRC-32 is digest.crc32() (both CRCs named, in hex). Reads the file
// once, in bounded chunks.
absl::Status VerifyFileDigest(const std::string& path, const v1::FileDigest& digest);

// VerifyFileDigest on every file of the checkpoint in `checkpoint_dir` whose digest the manifest
// records (the model file, then each shard file). A checkpoint written before digests existed
// records none and passes unchecked. It reads the whole checkpoint, and loads nothing: a resume
// runs it before anything changes.
absl::Status VerifyCheckpointFiles(const std::string& checkpoint_dir,
                                   const v1::CheckpointManifest& manifest);

}  // namespace offload

#endif  // OFFLOAD_OPTIMIZER_CLIENT_CHECKPOINT_CHECKPOINT_DIR_H_
