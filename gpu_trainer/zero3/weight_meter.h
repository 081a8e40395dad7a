// Counts the bytes of 16-bit weights a trainer rank holds, for ZeRO-3's memory claim (at most 2N/W
// plus the gather window plus a constant, ARCHITECTURE.md section 3): every buffer of 16-bit
// weights is a Weights16, so the peak is a count of allocations, not a guess from RSS.
#ifndef OFFLOAD_GPU_TRAINER_ZERO3_WEIGHT_METER_H_
#define OFFLOAD_GPU_TRAINER_ZERO3_WEIGHT_METER_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

namespace offload {

// One rank's count; thread-safe (the gather thread allocates too).
class WeightMeter {
 public:
  void Add(int64_t bytes) {
    const int64_t now = live_.fetch_add(bytes) + bytes;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }
  void Sub(int64_t bytes) { live_.fetch_sub(bytes); }
  int64_t live() const { return live_.load(); }
  int64_t peak() const { return peak_.load(); }
  // The peak from now on, e.g. after start-up.
  void ResetPeak() { peak_.store(live_.load()); }

 private:
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
};

// (n,) 16-bit weights, zeroed, counted by a meter (which may be null) while allocated.
class Weights16 {
 public:
  Weights16() = default;
  Weights16(int64_t n, WeightMeter* meter) : data_(new uint16_t[n]()), size_(n), meter_(meter) {
    if (meter_ != nullptr) meter_->Add(bytes());
  }
  Weights16(Weights16&& other) noexcept { *this = std::move(other); }
  Weights16& operator=(Weights16&& other) noexcept {
    if (this == &other) return *this;
    Reset();
    data_ = std::move(other.data_);
    size_ = std::exchange(other.size_, 0);
    meter_ = std::exchange(other.meter_, nullptr);
    return *this;
  }
  ~Weights16() { Reset(); }

  uint16_t* data() { return data_.get(); }
  const uint16_t* data() const { return data_.get(); }
  int64_t size() const { return size_; }
  int64_t bytes() const { return size_ * static_cast<int64_t>(sizeof(uint16_t)); }
  void Reset() {
    if (meter_ != nullptr) meter_->Sub(bytes());
    data_.reset();
    size_ = 0;
    meter_ = nullptr;
  }

 private:
  std::unique_ptr<uint16_t[]> data_;
  int64_t size_ = 0;
  WeightMeter* meter_ = nullptr;
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_ZERO3_WEIGHT_METER_H_
