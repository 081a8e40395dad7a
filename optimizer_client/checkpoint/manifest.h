// The checkpoint manifest (proto/offload/v1/checkpoint.proto) as JSON through the protobuf JSON
// mapping. Parsing is strict, because a manifest silently misread (a typo'd field dropped, a
// version we do not understand) would resume a run from the wrong state.
#ifndef OFFLOAD_OPTIMIZER_CLIENT_CHECKPOINT_MANIFEST_H_
#define OFFLOAD_OPTIMIZER_CLIENT_CHECKPOINT_MANIFEST_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"
#include "offload/v1/checkpoint.pb.h"

namespace offload {

inline constexpr uint32_t kManifestFormatVersion = 1;

// Unknown fields are errors, format_version must be 1, and the required parts must be present:
// model, partition, param_dtype (FP16 or BF16), model_file. Files the manifest names must be
// plain file names (they live next to it). Messages name the field.
absl::StatusOr<v1::CheckpointManifest> ParseManifestJson(absl::string_view json);

// The same checks without the JSON, for a manifest about to be written.
absl::Status ValidateManifest(const v1::CheckpointManifest& m);

// Pretty-printed, proto field names, every field printed (zeros too) so the file reads as a
// complete record.
std::string ManifestToJson(const v1::CheckpointManifest& m);

// The same JSON mapping for any manifest message (param_state/'s too): strict parsing (unknown
// fields are errors, -0.0 read back as +0.0) and complete, pretty printing.
absl::Status ParseJsonMessage(absl::string_view json, google::protobuf::Message* m);
std::string MessageToJson(const google::protobuf::Message& m);

// InvalidArgument unless `name` is a plain file name (no '/', not "." or ".."), naming `field`.
absl::Status CheckFileName(absl::string_view field, const std::string& name);

}  // namespace offload

#endif  // OFFLOAD_OPTIMIZER_CLIENT_CHECKPOINT_MANIFEST_H_
