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
inline constexpr int kBucketSlots = 3;  // the embeddings' and two in turn

struct BucketSlot {
  int slot = -1;       // -1: the padding bucket, which holds no device memory
  int previous = -1;   // the bucket that used the slot last in this pass, -1 if none
  int64_t offset = 0;  // elements from the start of the bucket area
};

struct BucketSlotPlan {
  std::vector<BucketSlot> of_bucket;  // (buckets,) of GradientBucketPlan::buckets
  int64_t slot_offset[kBucketSlots] = {};
  int64_t slot_elements[kBucketSlots] = {};
  int64_t total_elements = 0;  // the device's gradient area: the three slots, back to back
};

// Slot offsets are rounded up to `align_elements` (a multiple of 8 keeps every 16-bit gradient
// tensor 16-byte aligned, as in the flat layout).
BucketSlotPlan PlanBucketSlots(const GradientBucketPlan& buckets, int64_t align_elements = 64);

// Elements of the device's gradient area for `config` with buckets of bucket_elements (0: one
// gradient for every parameter, the flat area). What the memory planner counts.
int64_t DeviceGradientElements(const Gpt2Config& config, int64_t bucket_elements);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_ZERO_BUCKET_SLOTS_H_
