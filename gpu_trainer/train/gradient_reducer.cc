#include "gpu_trainer/train/gradient_reducer.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model_spec/gradient_buckets.h"
#include "model_spec/param_layout.h"

namespace offload {

GradientReducer::GradientReducer(Collectives* collectives, const Gpt2Config& model,
                                 int64_t padded_length, uint16_t* grads16, DType dtype,
                                 int64_t bucket_elements, RoundedFn on_rounded, PhaseTrace* trace,
                                 int max_in_flight)
    : collectives_(collectives),
      model_(model),
      padded_length_(padded_length),
      partition_length_(padded_length / collectives->world_size()),
      grads16_(grads16),
      dtype_(dtype),
      // Alone there is nothing to amortise: each unit leaves as soon as it is final.
      bucket_elements_(collectives->world_size() == 1 ? 1 : std::max<int64_t>(1, bucket_elements)),
      max_in_flight_(std::max(1, max_in_flight)),
      on_rounded_(std::move(on_rounded)),
      trace_(trace),
      counts_(collectives->world_size(), 0) {
  // The padding bucket, then units in backward order grouped greedily from the top: the same
  // pieces the CUDA backend's device buckets hold.
  GradientBucketPlan plan = PlanGradientBuckets(model, padded_length_, bucket_elements_);
  buckets_ = std::move(plan.buckets);
  bucket_of_unit_ = std::move(plan.bucket_of_unit);
  const int64_t num_params = Gpt2NumParams(model);
  const int units = Gpt2NumUnits(model);
  live_.resize(buckets_.size());
  for (int unit = 0; unit < units; ++unit) unit_begin_.push_back(Gpt2UnitRange(model, unit).begin);
  unit_begin_.push_back(num_params);
  unit_received_.assign(units, 0);
  thread_ = std::thread([this] { Loop(); });
}

GradientReducer::~GradientReducer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void GradientReducer::Begin(uint64_t step, PlaceFn place) {
  std::unique_lock<std::mutex> lock(mu_);
  step_ = step;
  place_ = std::move(place);
  stats_ = GradStats{};
  reduced_.clear();
  std::fill(unit_received_.begin(), unit_received_.end(), 0);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (buckets_[b].units == 0 && Take(static_cast<int>(b), lock).ok()) Queue(static_cast<int>(b));
  }
}

absl::Status GradientReducer::Take(int b, std::unique_lock<std::mutex>& lock) {
  const GradientBucket& bucket = buckets_[b];
  if (!bucket.embeddings) {
    cv_.wait(lock, [&] { return in_flight_ < max_in_flight_; });
    in_flight_++;
  }
  const int64_t n = bucket.hi - bucket.lo;
  // The smallest free buffer that holds the bucket, else a new one.
  int best = -1;
  for (int i = 0; i < static_cast<int>(free_.size()); ++i) {
    if (free_capacity_[i] >= n && (best < 0 || free_capacity_[i] < free_capacity_[best])) best = i;
  }
  Live& live = live_[b];
  if (best >= 0) {
    live.data = std::move(free_[best]);
    live.capacity = free_capacity_[best];
    free_.erase(free_.begin() + best);
    free_capacity_.erase(free_capacity_.begin() + best);
  } else {
    live.data.reset(new float[n]);
    live.capacity = n;
    held_ += n * static_cast<int64_t>(sizeof(float));
    peak_ = std::max(peak_, held_);
  }
  std::memset(live.data.get(), 0, n * sizeof(float));
  live.taken = true;
  live.queued = false;
  live.released = 0;
  return absl::OkStatus();
}

void GradientReducer::GiveBack(int b) {
  Live& live = live_[b];
  if (!live.taken) return;
  free_.push_back(std::move(live.data));
  free_capacity_.push_back(live.capacity);
  live = Live{};
  if (!buckets_[b].embeddings) in_flight_--;
  cv_.notify_all();
}

void GradientReducer::Queue(int b) {
  live_[b].queued = true;
  queue_.emplace_back(b, PhaseTrace::Clock::now());
  cv_.notify_all();
}

absl::StatusOr<float*> GradientReducer::Acquire(int unit) {
  if (unit < 0 || unit >= static_cast<int>(bucket_of_unit_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("GradientReducer: no unit ", unit));
  }
  std::unique_lock<std::mutex> lock(mu_);
  const int b = bucket_of_unit_[unit];
  if (!live_[b].taken) OFFLOAD_RETURN_IF_ERROR(Take(b, lock));
  return live_[b].data.get() + (Gpt2UnitRange(model_, unit).begin - buckets_[b].lo);
}

absl::Status GradientReducer::Release(int unit) {
  if (unit < 0 || unit >= static_cast<int>(bucket_of_unit_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("GradientReducer: no unit ", unit));
  }
  std::lock_guard<std::mutex> lock(mu_);
  const int b = bucket_of_unit_[unit];
  if (!live_[b].taken) {
    return absl::FailedPreconditionError(
        absl::StrCat("GradientReducer: unit ", unit, " released before it was acquired"));
  }
  if (++live_[b].released == buckets_[b].units) Queue(b);
  return absl::OkStatus();
}

absl::Status GradientReducer::AddGradients16(int64_t offset, int64_t n, const uint16_t* grads16) {
  if (offset < 0 || n < 0 || offset + n > unit_begin_.back()) {
    return absl::InvalidArgumentError(absl::StrCat("GradientReducer: gradients [", offset, ", ",
                                                   offset + n, ") are not all parameters"));
  }
  int unit = static_cast<int>(std::upper_bound(unit_begin_.begin(), unit_begin_.end(), offset) -
                              unit_begin_.begin() - 1);
  for (int64_t lo = offset, end = offset + n; lo < end; ++unit) {
    const int64_t unit_lo = unit_begin_[unit], unit_hi = unit_begin_[unit + 1];
    const int64_t hi = std::min(end, unit_hi);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (unit_received_[unit] + (hi - lo) > unit_hi - unit_lo) {
        return absl::InvalidArgumentError(absl::StrCat(
            "GradientReducer: unit ", unit, " [", unit_lo, ", ", unit_hi, ") got gradients for [",
            lo, ", ", hi, ") after ", unit_received_[unit], " of its elements"));
      }
    }
    OFFLOAD_ASSIGN_OR_RETURN(float* place, Acquire(unit));  // (unit_hi - unit_lo,)
    AddAsFloat(grads16 + (lo - offset), dtype_, hi - lo, place + (lo - unit_lo));
    bool complete;
    {
      std::lock_guard<std::mutex> lock(mu_);
      unit_received_[unit] += hi - lo;
      complete = unit_received_[unit] == unit_hi - unit_lo;
    }
    if (complete) OFFLOAD_RETURN_IF_ERROR(Release(unit));
    lo = hi;
  }
  return absl::OkStatus();
}

absl::StatusOr<GradStats> GradientReducer::Finish() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return queue_.empty() && !busy_; });
  for (size_t b = 0; b < live_.size(); ++b) {
    if (live_[b].taken) {
      GiveBack(static_cast<int>(b));
      if (error_.ok()) {
        error_ = absl::InternalError(absl::StrCat("GradientReducer: bucket [", buckets_[b].lo, ", ",
                                                  buckets_[b].hi, ") was never complete"));
      }
    }
  }
  if (!error_.ok()) return error_;
  return stats_;
}

void GradientReducer::Abandon() {
  std::unique_lock<std::mutex> lock(mu_);
  for (size_t b = 0; b < live_.size(); ++b) {
    if (live_[b].taken && !live_[b].queued) GiveBack(static_cast<int>(b));
  }
  cv_.wait(lock, [this] { return queue_.empty() && !busy_; });
}

int64_t GradientReducer::held_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

int64_t GradientReducer::peak_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_;
}

std::vector<int64_t> GradientReducer::reduced_order() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reduced_;
}

void GradientReducer::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and nothing left
    const auto [b, queued] = queue_.front();
    queue_.pop_front();
    const bool failed = !error_.ok();
    const uint64_t step = step_;
    const PlaceFn place = place_;
    float* data = live_[b].data.get();
    busy_ = true;
    lock.unlock();
    GradStats stats;
    absl::Status s;
    if (!failed) {
      if (trace_ != nullptr)
        trace_->Record("reduce_queued", step, queued, PhaseTrace::Clock::now());
      TracePhase phase(trace_, "reduce_scatter", step);
      s = Reduce(b, data, place, &stats);
    }
    lock.lock();
    busy_ = false;
    stats_.Merge(stats);
    if (!s.ok() && error_.ok()) error_ = s;
    if (s.ok() && !failed) reduced_.push_back(buckets_[b].lo);
    GiveBack(b);
    cv_.notify_all();
  }
}

absl::Status GradientReducer::Reduce(int b, float* data, const PlaceFn& place, GradStats* stats) {
  const GradientBucket& bucket = buckets_[b];
  const int W = collectives_->world_size();
  const int rank = collectives_->rank();
  // The bucket is contiguous and the partitions are in rank order, so its pieces in each rank's
  // partition are the consecutive segments ReduceScatter takes.
  counts_ = RankCounts(bucket.lo, bucket.hi, partition_length_, W);
  const int64_t mine_lo = std::max(bucket.lo, rank * partition_length_);
  const int64_t mine = counts_[rank];
  float* out = data + (mine_lo - bucket.lo);  // (mine,)
  OFFLOAD_RETURN_IF_ERROR(collectives_->ReduceScatter(data, out, counts_));
  if (mine == 0) return absl::OkStatus();
  // The mean over ranks, before rounding: each rank's loss is the mean over its share of the
  // batch, so this is the gradient of the whole batch's mean loss.
  uint16_t* rounded = place != nullptr ? place(mine_lo, mine) : nullptr;  // (mine,)
  if (rounded == nullptr) rounded = grads16_ + mine_lo;
  *stats = RoundGradients(out, mine, dtype_, rounded, 1.0f / static_cast<float>(W));
  if (on_rounded_) on_rounded_(mine_lo, mine, rounded);
  return absl::OkStatus();
}

}  // namespace offload
