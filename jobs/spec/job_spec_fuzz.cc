// libFuzzer target: ParseJobSpec on arbitrary text, YAML or JSON (one parser reads both). Job files
// come from users, through offloadctl, the REST gateway and gRPC, and the spec they parse to
// becomes a trainer's command line, so the parser must refuse bad text with a Status, never crash.
//
// The input is the job file's text. An accepted spec must also survive what the controller and the
// trainer do with it: validation, the flags it turns into (which must parse back to the same
// flags) and its JSON (which must parse back to the same spec).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "base/testing/fuzz_util.h"
#include "jobs/spec/job_spec.h"

namespace offload {
namespace {

void Fail(const char* what, const std::string& detail) { FuzzFail("job_spec_fuzz", what, detail); }

void Run(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(text);
  if (!spec.ok()) {
    (void)NameTheFlag(spec.status());  // what offloadctl and the trainer print
    return;
  }
  (void)ValidateJobSpec(*spec);
  (void)ValidateSettings(*spec, PathRule::kAsGiven);

  // The trainer's command line: its flags parse back to a spec that prints the same flags.
  const std::vector<std::string> flags = JobSpecToFlags(*spec);
  absl::StatusOr<v1::JobSpec> from_flags = JobSpecFromFlags(flags);
  if (!from_flags.ok()) {
    Fail("the spec's flags do not parse back",
         absl::StrCat(from_flags.status().ToString(), "\n", absl::StrJoin(flags, " ")));
  }
  const std::vector<std::string> again = JobSpecToFlags(*from_flags);
  if (again != flags) {
    Fail("the spec's flags parse back to other flags",
         absl::StrCat(absl::StrJoin(flags, " "), "\n", absl::StrJoin(again, " ")));
  }

  // `offloadctl get -o json`, fed back as a job file.
  const std::string json = JobSpecToJson(*spec);
  absl::StatusOr<v1::JobSpec> back = ParseJobSpec(json);
  if (!back.ok()) Fail("the spec's JSON does not parse back", back.status().ToString() + json);
  if (DeterministicBytes(*back) != DeterministicBytes(*spec))
    Fail("the spec's JSON parses to another spec", json);
}

}  // namespace
}  // namespace offload

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  offload::Run(data, size);
  return 0;
}
