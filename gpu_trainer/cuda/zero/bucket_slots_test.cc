// The device's gradient bucket slots: the embeddings' bucket alone in slot 0, the others taking
// slots 1 and 2 in turn, each waiting for the bucket that used its slot last; the slots back to
// back at multiples of 128 elements (256 bytes), each bucket at its flat address phase in its
// slot.
#include "gpu_trainer/cuda/zero/bucket_slots.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "model_spec/gpt2_config.h"
#include "model_spec/gradient_buckets.h"
#include "model_spec/param_layout.h"
#include "model_spec/param_layout_test_util.h"

namespace offload {
namespace {

TEST(BucketSlots, HandCheckedUnitBuckets) {
  const Gpt2Config c = TinyGpt2Config();
  // The padding, ln_f, h.2, h.1, h.0, the embeddings.
  const GradientBucketPlan buckets = PlanGradientBuckets(c, 2880, 1);
  ASSERT_EQ(buckets.buckets.size(), 6u);
  const BucketSlotPlan plan = PlanBucketSlots(buckets);
  ASSERT_EQ(plan.of_bucket.size(), 6u);
  const int slot[] = {-1, 1, 2, 1, 2, 0};
  const int previous[] = {-1, -1, -1, 1, 2, -1};
  for (int b = 0; b < 6; ++b) {
    EXPECT_EQ(plan.of_bucket[b].slot, slot[b]) << b;
    EXPECT_EQ(plan.of_bucket[b].previous, previous[b]) << b;
  }
  // Phases (lo % 128): ln_f 2808 -> 120, h.2 1936 -> 16, h.1 1064 -> 40, h.0 192 -> 64, the
  // embeddings 0. Slot 1 holds ln_f (120 + 16) and h.1 (40 + 872 = 912); slot 2 h.2 (16 + 872)
  // and h.0 (64 + 872 = 936); slot 0 the embeddings' 192.
  EXPECT_EQ(plan.slot_elements[0], 192);
  EXPECT_EQ(plan.slot_elements[1], 912);
  EXPECT_EQ(plan.slot_elements[2], 936);
  // 192 rounds up to 256; 256 + 912 = 1168 to 1280; 1280 + 936 = 2216 to 2304.
  EXPECT_EQ(plan.slot_offset[0], 0);
  EXPECT_EQ(plan.slot_offset[1], 256);
  EXPECT_EQ(plan.slot_offset[2], 1280);
  EXPECT_EQ(plan.total_elements, 2304);
  EXPECT_EQ(plan.of_bucket[1].offset, 256 + 120);
  EXPECT_EQ(plan.of_bucket[2].offset, 1280 + 16);
  EXPECT_EQ(plan.of_bucket[3].offset, 256 + 40);
  EXPECT_EQ(plan.of_bucket[4].offset, 1280 + 64);
  EXPECT_EQ(plan.of_bucket[5].offset, 0);
}

TEST(BucketSlots, EveryPlanAlternatesAndFits) {
  for (int layers : {1, 2, 3, 5, 12}) {
    const Gpt2Config c = TinyGpt2Config(layers);
    const int64_t num_params = Gpt2NumParams(c);
    for (int64_t padded : {num_params, num_params + 40}) {
      for (int64_t bucket_elements : {1, 16, 900, 1800, 3000, 100000}) {
        {
          constexpr int64_t align = kAddressPhaseElements;
          SCOPED_TRACE(testing::Message() << "L " << layers << " padded " << padded
                                          << " bucket_elements " << bucket_elements);
          const GradientBucketPlan buckets = PlanGradientBuckets(c, padded, bucket_elements);
          const BucketSlotPlan plan = PlanBucketSlots(buckets);
          ASSERT_EQ(plan.of_bucket.size(), buckets.buckets.size());
          int last_of_slot[kBucketSlots] = {-1, -1, -1};
          int64_t largest[kBucketSlots] = {};
          int expected_turn = 1;
          for (int b = 0; b < static_cast<int>(buckets.buckets.size()); ++b) {
            const GradientBucket& bucket = buckets.buckets[b];
            const BucketSlot& s = plan.of_bucket[b];
            if (bucket.units == 0) {
              EXPECT_EQ(s.slot, -1);
              EXPECT_EQ(s.previous, -1);
              continue;
            }
            if (bucket.embeddings) {
              EXPECT_EQ(s.slot, kEmbeddingSlot);
            } else {
              EXPECT_EQ(s.slot, expected_turn);
              expected_turn = 3 - expected_turn;
            }
            ASSERT_GE(s.slot, 0);
            ASSERT_LT(s.slot, kBucketSlots);
            EXPECT_EQ(s.previous, last_of_slot[s.slot]);
            last_of_slot[s.slot] = b;
            // At its flat address phase in its slot, so every tensor keeps its 256-byte phase.
            const int64_t phase = bucket.lo % align;
            largest[s.slot] = std::max(largest[s.slot], phase + bucket.size());
            EXPECT_EQ(s.offset, plan.slot_offset[s.slot] + phase);
            EXPECT_EQ(s.offset % align, bucket.lo % align);
          }
          int64_t end = 0;
          for (int s = 0; s < kBucketSlots; ++s) {
            EXPECT_EQ(plan.slot_elements[s], largest[s]) << s;
            EXPECT_EQ(plan.slot_offset[s] % align, 0) << s;
            EXPECT_GE(plan.slot_offset[s], end) << s;
            EXPECT_LT(plan.slot_offset[s], end + align) << s;
            end = plan.slot_offset[s] + plan.slot_elements[s];
          }
          EXPECT_EQ(plan.total_elements % align, 0);
          EXPECT_GE(plan.total_elements, end);
          EXPECT_LT(plan.total_elements, end + align);
        }
      }
    }
  }
}

TEST(BucketSlots, DeviceGradientElements) {
  const Gpt2Config c = TinyGpt2Config();
  // No buckets: every parameter's gradient on the device.
  EXPECT_EQ(DeviceGradientElements(c, 0), 2824);
  EXPECT_EQ(DeviceGradientElements(c, -1), 2824);
  // Unit buckets: the embeddings' and two blocks', as in HandCheckedUnitBuckets.
  EXPECT_EQ(DeviceGradientElements(c, 1), 2304);
  // One bucket with everything (phase 0): slot 0 holds all 2824, rounded to 2944.
  EXPECT_EQ(DeviceGradientElements(c, int64_t{1} << 40), 2944);
  // Twelve blocks, 10672 parameters, hold no more than three buckets. Block l starts at
  // 192 + 872 l, at phase (64 + 104 l) % 128. Units: ln_f, h.10, h.8, ..., h.0 take slot 1, whose
  // largest with its phase is h.4 (96 + 872 = 968); h.11, h.9, ..., h.1 slot 2, h.3 (120 + 872 =
  // 992): 192 -> 256 | + 968 = 1224 -> 1280 | + 992 = 2272 -> 2304. 2000-element buckets:
  // ln_f + h.11..h.9 from 8040 (phase 104, 104 + 2632 = 2736) and h.5..h.3 from 2808 (120 + 2616
  // = 2736) in slot 1, h.8..h.6 from 5424 (48 + 2616) and h.2..h.0 from 192 (64 + 2616 = 2680) in
  // slot 2: 256 | + 2736 = 2992 -> 3072 | + 2680 = 5752 -> 5760.
  const Gpt2Config deep = TinyGpt2Config(12);
  ASSERT_EQ(Gpt2NumParams(deep), 10672);
  EXPECT_EQ(DeviceGradientElements(deep, 1), 2304);
  EXPECT_EQ(DeviceGradientElements(deep, 2000), 5760);
}

// The reduce-scatter's fp32 scratch holds any bucket, the embeddings' too: with a vocabulary of
// 200 their bucket, (200 + 8) * 8 = 1664 elements, is larger than a block's 872.
TEST(BucketSlots, ReduceScratchHoldsTheLargestBucketEmbeddingsIncluded) {
  Gpt2Config c = TinyGpt2Config();
  EXPECT_EQ(ReduceScratchElements(PlanBucketSlots(PlanGradientBuckets(c, Gpt2NumParams(c), 1))),
            64 + 872);  // h.0 at phase 64 is the largest of slot 1 and 2 (h.1 40, h.2 16)
  c.vocab_size = 200;
  EXPECT_EQ(ReduceScratchElements(PlanBucketSlots(PlanGradientBuckets(c, Gpt2NumParams(c), 1))),
            1664);
}

}  // namespace
}  // namespace offload
