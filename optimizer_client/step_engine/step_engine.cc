#include "optimizer_client/step_engine/step_engine.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace offload {

absl::StatusOr<std::unique_ptr<StepEngine>> StepEngine::Create(OptimizerBackend* backend,
                                                               const StepEngineOptions& options) {
  if (backend == nullptr) return absl::InvalidArgumentError("no optimizer backend");
  if (options.dtype != DType::kFp16 && options.dtype != DType::kBf16) {
    return absl::InvalidArgumentError("the gradients must be fp16 or bf16");
  }
  std::unique_ptr<StepEngine> engine(new StepEngine(backend, options));
  const int64_t padded = static_cast<int64_t>(backend->partition().padded_length());
  OFFLOAD_ASSIGN_OR_RETURN(engine->grads16_buffer_,
                           HostBuffer::Allocate(padded * static_cast<int64_t>(sizeof(uint16_t))));
  engine->grads16_ = static_cast<uint16_t*>(engine->grads16_buffer_.data());
  engine->sender_ = std::make_unique<GradientSender>(backend, engine->grads16_, options.dtype,
                                                     options.measure_gradients, options.trace);
  return engine;
}

StepEngine::StepEngine(OptimizerBackend* backend, const StepEngineOptions& options)
    : backend_(backend), options_(options), policy_(options.policy) {}

StepEngine::~StepEngine() {
  if (pending_commit_.valid()) pending_commit_.wait();
  AbortStep();
}

absl::Status StepEngine::NoCommitInFlight() const {
  if (!pending_commit_.valid()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "a delayed commit is in flight (offload_commit_async): offload_wait_commit first");
}

absl::Status StepEngine::BeginStep(uint64_t step) {
  if (in_step_) return absl::FailedPreconditionError("a step is already open");
  if (step == 0) return absl::InvalidArgumentError("steps count from 1");
  OFFLOAD_RETURN_IF_ERROR(NoCommitInFlight());
  OFFLOAD_RETURN_IF_ERROR(backend_->BeginStep(step));
  sender_->set_step(step);
  EndMicroBatches();
  range_steps_.clear();
  open_step_ = step;
  in_step_ = true;
  step_stats_ = GradStats{};
  return absl::OkStatus();
}

absl::Status StepEngine::CheckGradientRange(int64_t offset, int64_t n) const {
  if (!in_step_) return absl::FailedPreconditionError("no step is open");
  const int64_t lo = backend_->partition_offset();
  const int64_t hi = lo + backend_->partition_length();
  if (n > 0 && offset >= lo && offset <= hi && n <= hi - offset) return absl::OkStatus();
  return absl::OutOfRangeError(absl::StrCat("gradients [", offset, ", ", offset + n,
                                            ") are not inside this rank's partition"));
}

uint16_t* StepEngine::GradientPlace(int64_t offset, int64_t n) {
  if (micro_batch_ > 0) return nullptr;
  return backend_->GradientPlace(offset, n);
}

uint16_t* StepEngine::GradientBuffer(int64_t offset, int64_t n) {
  uint16_t* place = GradientPlace(offset, n);
  return place != nullptr ? place : grads16_ + offset;
}

void StepEngine::Enqueue(int64_t offset, int64_t n, const uint16_t* src, const GradStats* known) {
  const bool accumulate = micro_batch_ > 0;
  if (accumulate) {
    acc_stats_stale_ = true;
  } else {
    std::lock_guard<std::mutex> lock(first_mu_);
    first_micro_batch_.push_back({offset, n, src});
  }
  // After the first micro-batch the sender adds the range into the mirror and measures nothing.
  sender_->Enqueue(offset, n, accumulate, src, accumulate ? nullptr : known);
}

void StepEngine::RoundAndEnqueue(int64_t offset, const float* grads, int64_t n, float scale) {
  uint16_t* buffer = GradientBuffer(offset, n);
  // The rounding pass measures what it writes: the sender need not read it again.
  const GradStats stats = RoundGradients(grads, n, options_.dtype, buffer, scale);
  Enqueue(offset, n, buffer, &stats);
}

void StepEngine::AddStats(const GradStats& stats) { step_stats_.Merge(stats); }

absl::Status StepEngine::TakeStats() {
  absl::Status sent = sender_->Drain();
  if (!sent.ok()) {
    AbortStep();
    return sent;
  }
  step_stats_.Merge(sender_->TakeStats());
  if (micro_batch_ > 0) {
    // The step is decided on the sum, as the shards will apply it.
    if (acc_stats_stale_.exchange(false)) {
      acc_stats_ = MeasureGradients32(accumulator(), backend_->partition_length());
    }
    step_stats_ = acc_stats_;
  }
  return absl::OkStatus();
}

absl::StatusOr<GradStats> StepEngine::Drain() {
  if (!in_step_) return absl::FailedPreconditionError("no step is open");
  OFFLOAD_RETURN_IF_ERROR(TakeStats());
  return step_stats_;
}

void StepEngine::EndMicroBatches() {
  if (micro_batch_ > 0) sender_->AccumulateInto(nullptr, 0);
  micro_batch_ = 0;
  speculating_ = false;
  speculative_steps_.clear();
  std::lock_guard<std::mutex> lock(first_mu_);
  first_micro_batch_.clear();
}

void StepEngine::AbortStep() {
  if (!in_step_) return;
  sender_->Drain().IgnoreError();
  sender_->TakeStats();
  backend_->AbortStep();
  EndMicroBatches();
  range_steps_.clear();
  in_step_ = false;
  step_stats_ = GradStats{};
}

absl::Status StepEngine::EnsureAccumulator() {
  if (acc_buffer_.data() != nullptr) return absl::OkStatus();
  OFFLOAD_ASSIGN_OR_RETURN(acc_buffer_,
                           HostBuffer::Allocate(backend_->partition_length() * sizeof(float)));
  return absl::OkStatus();
}

void StepEngine::FirstMicroBatchSum(int64_t offset, int64_t n, float* out) {
  // Element by element, so the tiles may run on every core: the same bits.
  constexpr int64_t kTile = int64_t{1} << 16;
#pragma omp parallel for schedule(static)
  for (int64_t lo = 0; lo < n; lo += kTile) {
    std::fill(out + lo, out + std::min(n, lo + kTile), 0.0f);
  }
  std::lock_guard<std::mutex> lock(first_mu_);
  for (const SentRange& r : first_micro_batch_) {
    const int64_t lo = std::max(offset, r.offset);
    const int64_t hi = std::min(offset + n, r.offset + r.n);
#pragma omp parallel for schedule(static)
    for (int64_t at = lo; at < hi; at += kTile) {
      const int64_t m = std::min(kTile, hi - at);
      AddAsFloat(r.src + (at - r.offset), options_.dtype, m, out + (at - offset));
    }
  }
}

absl::Status StepEngine::NextMicroBatch() {
  if (!in_step_) return absl::FailedPreconditionError("no step is open");
  if (absl::Status sent = sender_->Drain(); !sent.ok()) {
    AbortStep();
    return sent;
  }
  sender_->TakeStats();  // the sum's statistics replace the first micro-batch's
  if (micro_batch_ == 0) {
    if (absl::Status s = EnsureAccumulator(); !s.ok()) {
      AbortStep();
      return s;
    }
    const int64_t lo = backend_->partition_offset();
    FirstMicroBatchSum(lo, backend_->partition_length(), accumulator());
    std::lock_guard<std::mutex> lock(first_mu_);
    first_micro_batch_.clear();
    acc_stats_stale_ = true;
    sender_->AccumulateInto(accumulator(), lo);
  }
  ++micro_batch_;
  // The shards drop what they updated early once the second micro-batch's gradients come.
  speculating_ = false;
  return absl::OkStatus();
}

absl::Status StepEngine::ReadGradientSum(int64_t offset, int64_t n, float* out) {
  OFFLOAD_RETURN_IF_ERROR(CheckGradientRange(offset, n));
  if (out == nullptr) return absl::InvalidArgumentError("null out");
  // Everything handed over is sent (and, after the first micro-batch, in the mirror) first.
  if (absl::Status sent = sender_->Drain(); !sent.ok()) {
    AbortStep();
    return sent;
  }
  step_stats_.Merge(sender_->TakeStats());
  if (micro_batch_ == 0) {
    FirstMicroBatchSum(offset, n, out);
  } else {
    const float* acc = accumulator() + (offset - backend_->partition_offset());
    std::copy(acc, acc + n, out);
  }
  return absl::OkStatus();
}

absl::Status StepEngine::RestoreGradientSum(const float* sums) {
  if (!in_step_) return absl::FailedPreconditionError("no step is open");
  if (sums == nullptr) return absl::InvalidArgumentError("null sums");
  {
    std::lock_guard<std::mutex> lock(first_mu_);
    if (micro_batch_ > 0 || !first_micro_batch_.empty()) {
      return absl::FailedPreconditionError(
          "gradients were handed over in this step already: restore a sum into a step just "
          "opened");
    }
  }
  OFFLOAD_RETURN_IF_ERROR(EnsureAccumulator());
  const int64_t lo = backend_->partition_offset();
  const int64_t n = backend_->partition_length();
  float* acc = accumulator();  // (partition_length,)
  std::copy(sums, sums + n, acc);
  // To the shards as fp32 accumulate chunks, so their sum keeps every bit; in pieces of 4 MiB.
  constexpr int64_t kPiece = int64_t{1} << 20;
  for (int64_t done = 0; done < n; done += kPiece) {
    const int64_t m = std::min(kPiece, n - done);
    if (absl::Status s = backend_->SendGradients32(lo + done, acc + done, m); !s.ok()) {
      AbortStep();
      return s;
    }
  }
  micro_batch_ = 1;
  speculating_ = false;
  acc_stats_stale_ = true;
  sender_->AccumulateInto(acc, lo);
  return absl::OkStatus();
}

absl::Status StepEngine::CheckRangeSteps(absl::Span<const RangeStep> steps) const {
  if (!in_step_) return absl::FailedPreconditionError("no step is open");
  const int64_t padded = static_cast<int64_t>(backend_->partition().padded_length());
  int64_t next = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    const RangeStep& r = steps[i];
    if (r.length <= 0 || r.offset < next || r.offset > padded || r.length > padded - r.offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("range step ", i, " is [", r.offset, ", ", r.offset + r.length,
                       "); ranges must be non-empty, sorted, not overlapping and inside the ",
                       padded, " elements of the flat space"));
    }
    if (r.t > open_step_) {
      return absl::InvalidArgumentError(
          absl::StrCat("range step ", i, ": t ", r.t, " is past the open step ", open_step_));
    }
    next = r.offset + r.length;
  }
  return absl::OkStatus();
}

absl::Status StepEngine::SetRangeSteps(std::vector<RangeStep> steps) {
  OFFLOAD_RETURN_IF_ERROR(CheckRangeSteps(steps));
  range_steps_ = std::move(steps);
  return absl::OkStatus();
}

absl::Status StepEngine::Speculate(std::vector<double> group_lr, std::vector<RangeStep> steps) {
  if (!in_step_) return absl::FailedPreconditionError("no step is open");
  if (micro_batch_ > 0) {
    return absl::FailedPreconditionError(
        "the step has a second micro-batch: its sum is not known before the commit");
  }
  OFFLOAD_RETURN_IF_ERROR(CheckRangeSteps(steps));
  // What the policy decides for a step with nothing to skip or clip (a zero norm clips nothing).
  const StepDecision clean = policy_.Decide(GradStats{});
  sender_->Speculate(std::move(group_lr), clean.grad_multiplier);
  speculative_steps_ = std::move(steps);
  speculating_ = true;
  return absl::OkStatus();
}

absl::Status StepEngine::UpdateReady(int64_t offset, int64_t n) {
  if (!in_step_) return absl::FailedPreconditionError("no step is open");
  const int64_t padded = static_cast<int64_t>(backend_->partition().padded_length());
  if (n <= 0 || offset < 0 || offset > padded || n > padded - offset) {
    return absl::OutOfRangeError(absl::StrCat(
        "[", offset, ", ", offset + n, ") is not inside the flat space of ", padded, " elements"));
  }
  if (!speculating_) return absl::OkStatus();
  const int64_t lo = std::max(offset, backend_->partition_offset());
  const int64_t hi =
      std::min(offset + n, backend_->partition_offset() + backend_->partition_length());
  // Each piece goes with its own t (0: the range's next step); a piece a range step skips is not
  // updated at all.
  int64_t at = lo;
  for (const RangeStep& rs : ClipRangeSteps(speculative_steps_, lo, hi)) {
    if (rs.offset > at) sender_->EnqueueUpdate(at, rs.offset - at, 0);
    if (rs.t > 0) sender_->EnqueueUpdate(rs.offset, rs.length, rs.t);
    at = rs.offset + rs.length;
  }
  if (at < hi) sender_->EnqueueUpdate(at, hi - at, 0);
  return absl::OkStatus();
}

absl::StatusOr<StepDecision> StepEngine::Preview(std::optional<GradStats> global,
                                                 float max_grad_norm) {
  OFFLOAD_ASSIGN_OR_RETURN(const GradStats own, Drain());
  return policy_.Decide(global.value_or(own), max_grad_norm < 0 ? -1.0f : max_grad_norm);
}

absl::StatusOr<StepDecision> StepEngine::Close(std::optional<GradStats> global, float max_grad_norm,
                                               std::vector<RangeStep>* range_steps) {
  OFFLOAD_ASSIGN_OR_RETURN(const StepDecision d, Preview(global, max_grad_norm));
  in_step_ = false;
  step_stats_ = GradStats{};
  EndMicroBatches();
  *range_steps = std::move(range_steps_);
  range_steps_.clear();
  return d;
}

absl::StatusOr<CommitOutcome> StepEngine::Commit(std::optional<GradStats> global,
                                                 float max_grad_norm, double lr,
                                                 absl::Span<const double> group_lr,
                                                 uint16_t* partition16) {
  if (!in_step_) return absl::FailedPreconditionError("a commit outside a step");
  const uint64_t step = open_step_;
  std::vector<RangeStep> range_steps;
  OFFLOAD_ASSIGN_OR_RETURN(const StepDecision d, Close(global, max_grad_norm, &range_steps));
  absl::StatusOr<StepCounters> counters;
  {
    TracePhase phase(options_.trace, "commit", step);
    counters = backend_->Commit(lr, d.grad_multiplier, d.skip, partition16, group_lr, range_steps);
  }
  if (!counters.ok()) return counters.status();
  policy_.Finish(d);
  return CommitOutcome{d, *counters};
}

absl::StatusOr<StepDecision> StepEngine::CommitAsync(std::optional<GradStats> global,
                                                     float max_grad_norm, double lr,
                                                     std::vector<double> group_lr,
                                                     uint16_t* partition16) {
  if (!in_step_) return absl::FailedPreconditionError("a commit outside a step");
  const uint64_t step = open_step_;
  std::vector<RangeStep> range_steps;
  OFFLOAD_ASSIGN_OR_RETURN(const StepDecision d, Close(global, max_grad_norm, &range_steps));
  policy_.Finish(d);
  pending_commit_ = std::async(
      std::launch::async,
      [this, d, step, lr, partition16, group_lr = std::move(group_lr),
       range_steps = std::move(range_steps)]() -> absl::StatusOr<CommitOutcome> {
        // In the trace beside the next step's phases: what the delayed update overlaps.
        TracePhase phase(options_.trace, "commit_delayed", step);
        OFFLOAD_ASSIGN_OR_RETURN(
            StepCounters counters,
            backend_->Commit(lr, d.grad_multiplier, d.skip, partition16, group_lr, range_steps));
        return CommitOutcome{d, counters};
      });
  return d;
}

absl::StatusOr<CommitOutcome> StepEngine::WaitCommit() {
  if (!pending_commit_.valid()) {
    return absl::FailedPreconditionError("no delayed commit is in flight");
  }
  return pending_commit_.get();
}

}  // namespace offload
