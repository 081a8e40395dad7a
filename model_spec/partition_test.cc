// The partition map: rank partitions and shard ranges tile the padded flat space; a tampered map
// is refused.
#include "model_spec/partition.h"

#include <algorithm>
#include <vector>

#include "gtest/gtest.h"

namespace offload {
namespace {

TEST(Partition, SlicesTileThePaddedSpaceWithinRanks) {
  for (int64_t n : {1, 63, 64, 1000, 123457}) {
    for (int w : {1, 2, 3}) {
      for (int s : {1, 2, 3, 5}) {
        absl::StatusOr<v1::PartitionMap> map = MakePartitionMap(n, w, s);
        if (s > (n + 64 * w - 1) / (64 * w) * w) {
          EXPECT_FALSE(map.ok()) << n << " " << w << " " << s;
          continue;
        }
        ASSERT_TRUE(map.ok()) << map.status();
        ASSERT_TRUE(ValidatePartitionMap(*map).ok()) << ValidatePartitionMap(*map);
        EXPECT_EQ(map->padded_length() % (64 * w), 0u);
        EXPECT_GE(map->padded_length(), static_cast<uint64_t>(n));
        EXPECT_LT(map->padded_length(), static_cast<uint64_t>(n + 64 * w));
        // Shard ranges are balanced to within one block.
        std::vector<uint64_t> per_shard(s, 0);
        for (const v1::ShardSlice& slice : map->slices()) {
          per_shard[slice.shard_index()] += slice.length();
        }
        const auto [lo, hi] = std::minmax_element(per_shard.begin(), per_shard.end());
        EXPECT_LE(*hi - *lo, 64u);
      }
    }
  }
}

TEST(Partition, TamperedMapsAreRefused) {
  absl::StatusOr<v1::PartitionMap> map = MakePartitionMap(10000, 2, 3);
  ASSERT_TRUE(map.ok());
  v1::PartitionMap gap = *map;
  gap.mutable_slices(1)->set_offset(gap.slices(1).offset() + 1);
  EXPECT_FALSE(ValidatePartitionMap(gap).ok());
  v1::PartitionMap short_map = *map;
  short_map.mutable_slices()->RemoveLast();
  EXPECT_FALSE(ValidatePartitionMap(short_map).ok());
  v1::PartitionMap bad_shard = *map;
  bad_shard.mutable_slices(0)->set_shard_index(7);
  EXPECT_FALSE(ValidatePartitionMap(bad_shard).ok());
  EXPECT_FALSE(MakePartitionMap(0, 1, 1).ok());
  EXPECT_FALSE(MakePartitionMap(100, 0, 1).ok());
  EXPECT_FALSE(MakePartitionMap(100, 1, 0).ok());
}

}  // namespace
}  // namespace offload
