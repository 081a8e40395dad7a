// Host <-> device traffic through a bounded ring of pinned buffers (ARCHITECTURE.md section 1).
//
// Pinning a whole partition is how users run out of host memory (pinned pages cannot be swapped
// or reclaimed), so a fixed budget of pinned memory, cut into chunk-sized slots, carries every
// transfer: the device-to-host side copies a chunk into a slot on its own stream, and a copy
// thread moves it from the slot into the pageable destination once its event fires, freeing the
// slot for the next chunk; the host-to-device side does the reverse. Transfers queue on their own
// streams, ordered after compute by events, so backward keeps computing while gradients leave.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_PINNED_STAGING_H_
#define OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_PINNED_STAGING_H_

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

namespace offload {

struct StagingOptions {
  int64_t budget_bytes = 64 << 20;  // pinned host memory of one direction
  int64_t chunk_bytes = 4 << 20;    // one slot; budget / chunk slots, at least 2
};

// Device -> host. Copy() returns at once; the copy thread calls `done` when the bytes are in
// the destination. Callbacks run in submission order, on the copy thread.
class DeviceToHostStaging {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceToHostStaging>> Create(const StagingOptions& options);
  ~DeviceToHostStaging();

  // Copies `bytes` from device `src` to pageable host `dst` once `after` (an event recorded on
  // the compute stream after src was written; may be nullptr) has fired. `src` must not change
  // until `done` runs. direct: `dst` is page-locked (cudaHostRegister'd or cudaHostAlloc'd), so
  // one cudaMemcpyAsync lands the bytes there, with no slot and no host memcpy; it still queues
  // and finishes in submission order with the others.
  void Copy(void* dst, const void* src, int64_t bytes, cudaEvent_t after,
            std::function<void()> done, bool direct = false);
  // Waits for every submitted copy; returns the first CUDA error since the last Drain.
  absl::Status Drain();
  // The first CUDA error since the last Drain, without waiting: a copy that failed never calls
  // its `done`, so a caller waiting for one checks this too.
  absl::Status PeekError();

  cudaStream_t stream() const { return stream_; }
  int64_t budget_bytes() const { return chunk_bytes_ * num_slots_; }

 private:
  struct Request {
    char* dst;
    const char* src;
    int64_t bytes;
    cudaEvent_t after;
    std::function<void()> done;
    bool direct;
  };
  // A pinned slot, or (buffer null) a direct copy's place in the order of retirement.
  struct Slot {
    char* buffer = nullptr;
    cudaEvent_t copied = nullptr;  // fires when the device -> slot copy is done
    char* dst = nullptr;           // where the slot's bytes go, nullptr when free
    int64_t bytes = 0;
    bool request_last = false;   // the last chunk of its request
    std::function<void()> done;  // the request's callback, on its last chunk
  };
  DeviceToHostStaging() = default;
  void Loop();
  absl::Status Retire(Slot& slot);

  // Direct copies in flight at once before the oldest must land.
  static constexpr int kDirectSlots = 16;

  int64_t chunk_bytes_ = 0;
  int num_slots_ = 0;  // pinned ones; slots_ holds kDirectSlots direct ones after them
  char* pinned_ = nullptr;
  std::vector<Slot> slots_;
  cudaStream_t stream_ = nullptr;
  int device_ = 0;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Request> queue_;  // guarded by mu_
  int64_t pending_ = 0;        // requests not yet done; guarded by mu_
  absl::Status error_;         // guarded by mu_
  bool stop_ = false;          // guarded by mu_
  std::thread thread_;
};

// Host -> device, synchronous for the caller: Copy() returns when every chunk is queued on the
// transfer stream and records `done_event` there, which the compute stream waits on. The caller
// memcpys into a slot only after that slot's previous transfer finished, so at most the budget
// is pinned whatever the size.
class HostToDeviceStaging {
 public:
  static absl::StatusOr<std::unique_ptr<HostToDeviceStaging>> Create(const StagingOptions& options);
  ~HostToDeviceStaging();

  // Copies `bytes` from pageable host `src` to device `dst`; `done_event` fires on stream() when
  // all of it has arrived. direct: `src` is page-locked, so one cudaMemcpyAsync reads it in place
  // (it must then not change until done_event fires).
  absl::Status Copy(void* dst, const void* src, int64_t bytes, cudaEvent_t done_event,
                    bool direct = false);

  cudaStream_t stream() const { return stream_; }

 private:
  HostToDeviceStaging() = default;
  int64_t chunk_bytes_ = 0;
  int num_slots_ = 0;
  char* pinned_ = nullptr;
  std::vector<cudaEvent_t> slot_free_;  // fires when the slot's last transfer has left it
  int next_slot_ = 0;
  cudaStream_t stream_ = nullptr;
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_PINNED_STAGING_H_
