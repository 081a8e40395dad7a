// The partition map of ARCHITECTURE.md section 3: the flat parameter space padded so each of the W
// rank partitions is a whole number of 64-element blocks, split into S balanced shard ranges, and
// cut into slices where a rank partition meets a shard range. Computed in one place and handed to
// every rank and shard; it is part of every checkpoint.
#ifndef OFFLOAD_MODEL_SPEC_PARTITION_H_
#define OFFLOAD_MODEL_SPEC_PARTITION_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "offload/v1/checkpoint.pb.h"

namespace offload {

inline constexpr int64_t kPartitionBlock = 64;

absl::StatusOr<v1::PartitionMap> MakePartitionMap(int64_t num_params, int world_size,
                                                  int num_shards);

// Checks a map read from a checkpoint or the wire: slices ordered, contiguous, covering
// [0, padded_length), each inside one rank partition, range indices dense per shard.
absl::Status ValidatePartitionMap(const v1::PartitionMap& map);

// The slices shard `shard` holds, in range_index order.
std::vector<v1::ShardSlice> SlicesOfShard(const v1::PartitionMap& map, int shard);

}  // namespace offload

#endif  // OFFLOAD_MODEL_SPEC_PARTITION_H_
