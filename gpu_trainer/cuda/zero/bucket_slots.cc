#include "gpu_trainer/cuda/zero/bucket_slots.h"

#include <algorithm>
#include <cstdint>
#include <iterator>

#include "model_spec/gradient_buckets.h"
#include "model_spec/param_layout.h"

namespace offload {

BucketSlotPlan PlanBucketSlots(const GradientBucketPlan& buckets) {
  const int64_t align = kAddressPhaseElements;
  BucketSlotPlan plan;
  plan.of_bucket.resize(buckets.buckets.size());
  int last_of_slot[kBucketSlots] = {-1, -1, -1};
  int turn = 1;  // the slot the next bucket besides the embeddings' takes: 1, 2, 1, 2, ...
  for (int b = 0; b < static_cast<int>(buckets.buckets.size()); ++b) {
    const GradientBucket& bucket = buckets.buckets[b];
    // The padding's gradients are zeros that never exist on the device.
    if (bucket.units == 0) continue;
    int slot = kEmbeddingSlot;
    if (!bucket.embeddings) {
      slot = turn;
      turn = 3 - turn;
    }
    plan.of_bucket[b].slot = slot;
    plan.of_bucket[b].previous = last_of_slot[slot];
    last_of_slot[slot] = b;
    plan.of_bucket[b].offset = bucket.lo % kAddressPhaseElements;  // the slot's added below
    plan.slot_elements[slot] =
        std::max(plan.slot_elements[slot], plan.of_bucket[b].offset + bucket.size());
  }
  int64_t end = 0;
  for (int s = 0; s < kBucketSlots; ++s) {
    plan.slot_offset[s] = end;
    end = (end + plan.slot_elements[s] + align - 1) / align * align;
  }
  plan.total_elements = end;
  for (BucketSlot& slot : plan.of_bucket) {
    if (slot.slot >= 0) slot.offset += plan.slot_offset[slot.slot];
  }
  return plan;
}

int64_t ReduceScratchElements(const BucketSlotPlan& slots) {
  return *std::max_element(std::begin(slots.slot_elements), std::end(slots.slot_elements));
}

int64_t DeviceGradientElements(const Gpt2Config& config, int64_t bucket_elements) {
  const int64_t num_params = Gpt2NumParams(config);
  if (bucket_elements <= 0) return num_params;
  return PlanBucketSlots(PlanGradientBuckets(config, num_params, bucket_elements)).total_elements;
}

}  // namespace offload
