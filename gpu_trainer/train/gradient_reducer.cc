#include "gpu_trainer/train/gradient_reducer.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace offload {

GradientReducer::GradientReducer(Collectives* collectives, int64_t num_params,
                                 int64_t padded_length, float* grads32, uint16_t* grads16,
                                 DType dtype, int64_t bucket_elements,
                                 std::function<void(int64_t, int64_t)> on_rounded,
                                 PhaseTrace* trace)
    : collectives_(collectives),
      num_params_(num_params),
      padded_length_(padded_length),
      partition_length_(padded_length / collectives->world_size()),
      grads32_(grads32),
      grads16_(grads16),
      dtype_(dtype),
      // Alone there is nothing to amortise: each range leaves as soon as it is final.
      bucket_elements_(collectives->world_size() == 1 ? 1 : std::max<int64_t>(1, bucket_elements)),
      on_rounded_(std::move(on_rounded)),
      trace_(trace),
      counts_(collectives->world_size(), 0),
      thread_([this] { Loop(); }) {}

GradientReducer::~GradientReducer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void GradientReducer::Begin(uint64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  step_ = step;
  stats_ = GradStats{};
  // The padding above the parameters is a bucket of its own: its gradients are the zeros grads32
  // holds there, and the owner of that part of the flat space sends them like the rest.
  open_ = Bucket{num_params_, padded_length_, {}};
  Flush();
}

void GradientReducer::Add(int64_t offset, int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  open_.lo = std::min(open_.lo, offset);
  if (open_.hi - open_.lo >= bucket_elements_) Flush();
}

void GradientReducer::Flush() {
  if (open_.hi > open_.lo) {
    open_.queued = PhaseTrace::Clock::now();
    queue_.push_back(open_);
    cv_.notify_all();
  }
  open_ = Bucket{open_.lo, open_.lo, {}};
}

absl::StatusOr<GradStats> GradientReducer::Finish() {
  std::unique_lock<std::mutex> lock(mu_);
  Flush();
  cv_.wait(lock, [this] { return queue_.empty() && !busy_; });
  if (!error_.ok()) return error_;
  return stats_;
}

void GradientReducer::Abandon() {
  std::unique_lock<std::mutex> lock(mu_);
  open_ = Bucket{open_.lo, open_.lo, {}};
  cv_.wait(lock, [this] { return queue_.empty() && !busy_; });
}

void GradientReducer::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and nothing left
    const Bucket bucket = queue_.front();
    queue_.pop_front();
    const bool failed = !error_.ok();
    const uint64_t step = step_;
    busy_ = true;
    lock.unlock();
    GradStats stats;
    absl::Status s;
    if (!failed) {
      if (trace_ != nullptr) {
        trace_->Record("reduce_queued", step, bucket.queued, PhaseTrace::Clock::now());
      }
      TracePhase phase(trace_, "reduce_scatter", step);
      s = Reduce(bucket, &stats);
    }
    lock.lock();
    busy_ = false;
    stats_.Merge(stats);
    if (!s.ok() && error_.ok()) error_ = s;
    cv_.notify_all();
  }
}

absl::Status GradientReducer::Reduce(const Bucket& bucket, GradStats* stats) {
  const int W = collectives_->world_size();
  const int rank = collectives_->rank();
  // The bucket is contiguous and the partitions are in rank order, so its pieces in each rank's
  // partition are the consecutive segments ReduceScatter takes.
  for (int r = 0; r < W; ++r) {
    const int64_t lo = std::max(bucket.lo, r * partition_length_);
    const int64_t hi = std::min(bucket.hi, (r + 1) * partition_length_);
    counts_[r] = std::max<int64_t>(0, hi - lo);
  }
  const int64_t mine_lo = std::max(bucket.lo, rank * partition_length_);
  const int64_t mine = counts_[rank];
  float* out = grads32_ + mine_lo;  // (mine,)
  OFFLOAD_RETURN_IF_ERROR(collectives_->ReduceScatter(grads32_ + bucket.lo, out, counts_));
  if (mine == 0) return absl::OkStatus();
  // The mean over ranks, before rounding: each rank's loss is the mean over its share of the
  // batch, so this is the gradient of the whole batch's mean loss.
  *stats = RoundGradients(out, mine, dtype_, grads16_ + mine_lo, 1.0f / static_cast<float>(W));
  if (on_rounded_) on_rounded_(mine_lo, mine);
  return absl::OkStatus();
}

}  // namespace offload
