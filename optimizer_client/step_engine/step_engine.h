// The optimizer side of one trainer rank's step (ARCHITECTURE.md sections 1 and 16): the one step
// engine both front ends drive, the C++ GPT trainer (gpu_trainer/train/trainer.cc) and the C ABI
// (capi/offload_c.cc), so the rules of a step live in one place.
//
// A step: BeginStep; the rank's 16-bit gradients handed over range by range, from any thread
// (Enqueue, or RoundAndEnqueue for fp32 ones), and sent by the sender thread while backward goes
// on; NextMicroBatch between micro-batches; Drain (every gradient sent, this rank's statistics);
// then Commit, or CommitAsync and WaitCommit (the delayed parameter update), or AbortStep. The
// step is decided at the commit by the step policy (skip, clip, loss scale) from the statistics
// over every rank. Optional within a step: range steps (torch's per-parameter step counts), the
// update during backward (Speculate, UpdateReady) and the gradient sum of a step cut between two
// micro-batches by a checkpoint (ReadGradientSum, RestoreGradientSum).
//
// Micro-batches: the shards add every micro-batch's 16-bit gradients into an fp32 sum, in
// micro-batch order, and the step's norm and overflow are of that sum; the engine mirrors it,
// (partition_length,) fp32 allocated at the first step that has a second micro-batch. The first
// micro-batch's ranges are added once the second begins, from where they were sent; later ones as
// the sender sends them.
//
// Threads: one thread drives the engine, except Enqueue and RoundAndEnqueue (and the buffers they
// name), which autograd's or a reducer's threads may call while a step is open.
#ifndef OFFLOAD_OPTIMIZER_CLIENT_STEP_ENGINE_STEP_ENGINE_H_
#define OFFLOAD_OPTIMIZER_CLIENT_STEP_ENGINE_STEP_ENGINE_H_

#include <atomic>
#include <cstdint>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "base/host_buffer.h"
#include "cpu_optimizer_server/shard/range_steps.h"
#include "optimizer_client/backends/optimizer_backend.h"
#include "optimizer_client/precision/grad_stats.h"
#include "optimizer_client/precision/step_policy.h"
#include "optimizer_client/sender/gradient_sender.h"
#include "optimizer_client/sender/phase_trace.h"

namespace offload {

struct StepEngineOptions {
  DType dtype = DType::kBf16;  // of the gradients sent and the weights returned
  StepPolicyOptions policy;
  PhaseTrace* trace = nullptr;  // not owned; may be null
  // Measure every 16-bit range handed over without its statistics on the sender thread: for
  // front ends that hand over gradients rounded elsewhere (the C ABI's). The C++ trainer measures
  // them in its own rounding pass and hands them over with AddStats.
  bool measure_gradients = false;
};

// What a commit did: the policy's decision and the shards' counters after it.
struct CommitOutcome {
  StepDecision decision;
  StepCounters counters;
};

class StepEngine {
 public:
  // `backend` (not owned) must outlive the engine and hold this rank's partition map.
  static absl::StatusOr<std::unique_ptr<StepEngine>> Create(OptimizerBackend* backend,
                                                            const StepEngineOptions& options);
  // Waits for a delayed commit, then ends an open step with nothing applied.
  ~StepEngine();
  StepEngine(const StepEngine&) = delete;
  StepEngine& operator=(const StepEngine&) = delete;

  OptimizerBackend& backend() const { return *backend_; }
  StepPolicy& policy() { return policy_; }
  const StepPolicy& policy() const { return policy_; }
  DType dtype() const { return options_.dtype; }
  bool in_step() const { return in_step_; }
  uint64_t open_step() const { return open_step_; }
  // The engine's own 16-bit gradient buffer, (padded_length,): mapped, not written, so pages no
  // gradient lands in (those the shared-memory plane takes in place) cost no memory. The padding
  // above the parameters stays zero.
  uint16_t* gradients16() const { return grads16_; }

  // Opens step `step` (1-based) on this rank's slices. Refused while a step is open or a delayed
  // commit is in flight.
  absl::Status BeginStep(uint64_t step);
  // OK when a step is open and [offset, offset + n) is non-empty and inside this rank's partition.
  absl::Status CheckGradientRange(int64_t offset, int64_t n) const;
  // Where the data plane takes the 16-bit gradients of [offset, offset + n) without a copy (the
  // shared-memory segment), or null: none there, or a later micro-batch (the place still holds
  // the first micro-batch's gradients, which a shard may not have folded into its sum yet).
  uint16_t* GradientPlace(int64_t offset, int64_t n);
  // GradientPlace, else the engine's buffer at offset.
  uint16_t* GradientBuffer(int64_t offset, int64_t n);
  // The 16-bit gradients of [offset, offset + n) of this rank's partition, at src (n,), are final:
  // queued for the sender (summed into the mirror after the first micro-batch). src must stay
  // unchanged until the step ends or the next micro-batch begins. `known`: their statistics, where
  // the caller measured them. Any thread, within an open step (checked by CheckGradientRange).
  void Enqueue(int64_t offset, int64_t n, const uint16_t* src, const GradStats* known = nullptr);
  // grads (n,) fp32 * scale rounded into GradientBuffer(offset, n), measured in the same pass,
  // then queued as Enqueue.
  void RoundAndEnqueue(int64_t offset, const float* grads, int64_t n, float scale);
  // Statistics of gradients handed over without any, measured by the caller (the trainer's
  // rounding pass); ignored after the first micro-batch, where the sum's statistics count.
  void AddStats(const GradStats& stats);
  // Ends the current micro-batch (waits until its gradients are sent) and starts the next, whose
  // gradients are added to the earlier ones. A failed send ends the step and is returned.
  absl::Status NextMicroBatch();
  // Waits until every gradient handed over is sent; returns this rank's statistics of the step
  // (of the sum after a second micro-batch). A failed send ends the step (nothing applied) and is
  // returned.
  absl::StatusOr<GradStats> Drain();

  // The fp32 sum of the open step's micro-batches so far for [offset, offset + n) of this rank's
  // partition into out (n,), zeros where nothing was sent; waits for the sends first.
  absl::Status ReadGradientSum(int64_t offset, int64_t n, float* out);
  // Into a step just opened (nothing handed over yet): this rank's partition's such sum, sums
  // (partition_length,), sent to the shards as fp32 so the step goes on in accumulation with
  // every bit of the run that saved it.
  absl::Status RestoreGradientSum(const float* sums);

  // The open step's range steps (StepCommit.range_steps: global offsets, sorted, not
  // overlapping, non-empty, inside the padded flat space, t at most the open step), replacing
  // earlier ones; else INVALID_ARGUMENT and nothing kept.
  absl::Status SetRangeSteps(std::vector<RangeStep> steps);
  // The update during backward: the open step speculates that its commit carries these group
  // lrs, these range steps (as SetRangeSteps's) and nothing clipped or skipped. From then on
  // UpdateReady queues early updates. First micro-batch only; ends with it or the step.
  absl::Status Speculate(std::vector<double> group_lr, std::vector<RangeStep> steps);
  // Every gradient of flat [offset, offset + n) (inside the padded flat space) in this rank's
  // partition was handed over in this micro-batch: its early update is queued behind them, cut
  // where the speculative range steps begin and end (a range a step skips is not updated). A
  // no-op when the step does not speculate.
  absl::Status UpdateReady(int64_t offset, int64_t n);

  // What the commit would decide: every gradient sent (as Drain), then the policy on `global`
  // (the statistics over every rank; none: this rank's own), max_grad_norm >= 0 overriding the
  // policy's clip. Changes nothing; the step stays open.
  absl::StatusOr<StepDecision> Preview(std::optional<GradStats> global, float max_grad_norm = -1);
  // Decides the step as Preview, closes it, and commits it on this rank's slices with `lr` (and
  // one lr per parameter group, or none for `lr` everywhere) and the step's range steps; the
  // updated 16-bit weights of this rank's partition land in partition16 (partition_length,),
  // unless skipped. The loss scale moves on success.
  absl::StatusOr<CommitOutcome> Commit(std::optional<GradStats> global, float max_grad_norm,
                                       double lr, absl::Span<const double> group_lr,
                                       uint16_t* partition16);
  // The delayed parameter update: decides and closes the step now (the loss scale moves now, as
  // the next step's backward runs before this commit is done) and commits it on a thread of its
  // own, writing partition16, which must stay valid and unread until WaitCommit. Until then
  // nothing else may reach the shards (BeginStep refuses).
  absl::StatusOr<StepDecision> CommitAsync(std::optional<GradStats> global, float max_grad_norm,
                                           double lr, std::vector<double> group_lr,
                                           uint16_t* partition16);
  bool commit_in_flight() const { return pending_commit_.valid(); }
  // FAILED_PRECONDITION while a delayed commit is in flight, naming what to call first.
  absl::Status NoCommitInFlight() const;
  // Waits for the delayed commit; its error if it failed (then the shards applied nothing).
  absl::StatusOr<CommitOutcome> WaitCommit();
  // Ends an open step with nothing applied (a no-op outside a step).
  void AbortStep();

 private:
  StepEngine(OptimizerBackend* backend, const StepEngineOptions& options);
  // Back to one micro-batch, no speculation, for the next step.
  void EndMicroBatches();
  // Drains the sender and gathers the step's statistics; a failed send aborts the step.
  absl::Status TakeStats();
  // The mirror of the shards' sum, (partition_length,), allocated at its first use.
  absl::Status EnsureAccumulator();
  float* accumulator() const { return static_cast<float*>(acc_buffer_.data()); }
  // out (n,) = the first micro-batch's gradients of [offset, offset + n) added in fp32 onto
  // zeros, as the shards fold them.
  void FirstMicroBatchSum(int64_t offset, int64_t n, float* out);
  absl::Status CheckRangeSteps(absl::Span<const RangeStep> steps) const;
  // The decision of a commit, and the step closed: its range steps handed to *range_steps.
  absl::StatusOr<StepDecision> Close(std::optional<GradStats> global, float max_grad_norm,
                                     std::vector<RangeStep>* range_steps);

  OptimizerBackend* const backend_;
  const StepEngineOptions options_;
  StepPolicy policy_;
  HostBuffer grads16_buffer_;
  uint16_t* grads16_ = nullptr;             // (padded_length,) in grads16_buffer_
  std::unique_ptr<GradientSender> sender_;  // after grads16_: it reads there

  bool in_step_ = false;
  uint64_t open_step_ = 0;
  GradStats step_stats_;  // measured so far this step
  int micro_batch_ = 0;
  struct SentRange {
    int64_t offset, n;
    const uint16_t* src;
  };
  std::mutex first_mu_;                       // autograd's threads record sends
  std::vector<SentRange> first_micro_batch_;  // guarded by first_mu_
  HostBuffer acc_buffer_;
  // The mirror's statistics, measured once after the last range added to it (a step may ask
  // twice: Drain, then the commit).
  GradStats acc_stats_;
  std::atomic<bool> acc_stats_stale_{true};
  std::vector<RangeStep> range_steps_;
  bool speculating_ = false;
  std::vector<RangeStep> speculative_steps_;
  std::future<absl::StatusOr<CommitOutcome>> pending_commit_;
};

}  // namespace offload

#endif  // OFFLOAD_OPTIMIZER_CLIENT_STEP_ENGINE_STEP_ENGINE_H_
