#include "gpu_trainer/cuda/runtime/pinned_staging.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "gpu_trainer/cuda/runtime/cuda_check.h"

namespace offload {
namespace {

absl::Status ValidateStaging(const StagingOptions& o) {
  if (o.chunk_bytes <= 0 || o.budget_bytes < 2 * o.chunk_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("pinned staging: budget ", o.budget_bytes,
                                                   " bytes must hold at least two chunks of ",
                                                   o.chunk_bytes, " bytes"));
  }
  return absl::OkStatus();
}

// Pinned memory for `slots` chunks, one allocation.
absl::Status AllocatePinned(int64_t bytes, char** pinned) {
  void* p = nullptr;
  const cudaError_t error = cudaHostAlloc(&p, static_cast<size_t>(bytes), cudaHostAllocDefault);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot pin ", bytes >> 20,
                     " MiB of host memory for staging: ", cudaGetErrorString(error)));
  }
  *pinned = static_cast<char*>(p);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceToHostStaging>> DeviceToHostStaging::Create(
    const StagingOptions& options) {
  OFFLOAD_RETURN_IF_ERROR(ValidateStaging(options));
  std::unique_ptr<DeviceToHostStaging> staging(new DeviceToHostStaging());
  DeviceToHostStaging& d = *staging;
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaGetDevice(&d.device_));
  d.chunk_bytes_ = options.chunk_bytes;
  d.num_slots_ = static_cast<int>(options.budget_bytes / options.chunk_bytes);
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&d.stream_, cudaStreamNonBlocking));
  OFFLOAD_RETURN_IF_ERROR(AllocatePinned(d.chunk_bytes_ * d.num_slots_, &d.pinned_));
  d.slots_.resize(d.num_slots_ + kDirectSlots);
  for (int i = 0; i < d.num_slots_ + kDirectSlots; ++i) {
    if (i < d.num_slots_) d.slots_[i].buffer = d.pinned_ + i * d.chunk_bytes_;
    OFFLOAD_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&d.slots_[i].copied, cudaEventDisableTiming));
  }
  d.thread_ = std::thread([&d] { d.Loop(); });
  return staging;
}

DeviceToHostStaging::~DeviceToHostStaging() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  for (Slot& slot : slots_) {
    if (slot.copied != nullptr) cudaEventDestroy(slot.copied);
  }
  if (pinned_ != nullptr) cudaFreeHost(pinned_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void DeviceToHostStaging::Copy(void* dst, const void* src, int64_t bytes, cudaEvent_t after,
                               std::function<void()> done, bool direct) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(Request{static_cast<char*>(dst), static_cast<const char*>(src), bytes, after,
                             std::move(done), direct});
    ++pending_;
  }
  cv_.notify_all();
}

absl::Status DeviceToHostStaging::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return pending_ == 0; });
  return std::exchange(error_, absl::OkStatus());
}

absl::Status DeviceToHostStaging::PeekError() {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

// Waits for the slot's copy, moves its bytes to their destination, frees the slot, and finishes
// its request if this was the request's last chunk. Runs on the copy thread only.
absl::Status DeviceToHostStaging::Retire(Slot& slot) {
  absl::Status status;
  const cudaError_t error = cudaEventSynchronize(slot.copied);
  if (error != cudaSuccess) {
    status = CudaErrorStatus(error, "cudaEventSynchronize(slot)", __FILE__, __LINE__);
  } else if (slot.buffer != nullptr) {  // a direct copy is already where it goes
    std::memcpy(slot.dst, slot.buffer, static_cast<size_t>(slot.bytes));
  }
  std::function<void()> done = std::move(slot.done);
  slot.done = nullptr;
  slot.dst = nullptr;
  // A failed request still counts as finished so Drain returns, with the error.
  if (done && status.ok()) done();
  return status;
}

void DeviceToHostStaging::Loop() {
  cudaSetDevice(device_);
  std::deque<int> in_flight;  // slot indices in submission order
  int next_slot = 0;
  int next_direct = 0;  // of the direct slots, [num_slots_, num_slots_ + kDirectSlots)
  auto finish = [&](const absl::Status& status, bool request_done) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!status.ok() && error_.ok()) error_ = status;
    if (request_done) --pending_;
    cv_.notify_all();
  };
  auto retire_oldest = [&] {
    Slot& slot = slots_[in_flight.front()];
    in_flight.pop_front();
    const bool request_done = slot.request_last;
    finish(Retire(slot), request_done);
  };
  for (;;) {
    Request request;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty() || !in_flight.empty(); });
      if (queue_.empty()) {
        if (in_flight.empty()) return;  // stop_ with nothing left
        lock.unlock();
        retire_oldest();  // nothing new: finish what is in flight, oldest first
        continue;
      }
      request = std::move(queue_.front());
      queue_.pop_front();
    }
    absl::Status status;
    if (request.after != nullptr) {
      const cudaError_t error = cudaStreamWaitEvent(stream_, request.after, 0);
      if (error != cudaSuccess) {
        status = CudaErrorStatus(error, "cudaStreamWaitEvent(after)", __FILE__, __LINE__);
      }
    }
    if (request.bytes == 0 || !status.ok()) {
      // Nothing to copy: finish in order behind what is in flight.
      while (!in_flight.empty()) retire_oldest();
      if (status.ok() && request.done) request.done();
      finish(status, /*request_done=*/true);
      continue;
    }
    // A direct request is one chunk of its whole size, copied straight to its destination.
    const int64_t chunk = request.direct ? request.bytes : chunk_bytes_;
    for (int64_t offset = 0; offset < request.bytes; offset += chunk) {
      const int64_t n = std::min(chunk, request.bytes - offset);
      const int index = request.direct ? num_slots_ + next_direct : next_slot;
      Slot& slot = slots_[index];
      // Round robin within each kind; with both kinds in flight the busy slot need not be the
      // oldest, so retire in order until it is free.
      while (slot.dst != nullptr) retire_oldest();
      cudaError_t error =
          cudaMemcpyAsync(request.direct ? request.dst : slot.buffer, request.src + offset,
                          static_cast<size_t>(n), cudaMemcpyDeviceToHost, stream_);
      if (error == cudaSuccess) error = cudaEventRecord(slot.copied, stream_);
      if (error != cudaSuccess) cudaGetLastError();
      slot.dst = request.dst + offset;
      slot.bytes = n;
      slot.request_last = offset + n >= request.bytes;
      if (slot.request_last) slot.done = std::move(request.done);
      if (error != cudaSuccess) {
        // The event will not fire for this chunk: give the slot up, and let the chunks before it
        // land first, so Drain never returns while a copy still writes into a destination.
        slot.dst = nullptr;
        slot.done = nullptr;
        while (!in_flight.empty()) retire_oldest();
        finish(CudaErrorStatus(error, "cudaMemcpyAsync(device to pinned)", __FILE__, __LINE__),
               slot.request_last);
        if (slot.request_last) break;
        continue;
      }
      in_flight.push_back(index);
      if (request.direct) {
        next_direct = (next_direct + 1) % kDirectSlots;
      } else {
        next_slot = (next_slot + 1) % num_slots_;
      }
    }
  }
}

absl::StatusOr<std::unique_ptr<HostToDeviceStaging>> HostToDeviceStaging::Create(
    const StagingOptions& options) {
  OFFLOAD_RETURN_IF_ERROR(ValidateStaging(options));
  std::unique_ptr<HostToDeviceStaging> staging(new HostToDeviceStaging());
  HostToDeviceStaging& h = *staging;
  h.chunk_bytes_ = options.chunk_bytes;
  h.num_slots_ = static_cast<int>(options.budget_bytes / options.chunk_bytes);
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&h.stream_, cudaStreamNonBlocking));
  OFFLOAD_RETURN_IF_ERROR(AllocatePinned(h.chunk_bytes_ * h.num_slots_, &h.pinned_));
  h.slot_free_.resize(h.num_slots_, nullptr);
  for (cudaEvent_t& event : h.slot_free_) {
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  }
  return staging;
}

HostToDeviceStaging::~HostToDeviceStaging() {
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  for (cudaEvent_t event : slot_free_) {
    if (event != nullptr) cudaEventDestroy(event);
  }
  if (pinned_ != nullptr) cudaFreeHost(pinned_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status HostToDeviceStaging::Copy(void* dst, const void* src, int64_t bytes,
                                       cudaEvent_t done_event, bool direct) {
  if (direct) {
    OFFLOAD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, stream_));
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(done_event, stream_));
    return absl::OkStatus();
  }
  for (int64_t offset = 0; offset < bytes; offset += chunk_bytes_) {
    const int64_t n = std::min(chunk_bytes_, bytes - offset);
    char* slot = pinned_ + next_slot_ * chunk_bytes_;
    // The slot's previous transfer must have left it before the host overwrites it; an event
    // never recorded counts as fired.
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(slot_free_[next_slot_]));
    std::memcpy(slot, static_cast<const char*>(src) + offset, static_cast<size_t>(n));
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<char*>(dst) + offset, slot,
                                                 static_cast<size_t>(n), cudaMemcpyHostToDevice,
                                                 stream_));
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot_free_[next_slot_], stream_));
    next_slot_ = (next_slot_ + 1) % num_slots_;
  }
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(done_event, stream_));
  return absl::OkStatus();
}

}  // namespace offload
