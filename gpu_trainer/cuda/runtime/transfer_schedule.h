// The order in which an offload step's transfers run on the CUDA backend (ARCHITECTURE.md section
// 6), as host arithmetic the CPU tests check: the weights go up unit by unit in the order the next
// forward first reads them, each unit with an event the forward waits on just before its first
// kernel that reads it; the gradients come down range by range in the order backward finishes
// them. Both lists partition [0, num_params) into contiguous ranges of the flat layout
// (model_spec/param_layout.h).
#ifndef OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_TRANSFER_SCHEDULE_H_
#define OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_TRANSFER_SCHEDULE_H_

#include <cstdint>
#include <vector>

#include "model_spec/gpt2_config.h"

namespace offload {

struct FlatRange {
  int64_t offset = 0;
  int64_t n = 0;
  int64_t end() const { return offset + n; }
};

// (L + 2,) in forward order: unit 0 the embeddings (wte, wpe: the encoder, and the tied head at
// the very end), unit 1 + l block l, unit L + 1 ln_f.
std::vector<FlatRange> ForwardWeightUnits(const Gpt2Config& config);
// The unit whose upload the forward waits for before block l (-1: the encoder, L: ln_f and the
// head).
inline int WeightUnitBefore(int block) { return block + 1; }

// (L + 2,) in the order Gpt2Cpu::Backward and Gpt2Cuda::Backward finish them: ln_f first (its
// range runs to the end of the layout), blocks L-1 down to 0, the embeddings last (wte's gradient
// is final only after the encoder backward adds the embedding share to the head's).
std::vector<FlatRange> BackwardGradientRanges(const Gpt2Config& config);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_TRANSFER_SCHEDULE_H_
