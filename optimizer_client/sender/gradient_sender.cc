#include "optimizer_client/sender/gradient_sender.h"

#include "base/dtype.h"

namespace offload {

GradientSender::GradientSender(OptimizerBackend* backend, const uint16_t* grads16, DType dtype,
                               bool measure, PhaseTrace* trace)
    : backend_(backend),
      grads16_(grads16),
      trace_(trace),
      dtype_(dtype),
      measure_(measure),
      thread_([this] { Loop(); }) {}

GradientSender::~GradientSender() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void GradientSender::Enqueue(int64_t offset, int64_t n, bool accumulate, const uint16_t* src,
                             const GradStats* known) {
  if (n <= 0) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Range{offset, n, false, 0, accumulate,
                           src != nullptr ? src : grads16_ + offset, PhaseTrace::Clock::now(),
                           known != nullptr, known != nullptr ? *known : GradStats{}});
  }
  cv_.notify_all();
}

void GradientSender::Speculate(std::vector<double> group_lr, float grad_multiplier) {
  std::lock_guard<std::mutex> lock(mu_);
  spec_lr_ = std::move(group_lr);
  spec_multiplier_ = grad_multiplier;
}

void GradientSender::EnqueueUpdate(int64_t offset, int64_t n, uint64_t t) {
  if (n <= 0) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(
        Range{offset, n, true, t, false, nullptr, PhaseTrace::Clock::now(), false, GradStats{}});
  }
  cv_.notify_all();
}

absl::Status GradientSender::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return queue_.empty() && in_flight_ == 0; });
  absl::Status error = error_;
  error_ = absl::OkStatus();
  return error;
}

GradStats GradientSender::TakeStats() {
  std::lock_guard<std::mutex> lock(mu_);
  GradStats taken = stats_;
  stats_ = GradStats{};
  return taken;
}

void GradientSender::AccumulateInto(float* acc, int64_t base) {
  std::lock_guard<std::mutex> lock(mu_);
  acc_ = acc;
  acc_base_ = base;
}

void GradientSender::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and nothing left
    const Range range = queue_.front();
    queue_.pop_front();
    const bool failed = !error_.ok();
    float* const acc =
        range.accumulate && acc_ != nullptr ? acc_ + (range.offset - acc_base_) : nullptr;
    ++in_flight_;
    if (range.update) {
      // Copied under the lock: Speculate may be called for the next step while this runs.
      const std::vector<double> lrs = spec_lr_;
      const float multiplier = spec_multiplier_;
      lock.unlock();
      absl::Status s;
      if (!failed && !lrs.empty()) {
        TracePhase phase(trace_, "update_early", step_.load(std::memory_order_relaxed));
        s = backend_->UpdateEarly(range.offset, range.n, range.t, lrs[0], multiplier, lrs);
      }
      lock.lock();
      --in_flight_;
      if (!s.ok() && error_.ok()) error_ = s;
      cv_.notify_all();
      continue;
    }
    lock.unlock();
    absl::Status s;
    GradStats stats = range.stats;
    if (!failed && acc != nullptr) {
      // In micro-batch order, as the shard's own fold adds them: the same fp32 sums.
      AddAsFloat(range.src, dtype_, range.n, acc);
      stats = GradStats{};
    } else if (!failed && measure_ && !range.known) {
      stats = MeasureGradients16(range.src, range.n, dtype_);
    }
    if (!failed) {
      const uint64_t step = step_.load(std::memory_order_relaxed);
      // The wait in the queue is a span of its own: a range is queued as soon as it is final,
      // and sent when this thread gets a core and the ranges before it have left.
      if (trace_ != nullptr) {
        trace_->Record("send_queued", step, range.queued, PhaseTrace::Clock::now());
      }
      TracePhase phase(trace_, "send_gradients", step);
      s = backend_->SendGradients(range.offset, range.src, range.n, range.accumulate);
    }
    lock.lock();
    --in_flight_;
    stats_.Merge(stats);
    if (!s.ok() && error_.ok()) error_ = s;
    cv_.notify_all();
  }
}

}  // namespace offload
