// The CUDA backend's gradients by bucket (ARCHITECTURE.md section 6): backward writes each unit's
// 16-bit gradient into its bucket's device slot (bucket_slots.h), and once a bucket's last unit is
// queued the bucket leaves: its sum of squares and overflow flag are added up on the device, it is
// copied to the host on the copy stream (and, with W NCCL ranks, first reduce-scattered on the
// device, each rank copying only its own partition's piece), and its slot is free again once the
// copy has landed. The device so holds the embeddings' bucket and at most two others, not a
// gradient for every parameter.
//
// One backward at a time: Begin, then AcquireUnit / ReleaseUnit in Gpt2GradSink's order (the
// embeddings first, ln_f, the blocks from the last, the embeddings released last), then Finish
// (or Abandon after an error). AcquireUnit waits on the host, only when backward has run two
// buckets ahead of the copies, for the slot to be free.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_ZERO_DEVICE_GRADIENT_BUCKETS_H_
#define OFFLOAD_GPU_TRAINER_CUDA_ZERO_DEVICE_GRADIENT_BUCKETS_H_

#include <cuda_runtime.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "gpu_trainer/collectives/collectives.h"
#include "gpu_trainer/cuda/runtime/device_buffer.h"
#include "gpu_trainer/cuda/runtime/pinned_staging.h"
#include "gpu_trainer/cuda/zero/bucket_slots.h"
#include "model_spec/gpt2_config.h"
#include "model_spec/gradient_buckets.h"

namespace offload {

struct DeviceGradientBucketsOptions {
  Gpt2Config config;
  DType dtype = DType::kBf16;  // fp16 or bf16
  int64_t bucket_elements = 1;
  // The flat space the ranks partition: num_params, or the partition map's padded length.
  int64_t padded_length = 0;
  // NCCL ranks (device pointers): each bucket is reduce-scattered on the device and this rank's
  // piece, the mean over ranks, is what leaves (with one rank: the bucket, the same bits). Null:
  // the bucket leaves whole.
  Collectives* collectives = nullptr;
  int device = 0;  // the reduce thread's
  // Reduce each bucket on the thread that completes it, not on a thread of its own: where that
  // thread makes NCCL calls of its own (ZeRO-3's window gathers on another communicator), so that
  // every rank issues all its NCCL operations in one program order. Two threads driving two
  // communicators in orders that differ between ranks can deadlock NCCL.
  bool reduce_on_caller = false;
};

// Bytes of the fp32 scratch the reduce-scatter needs (0 without collectives).
int64_t DeviceReduceScratchBytes(const DeviceGradientBucketsOptions& options);

class DeviceGradientBuckets {
 public:
  using ReadyFn = std::function<void(int64_t offset, int64_t n)>;
  using PlaceFn = std::function<uint16_t*(int64_t offset, int64_t n)>;
  // Tells where a host range is page-locked (a direct copy, no staging slot).
  using RegisteredFn = std::function<bool(const void* p, int64_t bytes)>;

  // area: (BucketSlotPlan::total_elements,) 16-bit device memory carved by the model;
  // reduce_scratch: DeviceReduceScratchBytes of device memory (may be null when that is 0).
  // d2h: the model's device-to-host ring; compute: the stream backward runs on.
  static absl::StatusOr<std::unique_ptr<DeviceGradientBuckets>> Create(
      const DeviceGradientBucketsOptions& options, void* area, float* reduce_scratch,
      DeviceToHostStaging* d2h, cudaStream_t compute, RegisteredFn registered);
  ~DeviceGradientBuckets();

  // Unit u's gradient on the device, (Gpt2UnitRange(u).size(),) 16-bit: fixed by the plan.
  void* UnitGradient(int unit) const { return unit_gradient_[unit]; }

  // Starts one backward. host_grads16 (padded_length,): where a bucket (or this rank's piece of
  // it) lands unless place(offset, n) names another destination; on_ready(offset, n) runs on the
  // copy thread once it has.
  void Begin(uint16_t* host_grads16, ReadyFn on_ready, PlaceFn place);
  // Before the first kernel that writes unit u: its bucket's slot must be free.
  absl::Status AcquireUnit(int unit);
  // After the last kernel that writes unit u is queued on the compute stream.
  absl::Status ReleaseUnit(int unit);
  // Waits for every bucket to land; the statistics of the values that left (this rank's pieces).
  struct Stats {
    double sum_squares = 0;
    bool nonfinite = false;
  };
  absl::StatusOr<Stats> Finish();
  // After a failed backward: waits for what was queued, drops the rest.
  void Abandon();

  int64_t buckets_sent() const;  // in the last pass

 private:
  DeviceGradientBuckets(const DeviceGradientBucketsOptions& options, cudaStream_t compute,
                        DeviceToHostStaging* d2h, RegisteredFn registered);
  absl::Status Init(void* area, float* reduce_scratch);
  // Bucket b is complete on the compute stream: the statistics and the copy (W = 1), or the
  // reduce thread's turn (W > 1).
  absl::Status Send(int b);
  void ReduceLoop();
  absl::Status Reduce(int b);
  // Queues the copy of [offset, offset + n) of the flat space, held at src on the device, once
  // `after` has fired; the slot of bucket b is free when it lands.
  void CopyOut(int b, int64_t offset, int64_t n, const void* src, cudaEvent_t after);
  void Left(int b);

  const DeviceGradientBucketsOptions options_;
  const cudaStream_t compute_;
  DeviceToHostStaging* const d2h_;
  const RegisteredFn registered_;
  const int64_t element_bytes_ = 2;
  GradientBucketPlan buckets_;
  BucketSlotPlan slots_;
  std::vector<void*> unit_gradient_;   // (units,)
  std::vector<void*> bucket_data_;     // (buckets,) the bucket's first element on the device
  std::vector<int> released_units_;    // (buckets,) units released this pass; compute thread
  std::vector<cudaEvent_t> complete_;  // (buckets,) on the compute stream after its last unit
  std::vector<cudaEvent_t> reduced_;   // (buckets,) on the reduce stream, W > 1
  float* reduce_scratch_ = nullptr;
  DeviceBuffer norm_mem_;         // the two GradNormResults and their scratch
  void* norm_compute_ = nullptr;  // GradNormResult, accumulated on the compute stream
  void* norm_reduce_ = nullptr;   // GradNormResult, accumulated on the reduce stream
  double* norm_scratch_compute_ = nullptr;
  double* norm_scratch_reduce_ = nullptr;
  cudaStream_t reduce_stream_ = nullptr;

  uint16_t* host_ = nullptr;
  ReadyFn on_ready_;
  PlaceFn place_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<bool> left_;  // guarded by mu_: (buckets,) landed on the host this pass
  std::deque<int> queue_;   // guarded by mu_: buckets for the reduce thread
  int pending_ = 0;         // guarded by mu_: buckets sent but not landed
  bool busy_ = false;       // guarded by mu_: the reduce thread is inside Reduce
  int64_t sent_ = 0;        // guarded by mu_
  absl::Status error_;      // guarded by mu_
  bool stop_ = false;       // guarded by mu_
  std::thread reduce_thread_;
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_ZERO_DEVICE_GRADIENT_BUCKETS_H_
