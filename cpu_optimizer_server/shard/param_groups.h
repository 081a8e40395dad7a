// The bound on a job's parameter groups (PyTorch's param_groups; ARCHITECTURE.md section 4.2),
// in a header of its own so that every data plane can size what carries a commit's per-group
// learning rates (the shared-memory command, for one) without depending on the shard store.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_PARAM_GROUPS_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_PARAM_GROUPS_H_

namespace offload {

// At most this many groups per job (CreateJobRequest.groups), so at most this many learning
// rates per commit (StepCommit.group_lr).
inline constexpr int kMaxParamGroups = 64;

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_PARAM_GROUPS_H_
