// A front end's checkpoint of the optimizer state, by parameter name (ARCHITECTURE.md section 16):
//
//   <root>/step-00000100/{manifest.json, master.safetensors, exp_avg.safetensors,
//                         exp_avg_sq.safetensors}
//   <root>/latest
//
// Each file holds one fp32 state tensor of every parameter under the model's own parameter name,
// so the state does not depend on how the flat space was padded, partitioned or sharded: it loads
// onto any number of optimizer servers and ranks, and master.safetensors is the fp32 model as
// torch names it. Both directions stream: a save reads the servers 16 MiB at a time straight
// into the files, a load reads the files 4 MiB at a time straight into the servers, so neither
// holds the state in the calling process. Directories are staged and committed as the GPT
// trainer's checkpoints are (checkpoint/checkpoint_dir.h): a crash mid-save leaves the previous
// checkpoint whole. Every file's size and CRC-32 are in the manifest, checked as the file streams
// in, and the servers apply the load only when every file matched.
#ifndef OFFLOAD_OPTIMIZER_CLIENT_PARAM_STATE_PARAM_CHECKPOINT_H_
#define OFFLOAD_OPTIMIZER_CLIENT_PARAM_STATE_PARAM_CHECKPOINT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "offload/v1/checkpoint.pb.h"
#include "optimizer_client/backends/optimizer_backend.h"

namespace offload {

inline constexpr uint32_t kParamStateFormatVersion = 1;

// One parameter of the front end's flat space: its name, shape, and where it starts.
struct NamedParam {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;
  int64_t numel() const;
};

// What a checkpoint records besides the tensors.
struct ParamStateInfo {
  StepCounters counters;
  v1::LossScaleState loss_scale;
  DType param_dtype = DType::kBf16;
  v1::DType state_dtype = v1::DTYPE_FP32;  // the servers' moments (ParamStateManifest.state_dtype)
  std::string front_end;                   // the front end's own record (JSON), kept as it is
  // Saved between two micro-batches of a step: its fp32 gradient sum so far, (num_params,) in the
  // flat space, not owned; written to grad_sum.safetensors by parameter name. Null: none.
  const float* grad_sum = nullptr;
};

// InvalidArgument unless the names are non-empty and distinct, the shapes non-negative, and the
// ranges lie inside [0, num_params) without overlapping.
absl::Status CheckNamedParams(const std::vector<NamedParam>& params, int64_t num_params);

// Writes the servers' state of `params` as a new checkpoint under root (step dir named by
// info.counters.completed_step), keeping the `keep` newest. Returns the committed directory.
absl::StatusOr<std::string> SaveParamState(const std::string& root,
                                           const std::vector<NamedParam>& params,
                                           const ParamStateInfo& info, OptimizerBackend* backend,
                                           int keep);

// The checkpoint directory `path` names: itself when it holds a manifest.json, else the step dir
// its `latest` file names. NotFound when it is neither.
absl::StatusOr<std::string> FindParamState(const std::string& path);

// Reads and strictly parses <dir>/manifest.json.
absl::StatusOr<v1::ParamStateManifest> ReadParamStateManifest(const std::string& dir);
// The same from the manifest's text (`path` names it in errors): unknown fields, another format
// version, a dtype that is not 16-bit, adam_step > step, a file name with a '/', a file without
// a digest, or anything but one file each of master, exp_avg and exp_avg_sq are DataLoss.
absl::StatusOr<v1::ParamStateManifest> ParseParamStateManifest(absl::string_view json,
                                                               const std::string& path);

// The gradient sum a checkpoint saved between two micro-batches holds (ParamStateInfo::grad_sum)
// into out (num_params,): each parameter's at its offset, zeros elsewhere. NotFound when the
// checkpoint has none; a checkpoint of another model and a file cut short or altered are refused
// as LoadParamState refuses them.
absl::Status ReadParamGradSum(const std::string& dir, const std::vector<NamedParam>& params,
                              int64_t num_params, float* out);

// InvalidArgument naming the first parameter in `params`' order that the checkpoint in `dir`
// lacks or holds with another shape, or a parameter it has that `params` lacks: a checkpoint of
// another model. Reads only the manifest.
absl::Status CheckParamState(const std::string& dir, const std::vector<NamedParam>& params);

// Loads the checkpoint in `dir` onto the backend's job (rank 0's work), its step counters too.
// Refused before anything streams (InvalidArgument, naming the first parameter in `params`' order
// that the checkpoint lacks or holds with another shape, or a parameter it has that `params`
// lacks): a checkpoint of another model; and one of other 16-bit weights than param_dtype. Refused
// with DataLoss naming the file when a file is cut short, altered (its CRC-32), or disagrees with
// the manifest. In every refusal no server changes. Elements of the flat space no parameter covers
// (the padding) load as zeros. Returns the manifest.
absl::StatusOr<v1::ParamStateManifest> LoadParamState(const std::string& dir,
                                                      const std::vector<NamedParam>& params,
                                                      DType param_dtype, OptimizerBackend* backend);

}  // namespace offload

#endif  // OFFLOAD_OPTIMIZER_CLIENT_PARAM_STATE_PARAM_CHECKPOINT_H_
