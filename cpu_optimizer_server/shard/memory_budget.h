// Accounting of the bytes a shard holds (optimizer state, accumulators, gradients in flight)
// against a configured limit, so a request that would exceed it is refused before anything is
// allocated, instead of the process being killed by the OOM killer mid-step.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_MEMORY_BUDGET_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_MEMORY_BUDGET_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace offload {

class Reservation;

class MemoryBudget {
 public:
  explicit MemoryBudget(int64_t limit_bytes) : limit_(limit_bytes) {}

  // Reserves `bytes` or returns RESOURCE_EXHAUSTED naming `what` and the numbers.
  absl::Status Reserve(int64_t bytes, const std::string& what) {
    int64_t used = used_.load(std::memory_order_relaxed);
    do {
      if (bytes > limit_ - used) {
        return absl::ResourceExhaustedError(
            absl::StrCat(what, " needs ", bytes, " bytes but the shard holds ", used, " of its ",
                         limit_, " byte limit (--memory_limit)"));
      }
    } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
    return absl::OkStatus();
  }
  // Reserve, as a Reservation that gives the bytes back when it goes.
  absl::StatusOr<Reservation> Take(int64_t bytes, const std::string& what);
  void Release(int64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }

  int64_t used() const { return used_.load(std::memory_order_relaxed); }
  int64_t limit() const { return limit_; }

 private:
  const int64_t limit_;
  std::atomic<int64_t> used_{0};
};

// Bytes reserved from a budget, released on destruction.
class Reservation {
 public:
  Reservation() = default;
  Reservation(MemoryBudget* budget, int64_t bytes) : budget_(budget), bytes_(bytes) {}
  Reservation(Reservation&& o) noexcept : budget_(o.budget_), bytes_(o.bytes_) { o.bytes_ = 0; }
  Reservation& operator=(Reservation&& o) noexcept {
    if (this != &o) {
      Reset();
      budget_ = o.budget_;
      bytes_ = o.bytes_;
      o.bytes_ = 0;
    }
    return *this;
  }
  ~Reservation() { Reset(); }
  void Reset() {
    if (budget_ != nullptr && bytes_ != 0) budget_->Release(bytes_);
    bytes_ = 0;
  }
  int64_t bytes() const { return bytes_; }
  // Takes over `other`'s bytes (both must come from the same budget).
  void Absorb(Reservation&& other) {
    if (budget_ == nullptr) budget_ = other.budget_;
    bytes_ += other.bytes_;
    other.bytes_ = 0;
  }

 private:
  MemoryBudget* budget_ = nullptr;
  int64_t bytes_ = 0;
};

inline absl::StatusOr<Reservation> MemoryBudget::Take(int64_t bytes, const std::string& what) {
  OFFLOAD_RETURN_IF_ERROR(Reserve(bytes, what));
  return Reservation(this, bytes);
}

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_MEMORY_BUDGET_H_
