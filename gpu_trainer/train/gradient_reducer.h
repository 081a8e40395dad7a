// ZeRO-2's gradient path on the CPU backend (ARCHITECTURE.md sections 1 and 3): backward's fp32
// gradient ranges are grouped into buckets in backward order; each bucket, once its last range is
// final, is reduce-scattered across the W ranks on a thread of its own while backward goes on, and
// this rank's share of it is averaged, rounded to 16 bits and handed on (to the gradient sender).
// Rounding after the reduction makes W ranks send what one rank with the whole batch would, up to
// the order of the fp32 sums.
#ifndef OFFLOAD_GPU_TRAINER_TRAIN_GRADIENT_REDUCER_H_
#define OFFLOAD_GPU_TRAINER_TRAIN_GRADIENT_REDUCER_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "gpu_trainer/collectives/collectives.h"
#include "gpu_trainer/precision/grad_stats.h"
#include "gpu_trainer/train/phase_trace.h"

namespace offload {

class GradientReducer {
 public:
  // grads32 (padded_length,) is written by backward (its padding stays 0); this rank's share of
  // each reduced bucket is written over it, then rounded into grads16 (padded_length,).
  // on_rounded(offset, n) runs on the reducer thread once [offset, offset + n) of this rank's
  // partition is final in grads16. Buckets hold at least bucket_elements (the last may be
  // smaller), and never split one of backward's ranges; with a single rank each range is a bucket.
  GradientReducer(Collectives* collectives, int64_t num_params, int64_t padded_length,
                  float* grads32, uint16_t* grads16, DType dtype, int64_t bucket_elements,
                  std::function<void(int64_t offset, int64_t n)> on_rounded,
                  PhaseTrace* trace = nullptr);
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // Starts one backward pass; `step` labels the trace, where each bucket has two spans:
  // `reduce_queued` from backward's hand-off until this thread takes it, then `reduce_scatter`.
  void Begin(uint64_t step);
  // Backward's range [offset, offset + n) is final in grads32. Ranges come in backward order:
  // each one ends where the previous began (Gpt2Cpu::Backward's contract).
  void Add(int64_t offset, int64_t n);
  // Reduces what is left, waits for every bucket, and returns the statistics of this rank's
  // rounded share, or the first error (after which the collectives are unusable).
  absl::StatusOr<GradStats> Finish();
  // After a failed backward: drops the open bucket (the other ranks would reduce it with other
  // sizes) and waits for the queued ones.
  void Abandon();

 private:
  struct Bucket {
    int64_t lo, hi;
    PhaseTrace::Clock::time_point queued;  // set by Flush
  };
  void Flush();  // queues the open bucket; mu_ held
  void Loop();
  absl::Status Reduce(const Bucket& bucket, GradStats* stats);

  Collectives* const collectives_;
  const int64_t num_params_, padded_length_, partition_length_;
  float* const grads32_;
  uint16_t* const grads16_;
  const DType dtype_;
  const int64_t bucket_elements_;
  const std::function<void(int64_t, int64_t)> on_rounded_;
  PhaseTrace* const trace_;
  std::vector<int64_t> counts_;  // (W,) elements of the bucket in each rank's partition

  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t step_ = 0;         // guarded by mu_
  Bucket open_{0, 0, {}};     // guarded by mu_; [lo, hi) grows downwards
  std::deque<Bucket> queue_;  // guarded by mu_
  bool busy_ = false;         // guarded by mu_: the thread is reducing a bucket
  GradStats stats_;           // guarded by mu_
  absl::Status error_;        // guarded by mu_
  bool stop_ = false;         // guarded by mu_
  std::thread thread_;
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_TRAIN_GRADIENT_REDUCER_H_
