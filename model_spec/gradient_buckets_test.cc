// The gradient buckets: they tile the padded flat space in backward order without splitting a
// unit, and RankCounts cuts a range at the rank partitions as a per-element count does.
#include "model_spec/gradient_buckets.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "model_spec/gpt2_config.h"
#include "model_spec/param_layout.h"
#include "model_spec/param_layout_test_util.h"

namespace offload {
namespace {

// What every plan must be, whatever bucket_elements: the buckets tile [0, padded) from the top
// down, contiguous; each parameter bucket holds whole consecutive units and reaches
// bucket_elements unless it is the last (the embeddings'); bucket_of_unit names the bucket each
// unit's range lies in.
void ExpectWellFormed(const Gpt2Config& c, int64_t padded, int64_t bucket_elements,
                      const GradientBucketPlan& plan) {
  const int64_t num_params = Gpt2NumParams(c);
  const int units = Gpt2NumUnits(c);
  ASSERT_FALSE(plan.buckets.empty());
  ASSERT_EQ(plan.bucket_of_unit.size(), static_cast<size_t>(units));
  int64_t top = padded;
  int next_unit = units - 1;  // the highest unit no bucket has taken yet
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    const GradientBucket& bucket = plan.buckets[b];
    SCOPED_TRACE(testing::Message()
                 << "bucket " << b << " [" << bucket.lo << ", " << bucket.hi << ")");
    EXPECT_EQ(bucket.hi, top);
    EXPECT_LT(bucket.lo, bucket.hi);
    top = bucket.lo;
    if (bucket.units == 0) {
      // Only the padding, and only first.
      EXPECT_EQ(b, 0u);
      EXPECT_EQ(bucket.lo, num_params);
      EXPECT_EQ(bucket.hi, padded);
      EXPECT_FALSE(bucket.embeddings);
      continue;
    }
    // Whole units, consecutive from next_unit down.
    EXPECT_EQ(bucket.hi, Gpt2UnitRange(c, next_unit).end);
    for (int u = 0; u < bucket.units; ++u, --next_unit) {
      ASSERT_GE(next_unit, 0);
      EXPECT_EQ(plan.bucket_of_unit[next_unit], static_cast<int>(b));
      const ParamRange r = Gpt2UnitRange(c, next_unit);
      EXPECT_GE(r.begin, bucket.lo);
      EXPECT_LE(r.end, bucket.hi);
    }
    EXPECT_EQ(bucket.lo, Gpt2UnitRange(c, next_unit + 1).begin);
    EXPECT_EQ(bucket.embeddings, next_unit == -1);
    if (!bucket.embeddings) {
      EXPECT_GE(bucket.size(), bucket_elements);
      // Greedy: one unit fewer would not have reached bucket_elements.
      if (bucket.units > 1) {
        EXPECT_LT(bucket.size() - Gpt2UnitRange(c, next_unit + 1).size(), bucket_elements);
      }
    }
  }
  EXPECT_EQ(top, 0);
  EXPECT_EQ(next_unit, -1);
  EXPECT_TRUE(plan.buckets.back().embeddings);
}

TEST(GradientBuckets, HandCheckedSmallModel) {
  const Gpt2Config c = TinyGpt2Config();
  ASSERT_EQ(Gpt2NumParams(c), 2824);
  const GradientBucketPlan plan = PlanGradientBuckets(c, 2880, 1000);
  ASSERT_EQ(plan.buckets.size(), 3u);
  // The padding; ln_f + h.2 hold 888 < 1000, so h.1 joins them; h.0 and the embeddings.
  EXPECT_EQ(plan.buckets[0].lo, 2824);
  EXPECT_EQ(plan.buckets[0].hi, 2880);
  EXPECT_EQ(plan.buckets[0].units, 0);
  EXPECT_EQ(plan.buckets[1].lo, 1064);
  EXPECT_EQ(plan.buckets[1].hi, 2824);
  EXPECT_EQ(plan.buckets[1].units, 3);
  EXPECT_FALSE(plan.buckets[1].embeddings);
  EXPECT_EQ(plan.buckets[2].lo, 0);
  EXPECT_EQ(plan.buckets[2].hi, 1064);
  EXPECT_EQ(plan.buckets[2].units, 2);
  EXPECT_TRUE(plan.buckets[2].embeddings);
  EXPECT_EQ(plan.bucket_of_unit, (std::vector<int>{2, 2, 1, 1, 1}));
  ExpectWellFormed(c, 2880, 1000, plan);
}

TEST(GradientBuckets, ExactBucketsCloseAtTheirUnit) {
  // 888 = ln_f + h.2 exactly reaches the threshold; then h.1 + h.0 = 1744, then the embeddings
  // alone, fewer than 888.
  const Gpt2Config c = TinyGpt2Config();
  const GradientBucketPlan plan = PlanGradientBuckets(c, 2824, 888);
  ASSERT_EQ(plan.buckets.size(), 3u);  // no padding
  EXPECT_EQ(plan.buckets[0].lo, 1936);
  EXPECT_EQ(plan.buckets[1].lo, 192);
  EXPECT_EQ(plan.buckets[2].lo, 0);
  EXPECT_EQ(plan.buckets[2].units, 1);
  ExpectWellFormed(c, 2824, 888, plan);
}

TEST(GradientBuckets, OneElementBucketsHoldOneUnitEach) {
  const Gpt2Config c = TinyGpt2Config();
  for (int64_t bucket_elements : {-5, 0, 1}) {
    const GradientBucketPlan plan = PlanGradientBuckets(c, 2880, bucket_elements);
    ASSERT_EQ(plan.buckets.size(), 1u + c.num_layers + 2);  // the padding, then L + 2 units
    for (int unit = 0; unit < Gpt2NumUnits(c); ++unit) {
      const GradientBucket& b = plan.buckets[plan.bucket_of_unit[unit]];
      EXPECT_EQ(plan.bucket_of_unit[unit], Gpt2NumUnits(c) - unit);
      EXPECT_EQ(b.units, 1);
      EXPECT_EQ(b.lo, Gpt2UnitRange(c, unit).begin);
      EXPECT_EQ(b.hi, Gpt2UnitRange(c, unit).end);
    }
    ExpectWellFormed(c, 2880, bucket_elements, plan);
  }
}

TEST(GradientBuckets, HugeBucketsHoldEverythingWithTheEmbeddings) {
  const Gpt2Config c = TinyGpt2Config();
  const GradientBucketPlan plan = PlanGradientBuckets(c, 2824, int64_t{1} << 40);
  ASSERT_EQ(plan.buckets.size(), 1u);
  EXPECT_EQ(plan.buckets[0].lo, 0);
  EXPECT_EQ(plan.buckets[0].hi, 2824);
  EXPECT_EQ(plan.buckets[0].units, Gpt2NumUnits(c));
  EXPECT_TRUE(plan.buckets[0].embeddings);
  EXPECT_EQ(plan.bucket_of_unit, std::vector<int>(Gpt2NumUnits(c), 0));
}

TEST(GradientBuckets, EveryThresholdGivesAWellFormedPlan) {
  for (int layers : {1, 2, 3, 5}) {
    const Gpt2Config c = TinyGpt2Config(layers);
    const int64_t num_params = Gpt2NumParams(c);
    for (int64_t padded : {num_params, num_params + 1, num_params + 100}) {
      for (int64_t bucket_elements :
           {int64_t{1}, int64_t{16}, int64_t{17}, int64_t{192}, int64_t{871}, int64_t{872},
            int64_t{873}, int64_t{888}, int64_t{2000}, int64_t{5000}, num_params}) {
        SCOPED_TRACE(testing::Message() << "L " << layers << " padded " << padded
                                        << " bucket_elements " << bucket_elements);
        ExpectWellFormed(c, padded, bucket_elements,
                         PlanGradientBuckets(c, padded, bucket_elements));
      }
    }
  }
}

TEST(PlanBuckets, ClosesABucketOnceItHoldsEnough) {
  // 3 + 4 = 7 >= 6 closes; 5 + 2 = 7 closes; 6 alone closes; 1 is the last, short one.
  EXPECT_EQ(PlanBuckets({3, 4, 5, 2, 6, 1}, 6), (std::vector<int>{0, 0, 1, 1, 2, 3}));
  // Exactly the threshold closes too, and nothing left over makes no short bucket.
  EXPECT_EQ(PlanBuckets({2, 4, 6}, 6), (std::vector<int>{0, 0, 1}));
  // A member larger than the threshold is a bucket of its own, never split.
  EXPECT_EQ(PlanBuckets({1, 100, 1}, 6), (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(PlanBuckets({}, 6), std::vector<int>{});
}

TEST(PlanBuckets, OneElementBucketsHoldOneMemberEach) {
  for (int64_t bucket_elements : {-5, 0, 1}) {
    EXPECT_EQ(PlanBuckets({3, 1, 7}, bucket_elements), (std::vector<int>{0, 1, 2}));
  }
  // An empty member closes nothing at 1: it joins the next.
  EXPECT_EQ(PlanBuckets({0, 2}, 1), (std::vector<int>{0, 0}));
}

TEST(PlanBuckets, HugeBucketsHoldEverything) {
  EXPECT_EQ(PlanBuckets({3, 1, 7}, int64_t{1} << 40), (std::vector<int>{0, 0, 0}));
}

TEST(RankCounts, MatchesAPerElementCount) {
  for (int world_size : {1, 2, 3, 4, 7}) {
    for (int64_t partition_length : {1, 2, 5, 8}) {
      const int64_t padded = partition_length * world_size;
      for (int64_t lo = 0; lo <= padded; ++lo) {
        for (int64_t hi = lo; hi <= padded; ++hi) {
          const std::vector<int64_t> counts = RankCounts(lo, hi, partition_length, world_size);
          ASSERT_EQ(counts.size(), static_cast<size_t>(world_size));
          std::vector<int64_t> expected(world_size, 0);
          for (int64_t i = lo; i < hi; ++i) expected[i / partition_length]++;
          ASSERT_EQ(counts, expected)
              << "[" << lo << ", " << hi << ") P " << partition_length << " W " << world_size;
          int64_t sum = 0;
          for (int64_t n : counts) sum += n;
          EXPECT_EQ(sum, hi - lo);
        }
      }
    }
  }
}

TEST(RankCounts, ReachesPastTheLastPartitionOnlyInThePartitions) {
  // A range beyond the partitions counts only what lies in them: nothing is given to no rank.
  EXPECT_EQ(RankCounts(6, 20, 4, 2), (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(RankCounts(0, 0, 4, 2), (std::vector<int64_t>{0, 0}));
}

}  // namespace
}  // namespace offload
