// A load of a job's optimizer state streamed in chunks of any size and in any order: the master
// weights a front end casts parameter by parameter, or a checkpoint read file by file. Each chunk
// is checked (finite; exp_avg_sq >= 0), cut at the slices it touches and sent to their shards at
// once, so the caller never holds more than its chunk. The padding after the last parameter
// (ARCHITECTURE.md section 3) is the partition's, not the caller's: Finish loads it as zeros in
// every tensor. The shards apply their parts at Finish; a refused chunk, a shard that went away, or
// destruction before Finish leaves every shard as it was.
#ifndef OFFLOAD_OPTIMIZER_CLIENT_BACKENDS_STATE_LOAD_H_
#define OFFLOAD_OPTIMIZER_CLIENT_BACKENDS_STATE_LOAD_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "optimizer_client/backends/optimizer_backend.h"

namespace offload {

class JobStateLoad {
 public:
  // Opens a load on every shard of the backend's job (rank 0's work); with `steps`, the ranges'
  // step counters are set too (a checkpoint), else a fresh start keeps them.
  static absl::StatusOr<std::unique_ptr<JobStateLoad>> Begin(OptimizerBackend* backend,
                                                             const StepCounters* steps);

  JobStateLoad(const JobStateLoad&) = delete;
  JobStateLoad& operator=(const JobStateLoad&) = delete;

  // values (n,) of flat elements [offset, offset + n) of `tensor`, inside [0, num_params).
  // An error ends the load: nothing is applied anywhere and later calls fail.
  absl::Status Add(v1::StateTensor tensor, int64_t offset, const float* values, int64_t n);
  absl::Status AddZeros(v1::StateTensor tensor, int64_t offset, int64_t n);
  // Loads the padding as zeros, then applies the load shard by shard. Every chunk was checked and
  // accepted before this, so only a shard lost in between fails here; the error then names the
  // shards already applied.
  absl::Status Finish();

 private:
  explicit JobStateLoad(OptimizerBackend* backend) : backend_(backend) {}
  absl::Status Fail(absl::Status status);
  // A chunk's tensor and range, inside [0, num_params); an error ends the load.
  absl::Status CheckChunk(v1::StateTensor tensor, int64_t offset, int64_t n);
  // Add's sending: the chunk cut at the slices it touches, any range of [0, padded_length).
  absl::Status Send(v1::StateTensor tensor, int64_t offset, const float* values, int64_t n);
  absl::Status SendZeros(v1::StateTensor tensor, int64_t offset, int64_t n);

  OptimizerBackend* const backend_;
  std::vector<std::unique_ptr<ShardStateLoad>> shards_;  // empty once ended
  bool ended_ = false;
};

// InvalidArgument naming the first of values (n,), flat elements from `offset`, that a load of
// `tensor` refuses: a value that is not finite, or a negative exp_avg_sq.
absl::Status CheckStateValues(v1::StateTensor tensor, int64_t offset, const float* values,
                              int64_t n);

}  // namespace offload

#endif  // OFFLOAD_OPTIMIZER_CLIENT_BACKENDS_STATE_LOAD_H_
