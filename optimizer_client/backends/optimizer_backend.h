// The trainer's side of the optimizer: where 16-bit gradients go and updated 16-bit weights come
// from. Two implementations share the partition routing below:
//   - RemoteOptimizer (remote_optimizer.h): optimizer shards behind the gRPC API;
//   - InProcessOptimizer (inprocess_optimizer.h): the same shard store, step sessions and Adam
//     kernels linked into the trainer, without a server. It is the baseline of the
//     offload-overhead benchmark and, because it runs the very same code, the reference that
//     the server path must match bit for bit.
#ifndef OFFLOAD_OPTIMIZER_CLIENT_BACKENDS_OPTIMIZER_BACKEND_H_
#define OFFLOAD_OPTIMIZER_CLIENT_BACKENDS_OPTIMIZER_BACKEND_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "cpu_optimizer_server/grpc/shard_client.h"
#include "cpu_optimizer_server/shard/range_steps.h"
#include "offload/v1/checkpoint.pb.h"
#include "offload/v1/optimizer.pb.h"

namespace offload {

// One shard's part of a load streamed chunk by chunk (state_load.h): the shard applies every chunk
// when Finish succeeds, and none if the load is destroyed unfinished or a chunk is refused.
class ShardStateLoad {
 public:
  virtual ~ShardStateLoad() = default;
  // fp32 values of flat elements [slice.offset, + slice.n), all in this shard's slices.
  virtual absl::Status Add(const StateSliceRef& slice) = 0;
  virtual absl::Status Finish() = 0;
};

class OptimizerBackend {
 public:
  explicit OptimizerBackend(v1::PartitionMap map) : map_(std::move(map)) {}
  virtual ~OptimizerBackend() = default;

  const v1::PartitionMap& partition() const { return map_; }
  int num_shards() const { return static_cast<int>(map_.num_shards()); }

  // The trainer rank this backend steps for (0 by default): BeginStep, SendGradients and Commit
  // cover only the slices of its partition [rank * P, (rank + 1) * P). The job's set-up, loads,
  // reads and drop (rank 0's work) still reach every shard.
  absl::Status SetRank(int rank);
  int rank() const { return rank_; }
  // [offset, offset + length) of this rank's partition.
  int64_t partition_offset() const;
  int64_t partition_length() const;
  // For ranks other than the one that creates the job: step the job `job_id` another rank
  // created, whose 16-bit type is param_dtype.
  void UseJob(const std::string& job_id, DType param_dtype) {
    job_id_ = job_id;
    param_dtype_ = param_dtype;
  }

  // The Adam moments' storage CreateJob asks every shard for (CreateJobRequest.state_dtype and
  // state_rounding): FP32 unless set.
  void SetStateStorage(v1::DType dtype, v1::StateRounding rounding) {
    state_dtype_ = dtype;
    state_rounding_ = rounding;
  }
  v1::DType state_dtype() const { return state_dtype_; }

  // Creates the job on every shard with the slices the map gives it. A job of the same id left
  // on a shard by an earlier run of this trainer is replaced. groups: PyTorch's param_groups
  // over the flat space (CreateJobRequest.groups: in offset order, covering [0, padded_length),
  // at most kMaxParamGroups), every shard gets them all; empty for one group, `adam`.
  // Overrides repeat the default, so a call reads the same through any type.
  virtual absl::Status CreateJob(const std::string& job_id, const v1::AdamConfig& adam,
                                 DType param_dtype,
                                 const std::vector<v1::ParamGroup>& groups = {}) = 0;
  // Opens a load on `shard` that takes chunks until Finish; with `steps`, its step counters too
  // (checkpoints).
  virtual absl::StatusOr<std::unique_ptr<ShardStateLoad>> BeginShardLoad(
      int shard, const StepCounters* steps) = 0;
  // One all-or-nothing load of whole slices on `shard` (BeginShardLoad, each slice, Finish).
  absl::Status LoadShardState(int shard, const std::vector<StateSliceRef>& slices,
                              const StepCounters* steps);
  // (n,) fp32 values of flat elements [offset, offset + n), which must lie in one slice.
  virtual absl::Status ReadSliceState(int slice, v1::StateTensor tensor, int64_t offset, int64_t n,
                                      float* out) = 0;
  virtual absl::Status DropJob() = 0;

  // (n,) fp32 values of `tensor` for any flat elements [offset, offset + n) inside
  // [0, padded_length), read slice by slice.
  absl::Status ReadRange(v1::StateTensor tensor, int64_t offset, int64_t n, float* out);

  // The whole map's fp32 master weights, master (padded_length,), loaded onto every shard or read
  // back from every slice: a fresh start, a resume mid-pipeline and tests, all rank 0's work.
  absl::Status LoadMasterWeights(const float* master);
  absl::Status ReadMasterWeights(float* master);

  // One step: Begin, any number of SendGradients covering this rank's partition at least once
  // (from one thread, in any order; a second cover of an element must be `accumulate`), then
  // Commit or Abort.
  absl::Status BeginStep(uint64_t step);
  // grads (n,) 16-bit for flat elements [offset, offset + n) of this rank's partition, split over
  // the slices they touch. accumulate: added to what the step received before (micro-batches,
  // summed in fp32 on the shard).
  absl::Status SendGradients(int64_t offset, const uint16_t* grads, int64_t n,
                             bool accumulate = false);
  // grads (n,) fp32 for flat elements [offset, offset + n) of this rank's partition, added to
  // what the step received before (an accumulate chunk in fp32): a partial micro-batch sum
  // restored from a checkpoint, which must keep every bit.
  absl::Status SendGradients32(int64_t offset, const float* grads, int64_t n);
  // Applies the step (or skips it) on this rank's slices; their updated 16-bit weights land in
  // partition16 (partition_length,), this rank's partition, unless skipped (flat element i at
  // partition16[i - partition_offset()]). Returns the step counters after the step. group_lr:
  // empty for `lr` in every parameter group, else one lr per group of CreateJob's groups.
  // range_steps: torch's per-parameter skip and step count (StepCommit.range_steps) over global
  // flat offsets inside [0, padded_length), sorted by offset, not overlapping, not empty; t == 0
  // leaves those elements as they are (their weights still land in partition16), t > 0 updates
  // them with bias correction t. Parts outside this rank's partition are ignored, so every rank
  // may pass the whole model's list; each slice gets its part. A list that breaks those rules
  // (or has a t above `step`) is INVALID_ARGUMENT and ends the step unapplied on every shard,
  // as a refused commit does. A t above the shards' adam_step + 1 (after skipped steps) is
  // refused by the shards holding that run, and only there, as a shard's refusal of its
  // gradients is: committing the step again replays it where it was applied.
  absl::StatusOr<StepCounters> Commit(double lr, float grad_multiplier, bool skip,
                                      uint16_t* partition16, absl::Span<const double> group_lr = {},
                                      absl::Span<const RangeStep> range_steps = {});
  void AbortStep();

  // The update during backward (ARCHITECTURE.md sections 4.3 and 16): asks the shards to run Adam
  // now on flat elements [offset, offset + n) of this rank's partition, whose gradients were all
  // sent in this step, with the arguments the commit is expected to carry (lr, group_lr and
  // grad_multiplier as Commit's; t the bias-correction step of all of them, 0 for the range's
  // next, else at most the open step). Split over the slices it touches. The commit keeps what
  // it agrees with and redoes the rest exactly, so the bits never depend on it; a shard or plane
  // that cannot do it declines silently (OK). FAILED_PRECONDITION outside a step, OUT_OF_RANGE
  // outside the partition, INVALID_ARGUMENT for a t past the step; a shard's refusal (missing
  // gradients, a part updated early before) fails the step as a refused chunk does, here or, on
  // an asynchronous plane, at a later call or the commit. Counted in Commit's StepCounters.
  absl::Status UpdateEarly(int64_t offset, int64_t n, uint64_t t, double lr, float grad_multiplier,
                           absl::Span<const double> group_lr = {});

  // Zero-copy sending (the shared-memory and gRPC planes): where this rank's 16-bit gradients of
  // flat elements [offset, offset + n) go so that SendGradients from exactly there copies nothing
  // (the plane's gradient area: the segment, gRPC's send buffers), or null where they do not all
  // lie in one slice whose plane has such a place. Only between BeginStep and Commit, for elements
  // not yet sent; nothing may be written there once Commit is called. The shard validates what it
  // finds there as any chunk.
  uint16_t* GradientPlace(int64_t offset, int64_t n);
  // Which memory that place is in (StepStream::GradientAreaId): another value for the same address
  // means other memory. 0 where GradientPlace is null.
  uint64_t GradientPlaceId(int64_t offset, int64_t n);
  // Elements sent from their place (no copy) since construction.
  int64_t in_place_elements() const { return in_place_elements_.load(); }

 protected:
  // Per-slice hooks of one step, slice = index into map.slices(); only this rank's slices are
  // opened.
  virtual absl::Status OpenSlice(int slice, uint64_t step) = 0;
  virtual absl::Status SendSlice(int slice, int64_t offset, const uint16_t* grads, int64_t n,
                                 bool accumulate) = 0;
  // An fp32 accumulate chunk (SendGradients32); UNIMPLEMENTED where a backend has none.
  virtual absl::Status SendSlice32(int /*slice*/, int64_t /*offset*/, const float* /*grads*/,
                                   int64_t /*n*/) {
    return absl::UnimplementedError("this optimizer backend sends no fp32 gradients");
  }
  // Commits every open slice, writing partition16 (partition_length,) at each slice's offset
  // less partition_offset(); group_lr as Commit's; range_steps as Commit's, checked, global
  // offsets: each slice's commit carries ClipRangeSteps(range_steps, its [offset, end)).
  virtual absl::StatusOr<StepCounters> CommitSlices(double lr, float grad_multiplier, bool skip,
                                                    uint16_t* partition16,
                                                    absl::Span<const double> group_lr,
                                                    absl::Span<const RangeStep> range_steps) = 0;
  virtual void AbortSlices() = 0;
  // The update during backward of flat [offset, offset + n) inside one open slice, as
  // UpdateEarly's. OK for a decline; the default declines everything.
  virtual absl::Status UpdateSlice(int /*slice*/, int64_t /*offset*/, int64_t /*n*/, uint64_t /*t*/,
                                   double /*lr*/, float /*grad_multiplier*/,
                                   absl::Span<const double> /*group_lr*/) {
    return absl::OkStatus();
  }
  // The gradient area of an open slice, (slice length,) 16-bit, or null (the default: no plane
  // of this backend has one).
  virtual uint16_t* SliceGradientArea(int /*slice*/) { return nullptr; }
  virtual uint64_t SliceGradientAreaId(int /*slice*/) { return 0; }
  DType grad_dtype() const { return param_dtype_; }

  // ShardCreateJobRequest with this backend's state storage.
  v1::CreateJobRequest ShardRequest(int shard, const std::string& job_id,
                                    const v1::AdamConfig& adam, DType param_dtype,
                                    const std::vector<v1::ParamGroup>& groups) const;

  v1::PartitionMap map_;
  DType param_dtype_ = DType::kFp16;
  std::string job_id_;
  v1::DType state_dtype_ = v1::DTYPE_FP32;
  v1::StateRounding state_rounding_ = v1::STATE_ROUNDING_STOCHASTIC;

 private:
  using SliceIterator = google::protobuf::RepeatedPtrField<v1::ShardSlice>::const_iterator;
  // The first slice of the map that ends after flat element `offset`.
  SliceIterator FirstSliceEndingAfter(int64_t offset) const;
  // Checks that a step is open and [offset, offset + n) lies in this rank's partition (errors
  // naming `what`), then calls fn for each slice's piece [lo, hi) of it, in order.
  absl::Status ForEachSlicePiece(
      int64_t offset, int64_t n, const char* what,
      const std::function<absl::Status(int slice, int64_t lo, int64_t hi)>& fn);
  // The slice that holds all of [offset, offset + n) of this rank's partition in an open step,
  // or -1.
  int PlaceSlice(int64_t offset, int64_t n) const;

  int rank_ = 0;
  bool in_step_ = false;
  uint64_t step_ = 0;
  std::atomic<int64_t> in_place_elements_{0};
};

// The CreateJobRequest of one shard: its slices as ranges, in range_index order, and every group.
v1::CreateJobRequest ShardCreateJobRequest(const v1::PartitionMap& map, int shard,
                                           const std::string& job_id, const v1::AdamConfig& adam,
                                           DType param_dtype,
                                           const std::vector<v1::ParamGroup>& groups = {});

}  // namespace offload

#endif  // OFFLOAD_OPTIMIZER_CLIENT_BACKENDS_OPTIMIZER_BACKEND_H_
