// One training step of one range, as one step stream carries it (ARCHITECTURE.md section 4): open,
// gradient chunks, commit. A commit either applies the whole update or none of it, and a stream
// that breaks off or sends a bad chunk leaves the shard exactly as it was. Before the commit
// nothing changes the range's state: an update during backward (UpdateEarly) writes into the
// range's staging copy, which the commit swaps in where it keeps the update.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_STEP_SESSION_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_STEP_SESSION_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "cpu_optimizer_server/disk/state_pass.h"
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
  // Updates during backward (StepSession::UpdateEarly): elements whose early update stood at
  // the commit, and elements restored at the commit or when a second micro-batch began.
  uint64_t early_updated = 0;
  uint64_t early_rolled_back = 0;
};

class StepSession {
 public:
  // Validates the job, range and step number and takes the range's step lease. The step must
  // be the range's next one, or its last one (a replay after a lost reply).
  static absl::StatusOr<std::unique_ptr<StepSession>> Open(ShardStore* store,
                                                           const std::string& job_id,
                                                           uint32_t range_index, uint64_t step);
  // Releases the lease; received gradients and updates during backward are dropped unless
  // committed.
  ~StepSession();

  // Takes a chunk of n = data.size() / DTypeSize(dtype) gradients of flat elements from
  // `offset`. `data` is moved in and read in place by the commit (no copy).
  absl::Status AddGradients(int64_t offset, DType dtype, bool accumulate, std::string data);

  // As AddGradients without accumulate, for n gradients the caller keeps at `data` (not owned):
  // they are read in place by the commit, so `data` must stay valid and unchanged until the
  // commit returns or the session ends. The shared-memory data plane passes its gradient area.
  absl::Status AddGradientsView(int64_t offset, DType dtype, const void* data, int64_t n);

  // The update during backward (ARCHITECTURE.md sections 4.3 and 16): Adam now on range elements
  // of flat [offset, offset + n), with args' lr / group_lr / grad_multiplier / range_steps
  // (args.skip must be false; args.step must be the session's), as the commit would run it if
  // it repeats those arguments. Every element must have its gradient, and none may have been
  // updated early in this session. It reads the range's state and writes the result into the
  // range's staging copy (12 bytes an element of the range, from the store's budget, allocated
  // on the first such update and kept), leaving the state as it was: the commit keeps the update
  // where it agrees (the same lrs, multiplier and t, not skipped), updates every other element
  // into the staging copy too and swaps it in; elsewhere, and when a second micro-batch starts or
  // the session ends without a commit, the staged update is dropped. So the result is the same
  // bits with or without it, and a read of the range's state (ShardStore::ReadState) before the
  // commit sees the state before the step.
  // true: applied; false: declined, nothing changed (a replay, an accumulating step, a range on
  // disk or whose state is lost, an inf or NaN received, arguments other than this session's
  // earlier early updates', no memory for the staging copy): the commit updates those elements
  // as usual.
  // An error is a malformed request, to be failed as a bad chunk is; nothing changed either.
  absl::StatusOr<bool> UpdateEarly(const StepCommitArgs& args, int64_t offset, int64_t n);

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
  // group), null for elements a range step leaves alone this commit and for `staged` ones, whose
  // update an early update already wrote into the staging copy.
  struct UpdateRun {
    int64_t end;
    const AdamStepScalars* scalars;
    bool staged;
    uint64_t t;
  };
  // A run of range-relative elements ending at `end` and the bias-correction step they update
  // with: 0 for elements a range step leaves alone, kStaged for those an early update stands for.
  struct StepRun {
    int64_t end;
    uint64_t t;
  };
  static constexpr uint64_t kStaged = ~uint64_t{0};
  // The scalars of UpdateRuns: one set per parameter group for each t, for one set of lrs and
  // multiplier. A node of the map never moves, so runs may point into it while it lives.
  class ScalarSets {
   public:
    ScalarSets(const std::vector<ParamGroupSpec>* groups, std::vector<double> group_lr,
               float grad_multiplier)
        : groups_(groups), group_lr_(std::move(group_lr)), grad_multiplier_(grad_multiplier) {}
    const AdamStepScalars* For(uint64_t t);

   private:
    const std::vector<ParamGroupSpec>* const groups_;
    const std::vector<double> group_lr_;
    const float grad_multiplier_;
    std::map<uint64_t, std::vector<AdamStepScalars>> by_t_;
  };
  // An update during backward: range-relative elements [begin, begin + n) and the t each run of
  // them was updated with. Their updated state is at the same positions of the range's staging
  // copy (RangeState::staging_storage) until the commit swaps it in or drops it.
  struct EarlyUpdate {
    int64_t begin;
    int64_t n;
    std::vector<StepRun> steps;  // in order, the last ending at begin + n
  };

  // The checks of a commit's or an update's lr, group_lr, grad_multiplier and range_steps, its
  // messages naming them `what`.lr and so on; OK means they may be applied.
  absl::Status ValidateArgs(const StepCommitArgs& args, const char* what) const;
  // Checks range_steps against the range; OK means they may be applied.
  absl::Status ValidateRangeSteps(const std::vector<RangeStep>& steps, const char* what) const;
  // args' lr of every parameter group of the job.
  std::vector<double> GroupLrs(const StepCommitArgs& args) const;
  // Appends the run ending at `end` with step t, merged into the last run if it has that t.
  static void AppendRun(std::vector<StepRun>* runs, int64_t end, uint64_t t);
  // The range [0, length) cut where `range_steps` (validated) begin and end, each run with its
  // t: `range_t` (the range's next) where no range step says otherwise.
  std::vector<StepRun> ResolveSteps(const std::vector<RangeStep>& range_steps,
                                    uint64_t range_t) const;
  // The runs of `steps` with their scalars from `scalars`; a run with t == 0 only converts.
  static std::vector<UpdateRun> ToUpdateRuns(const std::vector<StepRun>& steps,
                                             ScalarSets* scalars);
  // Whether `steps` (over the whole range) give every element of `early` the t it had.
  static bool SameSteps(const EarlyUpdate& early, const std::vector<StepRun>& steps);
  // `steps` (over [0, length)) with the elements of `keep` (sorted, disjoint, range-relative
  // [first, second)) given t kStaged: only converted from the staging copy, not updated again.
  static std::vector<StepRun> ConvertOnly(const std::vector<StepRun>& steps,
                                          const std::vector<IntervalSet::Interval>& keep);
  // Applies `update` (as StreamWaves takes it; empty: none) to range elements [base, hi), whose
  // state is in `state`, and writes their 16-bit copy to out (indexed from base; null: none).
  // With `staged` (the staging copy's views, over the whole range), the new state goes there and
  // `state` is only read: elements a range step
  // leaves alone are copied there, and `staged` runs only converted from there. The gradients
  // come from pieces_ (sorted, covering [base, hi)) or the accumulator.
  void Process(const std::vector<UpdateRun>& update, int64_t base, int64_t hi, uint16_t* out,
               const StateWave& state, const StateWave* staged = nullptr) const;
  // Streams the 16-bit copy of [0, length) in waves; `update` (runs in order, the last ending
  // at length) first applies Adam to each wave, empty for a replay; with `staged`, into the
  // staging copy (see Process). False when the receiver went away; an error only from a range on
  // disk whose pass failed.
  absl::StatusOr<bool> StreamWaves(const std::vector<UpdateRun>& update, ParamSink* sink,
                                   const StateWave* staged = nullptr);
  // Drops every early update, counting its elements in rolled_back_: the range's state is still
  // the state before them.
  void DropEarly();

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

  // Updates during backward not yet decided by the commit, in the order they came.
  std::vector<EarlyUpdate> early_;
  IntervalSet early_covered_;  // their elements, range-relative
  // The lr of every group and the multiplier all of them used (every early update of a session
  // uses one set); set by the first.
  std::vector<double> early_lr_;
  float early_multiplier_ = 0;
  uint64_t rolled_back_ = 0;  // elements of early updates dropped (not kept by the commit)
  // The SIMD path's fp32 to 16-bit conversion, null for the scalar path (dtype.h's).
  void (*const to_half_)(const float* in, DType dtype, uint16_t* half, int64_t n);
};

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_STEP_SESSION_H_
