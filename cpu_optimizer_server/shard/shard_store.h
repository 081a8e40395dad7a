// The state an optimizer shard holds for its jobs: per range, the fp32 master weights and Adam
// moments, step counters and, only when a step has several micro-batches, an fp32 gradient
// accumulator. Every byte is accounted against the shard's memory limit.
//
// The store has no gRPC in it: the service (optimizer_service.h) translates wire messages into
// these calls, and the tests drive it directly.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_SHARD_STORE_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_SHARD_STORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "base/host_buffer.h"
#include "base/thread_pool.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"
#include "cpu_optimizer_server/disk/disk_tier.h"
#include "cpu_optimizer_server/disk/state_file.h"
#include "cpu_optimizer_server/shard/interval_set.h"
#include "cpu_optimizer_server/shard/memory_budget.h"
#include "cpu_optimizer_server/shard/param_groups.h"

namespace offload {

enum class StateTensor { kMasterWeights, kExpAvg, kExpAvgSq };

struct RangeSpec {
  int64_t offset = 0;  // first element in the job's flat parameter space
  int64_t length = 0;
};

// Flat elements [offset, offset + length) that share Adam hyper-parameters: one of PyTorch's
// param_groups. A group may reach beyond this shard's ranges (every shard of a job gets the same
// list, so a group's index names the same group everywhere, as a commit's group_lr does).
struct ParamGroupSpec {
  int64_t offset = 0;
  int64_t length = 0;
  AdamHyperParams adam;
};

// Where a job's fp32 master weights and moments live. kAuto: in memory when they fit the memory
// limit, else on the server's disk tier (--state_dir), or always on disk with --state_tier=disk.
enum class StateTier { kAuto = 0, kMemory = 1, kDisk = 2 };

struct JobConfig {
  std::string job_id;
  std::vector<RangeSpec> ranges;
  // Without groups, the job's one group. With groups, unused by the update (JobConfigFromProto
  // sets it to the first group's, which is what DescribeShard reports).
  AdamHyperParams adam;
  DType param_dtype = DType::kFp16;  // the 16-bit copy sent back: kFp16 or kBf16
  // In offset order, not overlapping, covering every element of every range, at most
  // kMaxParamGroups. Empty means one group, `adam`, over all the ranges: CreateJob fills it in,
  // so a created job's config always has at least one group.
  std::vector<ParamGroupSpec> groups;
  StateTier state_tier = StateTier::kAuto;  // after CreateJob: kMemory or kDisk, what was chosen
  // The Adam moments' storage: kFp32 (12 bytes of state a parameter with the master), or kBf16
  // (8 bytes), rounded as state_rounding says (adam_kernel.h). The master weights are fp32.
  DType state_dtype = DType::kFp32;
  StateRounding state_rounding = StateRounding::kStochastic;
};

// Where one group meets one range: range-relative elements [begin, end) take the scalars of
// JobConfig::groups[group]. A range's pieces are in order and tile it exactly.
struct RangeGroupPiece {
  int64_t begin = 0;
  int64_t end = 0;
  int group = 0;
};

// One contiguous range of a job on this shard.
struct RangeState {
  RangeSpec spec;
  int index = 0;                              // position in JobConfig::ranges
  std::vector<RangeGroupPiece> group_pieces;  // fixed at creation

  // In memory: one mapping carved into three views, each (length,) and 64-byte aligned: the
  // master in fp32, the moments in state_dtype.
  DType state_dtype = DType::kFp32;
  HostBuffer storage;
  float* param = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  // On disk instead (the views above stay null): the same three tensors in a state file, which
  // a commit streams through the disk tier's ring.
  std::unique_ptr<StateFile> file;
  // Set, under tensors_mu, when a pass over `file` failed part-way: the file then holds some
  // waves updated and some not, so steps and reads are refused until a load replaces all three
  // tensors (a restore from a checkpoint).
  std::string state_lost;

  // Guards the tensor contents (above and the accumulator) for passes that read or write them:
  // the Adam pass of a commit, loads, reads. Held for a whole pass, so never under `mu`.
  std::mutex tensors_mu;
  HostBuffer accumulator_storage;  // (length,) fp32, allocated on the first accumulating chunk
  float* accumulator = nullptr;
  Reservation accumulator_reservation;
  // Where an update during backward (StepSession::UpdateEarly) writes the state it computes,
  // leaving the range's own state untouched until the commit: laid out as `storage`. A commit
  // that keeps early updates writes every other element there too and then swaps the two
  // buffers (SwapStaging): so an early update costs no copy, and undoing one costs nothing.
  // Allocated on the first such update and kept, as the accumulator is: a buffer made anew every
  // step costs its page faults every step (1.2 GB of them for 100M parameters).
  HostBuffer staging_storage;
  Reservation staging_reservation;
  float* staging_param() const { return static_cast<float*>(staging_storage.data()); }
  void* staging_exp_avg() const { return MomentView(staging_storage, 0); }
  void* staging_exp_avg_sq() const { return MomentView(staging_storage, 1); }

  // Elements in each view of `storage` (and of `staging_storage`): length, rounded up to whole
  // 64-byte lines of every view.
  int64_t stride() const;
  // The bytes `storage` (and `staging_storage`) takes.
  int64_t storage_bytes() const;
  // Points param, exp_avg and exp_avg_sq at `storage`'s three views.
  void CarveViews();
  // The staging copy becomes the range's state and the state the staging copy: pointers, not
  // bytes. Under tensors_mu.
  void SwapStaging();

  // Guards the counters and the step lease; held only briefly.
  mutable std::mutex mu;
  bool step_in_progress = false;  // one step stream at a time owns the range
  uint64_t completed_step = 0;    // the last step committed (applied or skipped)
  uint64_t adam_step = 0;         // updates applied: the `t` of bias correction
  // Every committed step was applied or skipped.
  uint64_t skipped_steps() const { return completed_step - adam_step; }
  IntervalSet loaded;  // range-relative elements of the master weights loaded so far

  void* Tensor(StateTensor t) const {
    return t == StateTensor::kMasterWeights ? static_cast<void*>(param)
           : t == StateTensor::kExpAvg      ? exp_avg
                                            : exp_avg_sq;
  }
  // What Tensor(t) holds: fp32 for the master, state_dtype for the moments.
  DType TensorDType(StateTensor t) const {
    return t == StateTensor::kMasterWeights ? DType::kFp32 : state_dtype;
  }

 private:
  void* MomentView(const HostBuffer& buffer, int moment) const;
};

// Bytes of fp32 master and moments in `state_dtype` a parameter: 12 or 8.
inline int StateBytesPerElement(DType state_dtype) { return 4 + 2 * DTypeSize(state_dtype); }

struct Job {
  JobConfig config;
  std::vector<std::unique_ptr<RangeState>> ranges;
  Reservation state_reservation;
  std::atomic<bool> dropped{false};

  int64_t state_bytes() const;  // in memory
  int64_t disk_bytes() const;   // in state files
};

struct ShardOptions {
  int64_t memory_limit_bytes = int64_t{16} << 30;
  // Elements per parameter chunk streamed back: a commit runs Adam wave by wave of this size
  // and sends each wave while the next one computes. Rounded to whole tiles.
  int64_t wave_elements = int64_t{2} << 20;
  // With a disk tier: put every job's state on disk (--state_tier=disk), not only those that do
  // not fit the memory limit.
  bool state_on_disk = false;
};

class ShardStore {
 public:
  // `disk`, when given, outlives the store; its wave is the store's wave.
  ShardStore(const ShardOptions& options, ThreadPool* pool, SimdPath path,
             DiskTier* disk = nullptr);

  // Validates the config (its groups included), reserves and allocates the state (zeros,
  // first-touched by the tile owners), in memory or in preallocated state files on the disk tier
  // (StateTier). Returns the bytes held in memory (0 on disk); a refused config allocates
  // nothing, and a refusal for room names both the memory and the disk figures.
  absl::StatusOr<int64_t> CreateJob(const JobConfig& config);
  absl::Status DropJob(const std::string& job_id);
  absl::StatusOr<std::shared_ptr<Job>> FindJob(const std::string& job_id) const;
  // Range `range_index` of job `job_id`, as a step stream or a data plane's attachment names it:
  // NOT_FOUND for an unknown job, INVALID_ARGUMENT naming the job's range count for a bad index.
  // The job stays alive for as long as the returned pointer is held.
  struct JobRange {
    std::shared_ptr<Job> job;
    RangeState* range;
  };
  absl::StatusOr<JobRange> FindJobRange(const std::string& job_id, uint32_t range_index) const;
  std::vector<std::shared_ptr<Job>> Jobs() const;

  // Copies `length` elements of a tensor starting at flat `offset` (inside the job's ranges,
  // possibly spanning adjacent ones) into chunks of at most `chunk_elements`, converted to `dtype`,
  // and hands each to `emit(flat_offset, n, bytes)`; stops early (OK) when emit returns false.
  absl::Status ReadState(const std::string& job_id, StateTensor tensor, DType dtype, int64_t offset,
                         int64_t length, int64_t chunk_elements,
                         const std::function<bool(int64_t, int64_t, const std::string&)>& emit);

  ThreadPool* pool() const { return pool_; }
  SimdPath simd_path() const { return path_; }
  AdamKernelFn adam_kernel() const { return kernel_; }
  MemoryBudget* budget() { return &budget_; }
  DiskTier* disk() const { return disk_; }
  const ShardOptions& options() const { return options_; }

  // Runs fn(begin, end) over the owned tiles of [begin, end) on every pool thread.
  void ParallelTiles(int64_t begin, int64_t end,
                     const std::function<void(int64_t, int64_t)>& fn) const;

 private:
  const ShardOptions options_;
  ThreadPool* const pool_;
  const SimdPath path_;
  const AdamKernelFn kernel_;
  DiskTier* const disk_;
  MemoryBudget budget_;

  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Job>> jobs_;  // guarded by mu_
};

// Validation shared by the store and the service: what a job id may look like.
absl::Status ValidateJobId(const std::string& job_id);

// The group of a config without groups: `adam` from the first range's first element to the last
// range's end ({0, 0} without ranges, which CreateJob refuses anyway).
ParamGroupSpec DefaultParamGroup(const std::vector<RangeSpec>& ranges, const AdamHyperParams& adam);

// Finds the range of `job` that holds all of flat [offset, offset + n); OUT_OF_RANGE otherwise.
absl::StatusOr<RangeState*> FindRangeFor(const Job& job, int64_t offset, int64_t n);

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_SHARD_STORE_H_
