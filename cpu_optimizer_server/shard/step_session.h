// One training step of one range, as one step stream carries it (ARCHITECTURE.md section 4): open,
// gradient chunks, commit. Nothing touches the range's state before the commit, and a commit
// either applies the whole update or none of it, so a stream that breaks off or sends a bad
// chunk leaves the shard exactly as it was.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_STEP_SESSION_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_STEP_SESSION_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cpu_optimizer_server/shard/range_steps.h"
#include "cpu_optimizer_server/shard/shard_store.h"

namespace offload {

// Receives the updated 16-bit parameters wave by wave. Two slots alternate so the next wave can
// be computed into one while the other is being sent.
class ParamSink {
 public:
  virtual ~ParamSink() = default;
  // A buffer for n 16-bit values of flat elements [offset, offset + n), valid until Send(slot).
  virtual void* Buffer(int slot, int64_t offset, int64_t n) = 0;
  // Sends the slot's buffer. False when the receiver is gone; the step still completes.
  virtual bool Send(int slot) = 0;
};

struct StepCommitArgs {
  uint64_t step = 0;
  double lr = 0;  // every group's, unless group_lr is given
  float grad_multiplier = 1;
  bool skip = false;
  // Empty: `lr` for every parameter group of the job. Otherwise one lr per group, in group order
  // (StepCommit.group_lr).
  std::vector<double> group_lr;
  // Per-element skips and bias-correction steps (StepCommit.range_steps), flat offsets, sorted,
  // not overlapping; the parts outside the range are ignored. Empty: every element as usual.
  std::vector<RangeStep> range_steps;
};

struct StepOutcome {
  uint64_t step = 0;
  bool applied = false;
  bool replayed = false;
  bool skipped = false;
  uint64_t adam_step = 0;
  uint64_t skipped_steps = 0;
  bool receiver_gone = false;  // the sink refused a wave (the update was still applied whole)
};

class StepSession {
 public:
  // Validates the job, range and step number and takes the range's step lease. The step must
  // be the range's next one, or its last one (a replay after a lost reply).
  static absl::StatusOr<std::unique_ptr<StepSession>> Open(ShardStore* store,
                                                           const std::string& job_id,
                                                           uint32_t range_index, uint64_t step);
  ~StepSession();  // releases the lease; received gradients are dropped unless committed

  // Takes a chunk of n = data.size() / DTypeSize(dtype) gradients of flat elements from
  // `offset`. `data` is moved in and read in place by the commit (no copy).
  absl::Status AddGradients(int64_t offset, DType dtype, bool accumulate, std::string data);

  // As AddGradients without accumulate, for n gradients the caller keeps at `data` (not owned):
  // they are read in place by the commit, so `data` must stay valid and unchanged until the
  // commit returns or the session ends. The shared-memory data plane passes its gradient area.
  absl::Status AddGradientsView(int64_t offset, DType dtype, const void* data, int64_t n);

  // Applies (or skips, or replays) the step and streams the 16-bit parameters into `sink`.
  // May be called once.
  absl::StatusOr<StepOutcome> Commit(const StepCommitArgs& args, ParamSink* sink);

  DType param_dtype() const { return job_->config.param_dtype; }

 private:
  struct Piece {
    int64_t begin;  // range-relative first element
    int64_t n;
    DType dtype;
    std::string data;            // (n,) in dtype, owned; empty for a view
    const char* view = nullptr;  // (n,) in dtype, not owned (AddGradientsView)
    const char* bytes() const { return view != nullptr ? view : data.data(); }
  };

  StepSession(ShardStore* store, std::shared_ptr<Job> job, RangeState* range, uint64_t step,
              bool replay);
  // The checks shared by AddGradients and AddGradientsView; OK means the chunk may be taken.
  absl::Status ValidateChunk(int64_t offset, int64_t n, bool accumulate) const;
  absl::Status StartAccumulating();
  // Whether any of data (n,) in dtype is inf or NaN.
  bool AnyNonFinite(const char* data, DType dtype, int64_t n) const;
  // A run of range-relative elements ending at `end` (the run before it ends where it begins)
  // and how they update: `scalars` holds one set per parameter group of the job (indexed by
  // group), null for elements a range step leaves alone this commit.
  struct UpdateRun {
    int64_t end;
    const AdamStepScalars* scalars;
  };
  // Checks commit.range_steps against the range; OK means they may be applied.
  absl::Status ValidateRangeSteps(const std::vector<RangeStep>& steps) const;
  // Streams the 16-bit copy of [0, length) in waves; `update` (runs in order, the last ending
  // at length) first applies Adam to each wave, empty for a replay. False when the receiver
  // went away; an error only from a range on disk whose pass failed.
  absl::StatusOr<bool> StreamWaves(const std::vector<UpdateRun>& update, ParamSink* sink);

  ShardStore* const store_;
  const std::shared_ptr<Job> job_;
  RangeState* const range_;
  const uint64_t step_;
  const bool replay_;
  bool committed_ = false;

  std::vector<Piece> pieces_;  // gradients held as received, until accumulation starts
  bool accumulating_ = false;  // gradients live in range_->accumulator (fp32)
  IntervalSet covered_;        // range-relative elements with a gradient
  bool non_finite_ = false;
  int64_t first_non_finite_offset_ = -1;
  Reservation held_bytes_;  // gradient bytes held by this stream
};

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_STEP_SESSION_H_
