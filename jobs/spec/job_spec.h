// Job files and the JobSpec <-> gpu_trainer flags table (ARCHITECTURE.md section 7,
// proto/offload/v1/ job.proto). A job file is YAML or JSON; both parse into the same v1::JobSpec,
// and every mistake is reported with the path of the field it is about ("training.batch: ...").
#ifndef OFFLOAD_JOBS_SPEC_JOB_SPEC_H_
#define OFFLOAD_JOBS_SPEC_JOB_SPEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "offload/v1/job.pb.h"

namespace offload {

// YAML or JSON text into a JobSpec. Field names may be the proto names (max_restarts) or their
// JSON names (maxRestarts). Unknown fields, fields given twice, values of the wrong type or out of
// range are INVALID_ARGUMENT with the field's path. Does not validate values: ValidateJobSpec.
absl::StatusOr<v1::JobSpec> ParseJobSpec(absl::string_view text);

// ParseJobSpec of a file; NOT_FOUND naming the file when it is missing, and every error message
// starts with the file's path.
absl::StatusOr<v1::JobSpec> ReadJobSpecFile(const std::string& path);

// How a spec's paths (data, checkpoint dir, init_from) must look: a job the controller runs needs
// absolute ones (its workers run elsewhere); a trainer started by hand takes them as given.
enum class PathRule { kAsGiven, kAbsolute };

// The rules of the trainer's settings, the one place they live: every set field's range or choices
// and how fields combine (unset ones take gpu_trainer's defaults). The first problem comes back as
// INVALID_ARGUMENT "path: problem", e.g. "training.steps: must be >= 1, got 0". gpu_trainer applies
// them to its flags (JobSpecFromTrainerFlags).
absl::Status ValidateSettings(const v1::JobSpec& spec, PathRule paths);

// A job file's checks: a valid name, and the settings with absolute paths. A torch job (spec.torch
// set) instead needs a command, sets none of the fields its script owns (model, data, optimizer,
// training, eval; parallel beyond ranks, optimizer_servers and transport; checkpoint beyond dir),
// and its env may not set TorchJobVariables().
absl::Status ValidateJobSpec(const v1::JobSpec& spec);

// A job's priority is in [0, kMaxJobPriority].
inline constexpr int32_t kMaxJobPriority = 1000;
// A tenant's name: 1 to 63 of a-z 0-9 and '-' (a label in metrics and Kubernetes). INVALID_ARGUMENT
// naming `field` otherwise.
absl::Status ValidateTenantName(absl::string_view field, absl::string_view name);

// The environment variables a torch job's worker gives its command (ARCHITECTURE.md section 7):
// what a spec's torch.env may not override.
absl::Span<const absl::string_view> TorchJobVariables();

// parallel.shard_step_timeout_floor as a duration (60 s when unset); INVALID_ARGUMENT naming the
// field for text that is not a duration in (0, 1h].
absl::StatusOr<absl::Duration> ShardStepTimeoutFloor(const v1::ParallelSpec& parallel);

// The gpu_trainer flags of a spec: "--<flag>=<value>" for every set leaf that carries the
// (offload.v1.flag) option, in descriptor order. Floats are printed so they parse back exactly.
std::vector<std::string> JobSpecToFlags(const v1::JobSpec& spec);

// The inverse: "--flag=value" (or "-flag=value"), and for bools also "--flag" and "--noflag".
// Anything else, or a flag that is no JobSpec field, is INVALID_ARGUMENT naming it.
absl::StatusOr<v1::JobSpec> JobSpecFromFlags(const std::vector<std::string>& args);

// Whether JobSpecFromFlags claims `arg`: false only for a flag whose name is no JobSpec field (a
// setting of the trainer itself). True for every spelling it accepts of a field's flag, whatever
// the value ("--lr=abc", "--lr" without one), and for anything that is no flag at all ("lr=0.1"):
// those it refuses, naming the argument, where the trainer would only fail later.
bool IsJobSpecFlag(absl::string_view arg);

// The spec of the flags this process was started with (absl's registry): every JobSpec flag the
// process defines and that differs from its default, so a check of the spec is a check of what
// the command line asked for.
absl::StatusOr<v1::JobSpec> JobSpecFromTrainerFlags();

// `status` with every field path that has a flag said as the flag ("training.steps: must be >= 1"
// -> "--steps: must be >= 1"; "needs checkpoint.dir" -> "needs --checkpoint_dir"), for errors about
// a command line.
absl::Status NameTheFlag(const absl::Status& status);

// The spec as indented protobuf JSON with the proto field names, for people and `-o json`.
std::string JobSpecToJson(const v1::JobSpec& spec);

// The id of an attempt's job on its optimizer servers. The controller assigns it; a server that
// restarted and never saw the assignment derives it again, so both must use this one rule.
std::string ShardJobId(const std::string& job_id, uint32_t attempt);

}  // namespace offload

#endif  // OFFLOAD_JOBS_SPEC_JOB_SPEC_H_
