// The collectives of a world of one rank (a trainer that runs alone: every operation is a copy),
// and the argument checks every Collectives implementation shares, so that a call is refused
// the same way with or without peers.
#ifndef OFFLOAD_GPU_TRAINER_COLLECTIVES_LOCAL_COLLECTIVES_H_
#define OFFLOAD_GPU_TRAINER_COLLECTIVES_LOCAL_COLLECTIVES_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "gpu_trainer/collectives/collectives.h"

namespace offload {

// Rank 0 of 1. Never fails except on bad arguments.
std::unique_ptr<Collectives> SingleRankCollectives();

// The checks below return INVALID_ARGUMENT naming the operation and the argument, OK otherwise.
// They look only at the arguments, so a refused call communicates nothing and leaves the ranks
// in step (each rank refuses its own bad call; one rank's refusal cannot warn the others).

// counts has world_size entries >= 0; data and out are non-null where they hold elements; out
// either aliases exactly the segment `rank` of data or does not overlap data at all.
absl::Status CheckReduceScatterArgs(int rank, int world_size, const float* data, const float* out,
                                    const std::vector<int64_t>& counts);
// n >= 0; in may alias exactly out + rank * n, and overlaps out nowhere else.
absl::Status CheckAllGather16Args(int rank, int world_size, const uint16_t* in, const uint16_t* out,
                                  int64_t n);
// counts has world_size entries >= 0; in is non-null where counts[rank] > 0 and out where the
// sum is; in may alias exactly out + sum(counts[0 .. rank)), and overlaps out nowhere else.
absl::Status CheckAllGatherV16Args(int rank, int world_size, const uint16_t* in,
                                   const uint16_t* out, const std::vector<int64_t>& counts);
absl::Status CheckAllReduceArgs(const double* values, int n, ReduceOp op);
absl::Status CheckBroadcastArgs(int world_size, const void* data, int64_t bytes, int root);
// name is non-empty and has no '/': a fork's store keys are its parent's prefix + "/fork/" +
// name, so names without '/' keep every fork, and every fork of a fork, apart.
absl::Status CheckForkName(absl::string_view name);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_COLLECTIVES_LOCAL_COLLECTIVES_H_
