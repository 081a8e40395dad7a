// Where the CUDA backend's gradient buckets live on the device (ARCHITECTURE.md section 6), as
// host arithmetic the CPU tests check: the embeddings' bucket in a slot of its own (the tied head
// writes wte at the start of backward and the encoder adds into it at the end), and every other
// bucket in one of two slots taken in turn, so the device holds at most two buckets besides the
// embeddings': one being written while the one before it is reduced and copied out. A bucket may
// take its slot only once the bucket that used it last has left (the slot's `previous`).
#ifndef OFFLOAD_GPU_TRAINER_CUDA_ZERO_BUCKET_SLOTS_H_
#define OFFLOAD_GPU_TRAINER_CUDA_ZERO_BUCKET_SLOTS_H_

#include <cstdint>
#include <vector>

#include "model_spec/gradient_buckets.h"

namespace offload {

inline constexpr int kEmbeddingSlot = 0;
// Elements of 16 bits in 256 bytes, the largest alignment cuBLASLt's plans look at
// (blas/gemm_spec.h): a bucket starts in its slot at its flat offset modulo this, so every tensor
// has the address phase it has in the flat buffer, and the products pick the same algorithms.
inline constexpr int64_t kAddressPhaseElements = 128;
inline constexpr int kBucketSlots = 3;  // the embeddings' and two in turn

struct BucketSlot {
  int slot = -1;      // -1: the padding bucket, which holds no device memory
  int previous = -1;  // the bucket that used the slot last in this pass, -1 if none
  // Elements from the start of the bucket area to the bucket's first: the slot's offset plus the
  // bucket's address phase (lo % kAddressPhaseElements).
  int64_t offset = 0;
};

struct BucketSlotPlan {
  std::vector<BucketSlot> of_bucket;  // (buckets,) of GradientBucketPlan::buckets
  int64_t slot_offset[kBucketSlots] = {};
  int64_t slot_elements[kBucketSlots] = {};
  int64_t total_elements = 0;  // the device's gradient area: the three slots, back to back
};

// Slot offsets are multiples of kAddressPhaseElements, and a slot holds its largest bucket with
// that bucket's phase in front.
BucketSlotPlan PlanBucketSlots(const GradientBucketPlan& buckets);

// Elements of the fp32 scratch a reduce-scatter of any bucket needs: the largest slot, the
// embeddings' included (its bucket is reduced like the others).
int64_t ReduceScratchElements(const BucketSlotPlan& slots);

// Elements of the device's gradient area for `config` with buckets of bucket_elements (0: one
// gradient for every parameter, the flat area). What the memory planner counts.
int64_t DeviceGradientElements(const Gpt2Config& config, int64_t bucket_elements);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_ZERO_BUCKET_SLOTS_H_
