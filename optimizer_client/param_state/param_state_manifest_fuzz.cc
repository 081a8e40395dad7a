// libFuzzer target: ParseParamStateManifest on arbitrary text. load_checkpoint reads
// manifest.json from a directory anything may have written, and what it names (the files, their
// digests, the counters, the parameters) steers the whole load, so it must be refused or accepted
// whole.
//
// An accepted manifest must print (MessageToJson, what a save writes) to JSON that parses back,
// to the same message.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "base/testing/fuzz_util.h"
#include "optimizer_client/checkpoint/manifest.h"
#include "optimizer_client/param_state/param_checkpoint.h"

namespace offload {
namespace {

void Fail(const char* what, const std::string& detail) {
  FuzzFail("param_state_manifest_fuzz", what, detail);
}

void Run(const uint8_t* data, size_t size) {
  const absl::string_view json(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<v1::ParamStateManifest> m = ParseParamStateManifest(json, "manifest.json");
  if (!m.ok()) {
    if (m.status().code() != absl::StatusCode::kDataLoss) {
      Fail("a refused manifest is not DataLoss", m.status().ToString());
    }
    return;
  }
  const std::string printed = MessageToJson(*m);
  absl::StatusOr<v1::ParamStateManifest> back = ParseParamStateManifest(printed, "printed");
  if (!back.ok()) Fail("the printed manifest does not parse back", back.status().ToString());
  if (DeterministicBytes(*back) != DeterministicBytes(*m))
    Fail("the printed manifest parses to another message", printed);
}

}  // namespace
}  // namespace offload

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  offload::Run(data, size);
  return 0;
}
