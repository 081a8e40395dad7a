#include "jobs/spec/job_spec.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"

namespace offload {

std::string JobSpecToJson(const v1::JobSpec& spec) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  std::string json;
  if (!google::protobuf::util::MessageToJsonString(spec, &json, options).ok()) {
    // It fails only on Any and other well-known types, which JobSpec does not use.
    return "{}";
  }
  return json;
}

std::string ShardJobId(const std::string& job_id, uint32_t attempt) {
  return absl::StrCat(job_id, ".", attempt);
}

}  // namespace offload
