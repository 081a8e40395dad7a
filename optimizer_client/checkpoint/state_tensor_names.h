// The names checkpoints and messages give the optimizer's three fp32 state tensors: the GPT
// trainer's shard files hold "<name>.<range>", a front end's checkpoint "<name>.safetensors".
#ifndef OFFLOAD_OPTIMIZER_CLIENT_CHECKPOINT_STATE_TENSOR_NAMES_H_
#define OFFLOAD_OPTIMIZER_CLIENT_CHECKPOINT_STATE_TENSOR_NAMES_H_

#include "offload/v1/optimizer.pb.h"

namespace offload {

struct StateTensorName {
  v1::StateTensor tensor;
  const char* name;
};

inline constexpr StateTensorName kStateTensorNames[] = {
    {v1::STATE_TENSOR_MASTER_WEIGHTS, "master"},
    {v1::STATE_TENSOR_EXP_AVG, "exp_avg"},
    {v1::STATE_TENSOR_EXP_AVG_SQ, "exp_avg_sq"},
};

// "master", "exp_avg" or "exp_avg_sq"; "?" for anything else.
inline const char* StateTensorNameOf(v1::StateTensor tensor) {
  for (const StateTensorName& t : kStateTensorNames) {
    if (t.tensor == tensor) return t.name;
  }
  return "?";
}

}  // namespace offload

#endif  // OFFLOAD_OPTIMIZER_CLIENT_CHECKPOINT_STATE_TENSOR_NAMES_H_
