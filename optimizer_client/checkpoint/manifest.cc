#include "optimizer_client/checkpoint/manifest.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/reflection.h"
#include "google/protobuf/util/json_util.h"

namespace offload {

absl::Status CheckFileName(absl::string_view field, const std::string& name) {
  if (name.empty())
    return absl::InvalidArgumentError(absl::StrCat("manifest: ", field, " is empty"));
  if (name.find('/') != std::string::npos || name == "." || name == "..") {
    return absl::InvalidArgumentError(
        absl::StrCat("manifest: ", field, " is '", name,
                     "'; it must be a file name in the checkpoint directory"));
  }
  return absl::OkStatus();
}

namespace {

// Protobuf's JSON printer writes -0.0 as "-0", which its parser reads back as the integer 0, so a
// manifest holding a negative zero would not read back as the message that was written. No field
// of a manifest means anything different for -0.0, so a parsed manifest holds +0.0 instead.
void ClearNegativeZeros(google::protobuf::Message& m) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Descriptor* d = m.GetDescriptor();
  const google::protobuf::Reflection* r = m.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    const int n = f->is_repeated() ? r->FieldSize(m, f) : 1;
    for (int j = 0; j < n; ++j) {
      switch (f->cpp_type()) {
        case FieldDescriptor::CPPTYPE_FLOAT: {
          const float v = f->is_repeated() ? r->GetRepeatedFloat(m, f, j) : r->GetFloat(m, f);
          if (v != 0.0f || !std::signbit(v)) break;
          f->is_repeated() ? r->SetRepeatedFloat(&m, f, j, 0.0f) : r->SetFloat(&m, f, 0.0f);
          break;
        }
        case FieldDescriptor::CPPTYPE_DOUBLE: {
          const double v = f->is_repeated() ? r->GetRepeatedDouble(m, f, j) : r->GetDouble(m, f);
          if (v != 0.0 || !std::signbit(v)) break;
          f->is_repeated() ? r->SetRepeatedDouble(&m, f, j, 0.0) : r->SetDouble(&m, f, 0.0);
          break;
        }
        case FieldDescriptor::CPPTYPE_MESSAGE:
          if (f->is_repeated()) {
            ClearNegativeZeros(*r->MutableRepeatedMessage(&m, f, j));
          } else if (r->HasField(m, f)) {
            ClearNegativeZeros(*r->MutableMessage(&m, f));
          }
          break;
        default:
          break;
      }
    }
  }
}

}  // namespace

absl::Status ValidateManifest(const v1::CheckpointManifest& m) {
  if (m.format_version() != kManifestFormatVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("manifest: format_version is ", m.format_version(),
                     "; this build reads version ", kManifestFormatVersion));
  }
  if (!m.has_model()) return absl::InvalidArgumentError("manifest: model is missing");
  if (!m.has_partition()) return absl::InvalidArgumentError("manifest: partition is missing");
  if (m.param_dtype() != v1::DTYPE_FP16 && m.param_dtype() != v1::DTYPE_BF16) {
    return absl::InvalidArgumentError(absl::StrCat("manifest: param_dtype is ",
                                                   v1::DType_Name(m.param_dtype()),
                                                   "; expected DTYPE_FP16 or DTYPE_BF16"));
  }
  OFFLOAD_RETURN_IF_ERROR(CheckFileName("model_file", m.model_file()));
  for (int i = 0; i < m.shard_files_size(); ++i) {
    absl::Status s =
        CheckFileName(absl::StrCat("shard_files[", i, "].file"), m.shard_files(i).file());
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ParseJsonMessage(absl::string_view json, google::protobuf::Message* m) {
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;  // a misspelt field must not vanish silently
  google::protobuf::util::Status s = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), m, options);
  if (!s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "manifest is not a valid ", m->GetDescriptor()->name(), ": ", std::string(s.message())));
  }
  ClearNegativeZeros(*m);
  return absl::OkStatus();
}

std::string MessageToJson(const google::protobuf::Message& m) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string out;
  // Printing a message of a compiled-in type cannot fail (no Any to resolve).
  (void)google::protobuf::util::MessageToJsonString(m, &out, options);
  return out;
}

absl::StatusOr<v1::CheckpointManifest> ParseManifestJson(absl::string_view json) {
  v1::CheckpointManifest m;
  OFFLOAD_RETURN_IF_ERROR(ParseJsonMessage(json, &m));
  OFFLOAD_RETURN_IF_ERROR(ValidateManifest(m));
  return m;
}

std::string ManifestToJson(const v1::CheckpointManifest& m) { return MessageToJson(m); }

}  // namespace offload
