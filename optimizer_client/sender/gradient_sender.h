// Sends gradient ranges to the optimizer on a thread of its own, so backward goes on computing
// the next layer while the previous layer's gradients are on the wire (ARCHITECTURE.md section 1).
#ifndef OFFLOAD_OPTIMIZER_CLIENT_SENDER_GRADIENT_SENDER_H_
#define OFFLOAD_OPTIMIZER_CLIENT_SENDER_GRADIENT_SENDER_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "optimizer_client/backends/optimizer_backend.h"
#include "optimizer_client/precision/grad_stats.h"
#include "optimizer_client/sender/phase_trace.h"

namespace offload {

class GradientSender {
 public:
  // grads16 (padded_length,) stays owned by the caller and must not change while queued; the
  // gradients are `dtype`. measure: the statistics (GradStats) of every range sent are summed on
  // this thread, for callers that hand over gradients already rounded (the C ABI's front ends), so
  // the measure is off backward's path; TakeStats (after Drain) returns the sum since the last
  // TakeStats. Each range sent is recorded in `trace` (may be null) under the step of the last
  // set_step, as two spans: `send_queued` from Enqueue until this thread takes it, then
  // `send_gradients`.
  GradientSender(OptimizerBackend* backend, const uint16_t* grads16, DType dtype, bool measure,
                 PhaseTrace* trace = nullptr);
  void set_step(uint64_t step) { step_.store(step, std::memory_order_relaxed); }
  ~GradientSender();

  // Queues flat elements [offset, offset + n), found at `src` (n,), or at grads16 + offset when
  // null (src is the backend's GradientPlace when they were written there: sent without a copy);
  // accumulate as OptimizerBackend::SendGradients. After an error, later ranges are dropped. May
  // be called from any thread. `known`: the range's statistics, where the caller measured them
  // already (rounding them, RoundGradients): summed as they are instead of measured again.
  void Enqueue(int64_t offset, int64_t n, bool accumulate = false, const uint16_t* src = nullptr,
               const GradStats* known = nullptr);
  // The update during backward (OptimizerBackend::UpdateEarly): queues an update of flat
  // elements [offset, offset + n) with bias-correction step t (0: the range's next), run after
  // everything queued before it (their gradients) with the arguments of the last Speculate. On
  // the in-process engine the Adam runs on this thread; a server runs it on its own.
  void Speculate(std::vector<double> group_lr, float grad_multiplier);
  void EnqueueUpdate(int64_t offset, int64_t n, uint64_t t);

  // Waits until everything queued is sent; returns the first error since the last Drain.
  absl::Status Drain();

  GradStats TakeStats();
  // From now on, every accumulate range is also added (in fp32) into acc[offset - base] before it
  // is sent, and not measured: the caller's mirror of the shards' micro-batch accumulator, whose
  // statistics decide the step. Null: off. Call only when drained.
  void AccumulateInto(float* acc, int64_t base);

 private:
  void Loop();

  OptimizerBackend* const backend_;
  const uint16_t* const grads16_;
  PhaseTrace* const trace_;
  std::atomic<uint64_t> step_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  struct Range {
    int64_t offset, n;
    bool update;  // an update during backward of [offset, offset + n), not gradients
    uint64_t t;   // its bias-correction step
    bool accumulate;
    const uint16_t* src;  // (n,)
    PhaseTrace::Clock::time_point queued;
    bool known;  // stats holds the range's statistics
    GradStats stats;
  };
  std::deque<Range> queue_;  // guarded by mu_
  int in_flight_ = 0;        // guarded by mu_
  absl::Status error_;       // guarded by mu_
  bool stop_ = false;        // guarded by mu_
  const DType dtype_;
  const bool measure_;
  float* acc_ = nullptr;         // guarded by mu_
  int64_t acc_base_ = 0;         // guarded by mu_
  GradStats stats_;              // guarded by mu_
  std::vector<double> spec_lr_;  // guarded by mu_: Speculate's
  float spec_multiplier_ = 1;    // guarded by mu_
  std::thread thread_;
};

}  // namespace offload

#endif  // OFFLOAD_OPTIMIZER_CLIENT_SENDER_GRADIENT_SENDER_H_
