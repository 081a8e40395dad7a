// The device's gradient bucket slots: the embeddings' bucket alone in slot 0, the others taking
// slots 1 and 2 in turn, each waiting for the bucket that used its slot last; the slots back to
// back and aligned.
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
  EXPECT_EQ(plan.slot_elements[0], 192);
  EXPECT_EQ(plan.slot_elements[1], 872);
  EXPECT_EQ(plan.slot_elements[2], 872);
  // 192 is aligned already; 192 + 872 = 1064 rounds up to 1088; 1088 + 872 = 1960 to 1984.
  EXPECT_EQ(plan.slot_offset[0], 0);
  EXPECT_EQ(plan.slot_offset[1], 192);
  EXPECT_EQ(plan.slot_offset[2], 1088);
  EXPECT_EQ(plan.total_elements, 1984);
  EXPECT_EQ(plan.of_bucket[3].offset, 192);
  EXPECT_EQ(plan.of_bucket[4].offset, 1088);
  EXPECT_EQ(plan.of_bucket[5].offset, 0);
}

TEST(BucketSlots, EveryPlanAlternatesAndFits) {
  for (int layers : {1, 2, 3, 5, 12}) {
    const Gpt2Config c = TinyGpt2Config(layers);
    const int64_t num_params = Gpt2NumParams(c);
    for (int64_t padded : {num_params, num_params + 40}) {
      for (int64_t bucket_elements : {1, 16, 900, 1800, 3000, 100000}) {
        for (int64_t align : {1, 8, 64}) {
          SCOPED_TRACE(testing::Message()
                       << "L " << layers << " padded " << padded << " bucket_elements "
                       << bucket_elements << " align " << align);
          const GradientBucketPlan buckets = PlanGradientBuckets(c, padded, bucket_elements);
          const BucketSlotPlan plan = PlanBucketSlots(buckets, align);
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
            largest[s.slot] = std::max(largest[s.slot], bucket.size());
            EXPECT_EQ(s.offset, plan.slot_offset[s.slot]);
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
  EXPECT_EQ(DeviceGradientElements(c, 1), 1984);
  // One bucket with everything: slot 0 holds all 2824, rounded to 2880; the others are empty.
  EXPECT_EQ(DeviceGradientElements(c, int64_t{1} << 40), 2880);
  // Twelve blocks, 10672 parameters, hold no more than three buckets: with units, the same as
  // three blocks; with 2000-element buckets, ln_f + h.11..h.9 (2632) in slot 1, then three blocks
  // (2616) in slot 2, in turn, and the embeddings alone: 192 | 2632 -> 2880 | 2616 -> 5504.
  const Gpt2Config deep = TinyGpt2Config(12);
  ASSERT_EQ(Gpt2NumParams(deep), 10672);
  EXPECT_EQ(DeviceGradientElements(deep, 1), 1984);
  EXPECT_EQ(DeviceGradientElements(deep, 2000), 5504);
}

}  // namespace
}  // namespace offload
