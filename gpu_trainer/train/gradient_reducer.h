// ZeRO-2's gradient path on the CPU backend (ARCHITECTURE.md sections 1 and 3): backward writes
// its fp32 gradients unit by unit into buckets, groups of consecutive units in backward order;
// each bucket, once its last unit is final, is reduce-scattered across the W ranks on a thread of
// its own while backward goes on, and this rank's share of it is averaged, rounded to 16 bits and
// handed on (to the gradient sender). Rounding after the reduction makes W ranks send what one
// rank with the whole batch would, up to the order of the fp32 sums.
//
// Only the buckets on their way hold memory: a bucket's buffer is taken when backward first
// writes into it and given back once it is reduced, and at most max_in_flight buckets (besides
// the one with the embeddings, which the tied head writes at the start of backward and the
// embedding at the end) hold buffers at once; backward waits for the reduction when it runs
// ahead. So the fp32 gradients take a few buckets' worth, not 4 bytes for every parameter.
#ifndef OFFLOAD_GPU_TRAINER_TRAIN_GRADIENT_REDUCER_H_
#define OFFLOAD_GPU_TRAINER_TRAIN_GRADIENT_REDUCER_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "gpu_trainer/collectives/collectives.h"
#include "gpu_trainer/model/gpt2.h"
#include "model_spec/gpt2_config.h"
#include "model_spec/gradient_buckets.h"
#include "optimizer_client/precision/grad_stats.h"
#include "optimizer_client/sender/phase_trace.h"

namespace offload {

class GradientReducer final : public Gpt2GradSink {
 public:
  // This rank's share of each reduced bucket is rounded into grads16 (padded_length,), or where
  // Begin's `place` says, and on_rounded(offset, n, rounded) runs on the reducer thread once
  // [offset, offset + n) of this rank's partition is final at `rounded` (n,). Buckets hold at
  // least bucket_elements (the last may hold fewer) and never split a unit; with a single rank
  // each unit is a bucket.
  using RoundedFn = std::function<void(int64_t offset, int64_t n, const uint16_t* rounded)>;
  GradientReducer(Collectives* collectives, const Gpt2Config& model, int64_t padded_length,
                  uint16_t* grads16, DType dtype, int64_t bucket_elements, RoundedFn on_rounded,
                  PhaseTrace* trace = nullptr, int max_in_flight = 2);
  ~GradientReducer() override;
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // Where a bucket's rounded share of [offset, offset + n) goes instead of grads16, or null.
  using PlaceFn = std::function<uint16_t*(int64_t offset, int64_t n)>;
  // Starts one backward pass; `step` labels the trace, where each bucket has two spans:
  // `reduce_queued` from backward's hand-off until this thread takes it, then `reduce_scatter`.
  // With `place`, each share is rounded where it says (zero-copy into the data plane), else into
  // grads16; the statistics are the same either way.
  void Begin(uint64_t step, PlaceFn place = nullptr);
  // Gpt2GradSink, for Gpt2Cpu::Backward: a unit's place in its bucket's buffer (taken, and
  // zeroed, with the bucket's first unit; waiting while max_in_flight buckets are on their way),
  // and the unit final. A bucket whose units are all final is queued for reduction.
  absl::StatusOr<float*> Acquire(int unit) override;
  absl::Status Release(int unit) override;
  // The host-staged path, for a backend whose gradients are 16-bit where they are computed (CUDA
  // ranks meeting over gloo): grads16 (n,) of flat [offset, offset + n) are final, copied to the
  // host. They are widened into their units' buckets (exactly: every 16-bit value is an fp32
  // one), and each unit is released once all of it has come, so the buckets are reduced in fp32
  // as the CPU backend's are. The ranges may have any size but must cover each unit once per
  // pass, in the same order on every rank; calls come from one thread at a time. The rounded
  // share may later be written over grads16's bucket range: only a final range is ever read.
  absl::Status AddGradients16(int64_t offset, int64_t n, const uint16_t* grads16);
  // Waits for every bucket and returns the statistics of this rank's rounded share, or the first
  // error (after which the collectives are unusable).
  absl::StatusOr<GradStats> Finish();
  // After a failed backward: drops the buckets not yet queued (the other ranks would reduce them
  // with other sizes) and waits for the queued ones.
  void Abandon();

  // The fp32 gradient buffers held now and at most since construction, in bytes: what the
  // gradients take on the compute device.
  int64_t held_bytes() const;
  int64_t peak_bytes() const;
  // The first element of each bucket reduced in the last pass, in the order they were reduced.
  std::vector<int64_t> reduced_order() const;

 private:
  struct Live {
    std::unique_ptr<float[]> data;  // (capacity,) the bucket's gradients from lo on
    int64_t capacity = 0;
    int released = 0;  // units final
    bool taken = false;
    bool queued = false;
  };
  // Takes a buffer for bucket b; mu_ held (lock passed for waiting).
  absl::Status Take(int b, std::unique_lock<std::mutex>& lock);
  void GiveBack(int b);  // mu_ held
  void Queue(int b);     // mu_ held
  void Loop();
  absl::Status Reduce(int b, float* data, const PlaceFn& place, GradStats* stats);

  Collectives* const collectives_;
  const Gpt2Config model_;
  const int64_t padded_length_, partition_length_;
  uint16_t* const grads16_;
  const DType dtype_;
  const int64_t bucket_elements_;
  const int max_in_flight_;
  const RoundedFn on_rounded_;
  PhaseTrace* const trace_;
  std::vector<GradientBucket> buckets_;  // PlanGradientBuckets': in backward order, padding first
  std::vector<int> bucket_of_unit_;      // (units,)
  std::vector<int64_t> unit_begin_;  // (units + 1,) flat first element of each unit, then the end
  std::vector<int64_t> unit_received_;  // (units,) elements AddGradients16 has widened this pass
  std::vector<int64_t> counts_;         // (W,) elements of the bucket in each rank's partition

  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t step_ = 0;                           // guarded by mu_
  PlaceFn place_;                               // guarded by mu_
  std::vector<Live> live_;                      // guarded by mu_; (buckets,)
  std::vector<std::unique_ptr<float[]>> free_;  // guarded by mu_: buffers to reuse
  std::vector<int64_t> free_capacity_;          // guarded by mu_
  int in_flight_ = 0;  // guarded by mu_: buckets other than the embeddings' holding buffers
  int64_t held_ = 0;   // guarded by mu_: bytes of every buffer, taken or free
  int64_t peak_ = 0;   // guarded by mu_
  std::deque<std::pair<int, PhaseTrace::Clock::time_point>> queue_;  // guarded by mu_
  std::vector<int64_t> reduced_;                                     // guarded by mu_
  bool busy_ = false;   // guarded by mu_: the thread is reducing a bucket
  GradStats stats_;     // guarded by mu_
  absl::Status error_;  // guarded by mu_
  bool stop_ = false;   // guarded by mu_
  std::thread thread_;
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_TRAIN_GRADIENT_REDUCER_H_
