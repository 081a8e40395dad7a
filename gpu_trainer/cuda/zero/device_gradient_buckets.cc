#include "gpu_trainer/cuda/zero/device_gradient_buckets.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "gpu_trainer/cuda/kernels/convert.h"
#include "gpu_trainer/cuda/kernels/grad_norm.h"
#include "gpu_trainer/cuda/runtime/cuda_check.h"
#include "gpu_trainer/cuda/runtime/storage_type.h"
#include "model_spec/param_layout.h"

namespace offload {
namespace {

// Any NCCL communicator, one rank's too: with W = 1 the reduce-scatter is the identity and the
// path gives the single-rank bits, which is how one GPU tests it.
bool Reduces(const DeviceGradientBucketsOptions& o) { return o.collectives != nullptr; }

}  // namespace

int64_t DeviceReduceScratchBytes(const DeviceGradientBucketsOptions& options) {
  if (!Reduces(options)) return 0;
  return ReduceScratchElements(PlanBucketSlots(
             PlanGradientBuckets(options.config, options.padded_length, options.bucket_elements))) *
         int64_t{sizeof(float)};
}

DeviceGradientBuckets::DeviceGradientBuckets(const DeviceGradientBucketsOptions& options,
                                             cudaStream_t compute, DeviceToHostStaging* d2h,
                                             RegisteredFn registered)
    : options_(options), compute_(compute), d2h_(d2h), registered_(std::move(registered)) {}

absl::StatusOr<std::unique_ptr<DeviceGradientBuckets>> DeviceGradientBuckets::Create(
    const DeviceGradientBucketsOptions& options, void* area, float* reduce_scratch,
    DeviceToHostStaging* d2h, cudaStream_t compute, RegisteredFn registered) {
  if (options.dtype != DType::kFp16 && options.dtype != DType::kBf16) {
    return absl::InvalidArgumentError("gradient buckets hold 16-bit gradients only");
  }
  if (area == nullptr || d2h == nullptr) {
    return absl::InvalidArgumentError("gradient buckets need a device area and a copy ring");
  }
  if (options.padded_length < Gpt2NumParams(options.config)) {
    return absl::InvalidArgumentError("gradient buckets: padded_length below num_params");
  }
  if (Reduces(options) && reduce_scratch == nullptr) {
    return absl::InvalidArgumentError("gradient buckets over NCCL ranks need a reduce scratch");
  }
  std::unique_ptr<DeviceGradientBuckets> b(
      new DeviceGradientBuckets(options, compute, d2h, std::move(registered)));
  OFFLOAD_RETURN_IF_ERROR(b->Init(area, reduce_scratch));
  return b;
}

absl::Status DeviceGradientBuckets::Init(void* area, float* reduce_scratch) {
  const Gpt2Config& c = options_.config;
  buckets_ = PlanGradientBuckets(c, options_.padded_length, options_.bucket_elements);
  slots_ = PlanBucketSlots(buckets_);
  char* base = static_cast<char*>(area);
  const int num_buckets = static_cast<int>(buckets_.buckets.size());
  bucket_data_.assign(num_buckets, nullptr);
  for (int b = 0; b < num_buckets; ++b) {
    const int slot = slots_.of_bucket[b].slot;
    if (slot >= 0) bucket_data_[b] = base + slots_.of_bucket[b].offset * element_bytes_;
  }
  for (int u = 0; u < Gpt2NumUnits(c); ++u) {
    const int b = buckets_.bucket_of_unit[u];
    const int64_t into = Gpt2UnitRange(c, u).begin - buckets_.buckets[b].lo;
    unit_gradient_.push_back(static_cast<char*>(bucket_data_[b]) + into * element_bytes_);
  }
  released_units_.assign(num_buckets, 0);
  left_.assign(num_buckets, false);
  for (std::vector<cudaEvent_t>* events : {&complete_, &reduced_}) {
    events->assign(num_buckets, nullptr);
    for (cudaEvent_t& e : *events) {
      OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
  }
  reduce_scratch_ = reduce_scratch;
  // Two results and two scratches, so the compute stream's sums and the reduce stream's never
  // share memory.
  const int64_t scratch = GradNormScratchDoubles() * int64_t{sizeof(double)};
  const int64_t result = (int64_t{sizeof(GradNormResult)} + 255) / 256 * 256;
  OFFLOAD_RETURN_IF_ERROR(norm_mem_.Allocate(2 * (scratch + result), "gradient statistics"));
  BufferCarver carver(norm_mem_.data());
  norm_compute_ = carver.Take<GradNormResult>(1);
  norm_reduce_ = carver.Take<GradNormResult>(1);
  norm_scratch_compute_ = carver.Take<double>(GradNormScratchDoubles());
  norm_scratch_reduce_ = carver.Take<double>(GradNormScratchDoubles());
  if (Reduces(options_)) {
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&reduce_stream_, cudaStreamNonBlocking));
    if (!options_.reduce_on_caller) reduce_thread_ = std::thread([this] { ReduceLoop(); });
  }
  return absl::OkStatus();
}

DeviceGradientBuckets::~DeviceGradientBuckets() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (reduce_thread_.joinable()) reduce_thread_.join();
  d2h_->Drain().IgnoreError();  // no copy may outlive the slots' events
  if (reduce_stream_ != nullptr) {
    cudaStreamSynchronize(reduce_stream_);
    cudaStreamDestroy(reduce_stream_);
  }
  for (std::vector<cudaEvent_t>* events : {&complete_, &reduced_}) {
    for (cudaEvent_t e : *events) {
      if (e != nullptr) cudaEventDestroy(e);
    }
  }
}

void DeviceGradientBuckets::Begin(uint16_t* host_grads16, ReadyFn on_ready, PlaceFn place) {
  std::lock_guard<std::mutex> lock(mu_);
  host_ = host_grads16;
  on_ready_ = std::move(on_ready);
  place_ = std::move(place);
  std::fill(released_units_.begin(), released_units_.end(), 0);
  std::fill(left_.begin(), left_.end(), false);
  queue_.clear();
  pending_ = 0;
  sent_ = 0;
  error_ = absl::OkStatus();
  // Ordered before every accumulation on the same stream.
  cudaMemsetAsync(norm_compute_, 0, sizeof(GradNormResult), compute_);
  if (reduce_stream_ != nullptr) {
    cudaMemsetAsync(norm_reduce_, 0, sizeof(GradNormResult), reduce_stream_);
  }
}

absl::Status DeviceGradientBuckets::AcquireUnit(int unit) {
  const int b = buckets_.bucket_of_unit[unit];
  if (released_units_[b] > 0) return absl::OkStatus();  // the bucket is open already
  const int previous = slots_.of_bucket[b].previous;
  if (previous < 0) return absl::OkStatus();
  std::unique_lock<std::mutex> lock(mu_);
  // A copy that fails never lands, so the wait also looks at the ring's error now and then.
  while (!left_[previous] && error_.ok()) {
    if (cv_.wait_for(lock, std::chrono::milliseconds(5),
                     [&] { return left_[previous] || !error_.ok(); })) {
      break;
    }
    lock.unlock();
    absl::Status copy = d2h_->PeekError();
    lock.lock();
    if (!copy.ok() && error_.ok()) error_ = copy;
  }
  return error_;
}

absl::Status DeviceGradientBuckets::ReleaseUnit(int unit) {
  const int b = buckets_.bucket_of_unit[unit];
  if (++released_units_[b] < buckets_.buckets[b].units) return absl::OkStatus();
  return Send(b);
}

absl::Status DeviceGradientBuckets::Send(int b) {
  const GradientBucket& bucket = buckets_.buckets[b];
  if (!Reduces(options_)) {
    OFFLOAD_CUDA_RETURN_IF_ERROR(DispatchStorageType(options_.dtype, [&](auto zero) {
      using T = decltype(zero);
      return GradNormAccumulate<T>(static_cast<GradNormResult*>(norm_compute_),
                                   norm_scratch_compute_, static_cast<const T*>(bucket_data_[b]),
                                   bucket.size(), compute_);
    }));
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(complete_[b], compute_));
    CopyOut(b, bucket.lo, bucket.size(), bucket_data_[b], complete_[b]);
    return absl::OkStatus();
  }
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(complete_[b], compute_));
  {
    std::lock_guard<std::mutex> lock(mu_);
    OFFLOAD_RETURN_IF_ERROR(error_);
    ++pending_;
    ++sent_;
    if (!options_.reduce_on_caller) queue_.push_back(b);
  }
  if (options_.reduce_on_caller) {
    absl::Status s = Reduce(b);
    if (!s.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.ok()) error_ = s;
      --pending_;  // it never lands
    }
    return s;
  }
  cv_.notify_all();
  return absl::OkStatus();
}

void DeviceGradientBuckets::CopyOut(int b, int64_t offset, int64_t n, const void* src,
                                    cudaEvent_t after) {
  uint16_t* dst = place_ ? place_(offset, n) : nullptr;
  if (dst == nullptr) dst = host_ + offset;
  const int64_t bytes = n * element_bytes_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!Reduces(options_)) {
      ++pending_;
      ++sent_;
    }
  }
  d2h_->Copy(
      dst, src, bytes, after,
      [this, b, offset, n] {
        if (on_ready_) on_ready_(offset, n);
        Left(b);
      },
      registered_ && registered_(dst, bytes));
}

void DeviceGradientBuckets::Left(int b) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    left_[b] = true;
    --pending_;
  }
  cv_.notify_all();
}

void DeviceGradientBuckets::ReduceLoop() {
  cudaSetDevice(options_.device);
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    const int b = queue_.front();
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    absl::Status s = Reduce(b);
    lock.lock();
    busy_ = false;
    if (!s.ok()) {
      if (error_.ok()) error_ = s;
      // It never lands, nor do the buckets behind it: the communicator is broken.
      pending_ -= 1 + static_cast<int>(queue_.size());
      queue_.clear();
    }
    cv_.notify_all();
  }
}

absl::Status DeviceGradientBuckets::Reduce(int b) {
  const GradientBucket& bucket = buckets_.buckets[b];
  Collectives* collectives = options_.collectives;
  const int W = collectives->world_size();
  const int rank = collectives->rank();
  const int64_t P = options_.padded_length / W;
  // Widened to fp32 first, as the host-staged path reduces in fp32, so W ranks send what one
  // rank with the whole batch would, up to the order of the sums.
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(reduce_stream_, complete_[b], 0));
  OFFLOAD_CUDA_RETURN_IF_ERROR(DispatchStorageType(options_.dtype, [&](auto zero) {
    using T = decltype(zero);
    return ConvertToFloat<T>(reduce_scratch_, static_cast<const T*>(bucket_data_[b]), bucket.size(),
                             reduce_stream_);
  }));
  // NCCL runs on a stream of its own: the widened bucket must be there before it starts.
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(reduce_stream_));
  const std::vector<int64_t> counts = RankCounts(bucket.lo, bucket.hi, P, W);
  const int64_t mine_lo = std::max(bucket.lo, rank * P);
  const int64_t mine = counts[rank];
  float* out = reduce_scratch_ + (mine_lo - bucket.lo);  // (mine,)
  OFFLOAD_RETURN_IF_ERROR(collectives->ReduceScatter(reduce_scratch_, out, counts));
  if (mine == 0) {
    Left(b);
    return absl::OkStatus();
  }
  // The mean over ranks, rounded over this rank's piece of the slot, and its statistics.
  void* piece = static_cast<char*>(bucket_data_[b]) + (mine_lo - bucket.lo) * element_bytes_;
  OFFLOAD_CUDA_RETURN_IF_ERROR(DispatchStorageType(options_.dtype, [&](auto zero) {
    using T = decltype(zero);
    cudaError_t e = ConvertFromFloatScaled<T>(static_cast<T*>(piece), out,
                                              1.0f / static_cast<float>(W), mine, reduce_stream_);
    if (e != cudaSuccess) return e;
    return GradNormAccumulate<T>(static_cast<GradNormResult*>(norm_reduce_), norm_scratch_reduce_,
                                 static_cast<const T*>(piece), mine, reduce_stream_);
  }));
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(reduced_[b], reduce_stream_));
  CopyOut(b, mine_lo, mine, piece, reduced_[b]);
  return absl::OkStatus();
}

absl::StatusOr<DeviceGradientBuckets::Stats> DeviceGradientBuckets::Finish() {
  {
    // The reduce thread first: once its queue is empty and it is idle, every bucket it took has
    // its copy queued or has failed. Then the copies: each lands or fails.
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
  }
  absl::Status copies = d2h_->Drain();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!copies.ok() && error_.ok()) error_ = copies;
    OFFLOAD_RETURN_IF_ERROR(error_);
  }
  GradNormResult results[2] = {};
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&results[0], norm_compute_, sizeof(GradNormResult),
                                               cudaMemcpyDeviceToHost, compute_));
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_));
  if (reduce_stream_ != nullptr) {
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&results[1], norm_reduce_, sizeof(GradNormResult),
                                                 cudaMemcpyDeviceToHost, reduce_stream_));
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(reduce_stream_));
  }
  return Stats{results[0].sum_squares + results[1].sum_squares,
               results[0].nonfinite != 0 || results[1].nonfinite != 0};
}

void DeviceGradientBuckets::Abandon() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    // Buckets not yet taken are dropped: the other ranks would reduce them with other sizes.
    pending_ -= static_cast<int>(queue_.size());
    queue_.clear();
    cv_.wait(lock, [&] { return !busy_; });
  }
  d2h_->Drain().IgnoreError();
  if (reduce_stream_ != nullptr) cudaStreamSynchronize(reduce_stream_);
  cudaStreamSynchronize(compute_);
}

int64_t DeviceGradientBuckets::buckets_sent() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sent_;
}

}  // namespace offload
