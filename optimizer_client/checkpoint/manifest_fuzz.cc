// libFuzzer target: ParseManifestJson on arbitrary text. A resume reads manifest.json from the
// checkpoint directory, which anything may have written, and what it names (files, the model, the
// partition) steers the whole restore, so it must be refused or accepted whole.
//
// The input is the manifest's text. An accepted manifest must pass ValidateManifest on its own,
// and print (ManifestToJson) to JSON that parses back to the same message: what a checkpoint
// writes, a resume must read.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "base/testing/fuzz_util.h"
#include "optimizer_client/checkpoint/manifest.h"

namespace offload {
namespace {

void Fail(const char* what, const std::string& detail) { FuzzFail("manifest_fuzz", what, detail); }

void Run(const uint8_t* data, size_t size) {
  const absl::string_view json(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<v1::CheckpointManifest> m = ParseManifestJson(json);
  if (!m.ok()) return;
  if (absl::Status s = ValidateManifest(*m); !s.ok()) {
    Fail("ParseManifestJson accepted what ValidateManifest refuses", s.ToString());
  }
  const std::string printed = ManifestToJson(*m);
  absl::StatusOr<v1::CheckpointManifest> back = ParseManifestJson(printed);
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
