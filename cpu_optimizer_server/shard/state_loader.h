// Loading a job's optimizer state onto a shard: the initial fp32 master weights from the
// trainer, or weights and moments from a checkpoint. All chunks of a load are validated and held
// until the load is applied, then copied in one go, so a bad chunk anywhere fails the whole
// load and the shard's state stays bit-identical. A range on the disk tier holds its chunks in a
// staging file of its own instead of memory (a restore brings 12 bytes per parameter), copied
// into the range's state file when the load is applied.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_STATE_LOADER_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_STATE_LOADER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "cpu_optimizer_server/shard/shard_store.h"

namespace offload {

class StateLoader {
 public:
  static absl::StatusOr<std::unique_ptr<StateLoader>> Start(ShardStore* store,
                                                            const std::string& job_id);

  // Takes fp32 values of flat elements [offset, offset + data.size() / 4) of `tensor`.
  absl::Status AddChunk(StateTensor tensor, int64_t offset, DType dtype, std::string data);
  const std::string& job_id() const { return job_->config.job_id; }

  // Restoring a checkpoint sets every range's step counters too. Every committed step was
  // applied or skipped, so adam_step <= completed_step.
  absl::Status SetSteps(uint64_t completed_step, uint64_t adam_step);
  // Copies everything in. Fails (changing nothing) while a step stream is open on a range.
  // Returns the number of elements loaded.
  absl::StatusOr<int64_t> Apply();

 private:
  struct Chunk {
    StateTensor tensor;
    RangeState* range;
    int64_t begin;     // range-relative
    std::string data;  // (n,) fp32; empty for a range on disk (the chunk is in its staging file)
    int64_t n = 0;
  };
  // The staging file of a range on disk, made at its first chunk.
  absl::StatusOr<StateFile*> Staging(RangeState* range);
  // Copies the staged chunks of `range` into its state file.
  absl::Status ApplyFromStaging(RangeState* range);
  StateLoader(ShardStore* store, std::shared_ptr<Job> job) : store_(store), job_(std::move(job)) {}

  ShardStore* const store_;
  const std::shared_ptr<Job> job_;
  std::vector<Chunk> chunks_;
  std::map<RangeState*, std::unique_ptr<StateFile>> staging_;
  std::map<std::pair<RangeState*, StateTensor>, IntervalSet> covered_;
  std::optional<std::pair<uint64_t, uint64_t>> steps_;
  Reservation held_bytes_;
};

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_STATE_LOADER_H_
