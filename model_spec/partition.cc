#include "model_spec/partition.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace offload {

absl::StatusOr<v1::PartitionMap> MakePartitionMap(int64_t num_params, int world_size,
                                                  int num_shards) {
  if (num_params <= 0) return absl::InvalidArgumentError("the model has no parameters");
  if (world_size < 1) return absl::InvalidArgumentError("world_size must be >= 1");
  if (num_shards < 1) return absl::InvalidArgumentError("the number of shards must be >= 1");
  const int64_t unit = kPartitionBlock * world_size;
  const int64_t padded = (num_params + unit - 1) / unit * unit;
  if (num_shards > padded / kPartitionBlock) {
    return absl::InvalidArgumentError(absl::StrCat(num_shards, " shards for ", num_params,
                                                   " parameters: each shard needs at least ",
                                                   kPartitionBlock, " of them"));
  }
  const int64_t per_rank = padded / world_size;
  v1::PartitionMap map;
  map.set_num_params(num_params);
  map.set_padded_length(padded);
  map.set_world_size(world_size);
  map.set_num_shards(num_shards);
  // Shard ranges balanced by element count, cut on block boundaries so no block is split.
  const int64_t blocks = padded / kPartitionBlock;
  std::vector<int> next_range(num_shards, 0);
  int64_t at = 0;
  while (at < padded) {
    const int rank = static_cast<int>(at / per_rank);
    // The shard holding `at`: the last s whose start is <= at.
    int shard = 0;
    for (int s = num_shards - 1; s >= 0; --s) {
      if (blocks * s / num_shards * kPartitionBlock <= at) {
        shard = s;
        break;
      }
    }
    const int64_t shard_end = blocks * (shard + 1) / num_shards * kPartitionBlock;
    const int64_t end = std::min(shard_end, (rank + 1) * per_rank);
    v1::ShardSlice* slice = map.add_slices();
    slice->set_shard_index(shard);
    slice->set_range_index(next_range[shard]++);
    slice->set_rank(rank);
    slice->set_offset(at);
    slice->set_length(end - at);
    at = end;
  }
  return map;
}

absl::Status ValidatePartitionMap(const v1::PartitionMap& map) {
  const uint64_t W = map.world_size(), S = map.num_shards();
  if (W < 1 || S < 1) {
    return absl::InvalidArgumentError("partition map: world_size and num_shards must be >= 1");
  }
  if (map.num_params() == 0 || map.padded_length() < map.num_params() ||
      map.padded_length() % (kPartitionBlock * W) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "partition map: padded_length ", map.padded_length(), " must cover num_params ",
        map.num_params(), " in whole ", kPartitionBlock, "-element blocks per rank"));
  }
  const uint64_t per_rank = map.padded_length() / W;
  std::vector<uint32_t> next_range(S, 0);
  uint64_t at = 0;
  for (const v1::ShardSlice& s : map.slices()) {
    if (s.offset() != at || s.length() == 0 || s.shard_index() >= S || s.rank() >= W ||
        s.offset() / per_rank != s.rank() || (s.offset() + s.length() - 1) / per_rank != s.rank() ||
        s.range_index() != next_range[s.shard_index()]) {
      return absl::InvalidArgumentError(absl::StrCat("partition map: slice at offset ", s.offset(),
                                                     " does not continue the map at ", at));
    }
    ++next_range[s.shard_index()];
    at += s.length();
  }
  if (at != map.padded_length()) {
    return absl::InvalidArgumentError(
        absl::StrCat("partition map: slices cover ", at, " of ", map.padded_length(), " elements"));
  }
  return absl::OkStatus();
}

std::vector<v1::ShardSlice> SlicesOfShard(const v1::PartitionMap& map, int shard) {
  std::vector<v1::ShardSlice> out;
  for (const v1::ShardSlice& s : map.slices()) {
    if (static_cast<int>(s.shard_index()) == shard) out.push_back(s);
  }
  return out;
}

}  // namespace offload
