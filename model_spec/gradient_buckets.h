// How the gradients leave backward (ARCHITECTURE.md sections 1 and 3): grouped into buckets of
// consecutive units in backward order (ln_f, the blocks from the last, the embeddings), each
// reduced and sent as a whole once its last unit is final. One plan for both backends: the CPU
// backend's fp32 buckets (gpu_trainer/train/gradient_reducer.h) and the CUDA backend's device
// buckets (gpu_trainer/cuda/zero/bucket_slots.h) hold the same ranges, so W ranks on either reduce
// the same pieces.
#ifndef OFFLOAD_MODEL_SPEC_GRADIENT_BUCKETS_H_
#define OFFLOAD_MODEL_SPEC_GRADIENT_BUCKETS_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "model_spec/gpt2_config.h"

namespace offload {

struct GradientBucket {
  int64_t lo = 0, hi = 0;   // flat [lo, hi)
  int units = 0;            // units it holds (0: the padding above the parameters)
  bool embeddings = false;  // holds unit 0, written at both ends of backward
  int64_t size() const { return hi - lo; }
};

struct GradientBucketPlan {
  // In backward order; the padding [num_params, padded_length) first when there is any.
  std::vector<GradientBucket> buckets;
  std::vector<int> bucket_of_unit;  // (units,) index into buckets
};

// The greedy planner every front end's buckets come from (this trainer's, and the PyTorch front
// end's through offload_plan_buckets): members of sizes[i] elements, in the order they are
// grouped, go into buckets of consecutive members; a bucket closes once it holds at least
// bucket_elements, and the last may hold fewer; a member is never split. bucket_elements <= 1:
// each member (of at least one element) a bucket of its own. Returns each member's bucket, 0, 1,
// ... in order. Sizes >= 0 whose sum fits in int64_t.
std::vector<int> PlanBuckets(absl::Span<const int64_t> sizes, int64_t bucket_elements);

// Units grouped by PlanBuckets from ln_f down (the last bucket holds the embeddings). padded_length
// >= Gpt2NumParams(config).
GradientBucketPlan PlanGradientBuckets(const Gpt2Config& config, int64_t padded_length,
                                       int64_t bucket_elements);

// counts (W,): the piece of flat [lo, hi) in each rank's partition [r * P, (r + 1) * P), in rank
// order, which is flat order: the segments a reduce-scatter of the range or an all-gather of it
// takes (collectives.h). partition_length P > 0.
std::vector<int64_t> RankCounts(int64_t lo, int64_t hi, int64_t partition_length, int world_size);

}  // namespace offload

#endif  // OFFLOAD_MODEL_SPEC_GRADIENT_BUCKETS_H_
