// Pieces shared by the two sides of the UCX data plane (ucx_transport.cc, ucx_server.cc): the
// active-message header, a UCP context + worker with its progress thread, and tracking of
// in-flight sends. Private to those two files; the interface is ucx_transport.h.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_UCX_UCX_COMMON_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_UCX_UCX_COMMON_H_

#include <ucp/api/ucp.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace offload {
namespace ucx {

// Active-message ids: the shard handles kToShard, the trainer kToTrainer. Each side registers only
// its own, so a message can never reach the wrong handler.
constexpr uint16_t kToShardAm = 0x0f51;
constexpr uint16_t kToTrainerAm = 0x0f52;

// Payloads above this go rendezvous (UCP_AM_SEND_FLAG_RNDV): the receiver pulls them straight into
// their destination, zero-copy where the transport has RDMA (or CMA for shared memory); at or
// below it they go eager, which costs a copy but no extra round trip. 64 KiB is where a round
// trip starts to cost less than the copy on the transports we target.
constexpr size_t kRndvThreshold = size_t{64} << 10;

enum class Kind : uint32_t {
  // trainer -> shard
  kOpen = 1,  // step
  kGrad = 2,  // offset, dtype (v1::DType), accumulate; payload: the gradient bytes
  // step, lr, grad_multiplier, skip, n = the number of group lrs; payload: the n group lrs, fp64
  // each, then the range steps, a RangeStep record (range_steps.h) each, to the payload's end.
  kCommit = 3,
  kAbandon = 4,
  kPing = 5,  // probe round trip
  // The update during backward: step, offset (flat), n, lr, grad_multiplier; payload: t (uint64,
  // 0: the range's next step), then the group lrs, fp64 each, to the payload's end.
  kUpdate = 6,
  // shard -> trainer
  kOpened = 16,  // the OPEN succeeded
  kParams = 17,  // offset (flat), n; payload: n 16-bit parameters
  kResult = 18,  // payload: serialized v1::StepResult
  kError = 19,   // code (absl::StatusCode); payload: the message
  kPong = 20,
};

// Fixed-size, little-endian (both ends are the same build on x86/arm64 Linux).
struct Header {
  uint64_t session_id = 0;  // UcxOffer.session_id of the attachment
  uint64_t stream_id = 0;   // one per StepStream within the attachment
  uint32_t kind = 0;
  uint32_t dtype = 0;
  uint64_t offset = 0;
  int64_t n = 0;
  uint64_t step = 0;
  double lr = 0;
  float grad_multiplier = 0;
  uint8_t accumulate = 0;
  uint8_t skip = 0;
  uint8_t reserved[2] = {0, 0};
  int32_t code = 0;
};

// Counts operations in flight and remembers the first failure. Shared (shared_ptr) with the
// completion callbacks, so it outlives whoever gave up waiting on it.
class Inflight {
 public:
  void Add() {
    std::lock_guard<std::mutex> lock(mu_);
    ++count_;
  }
  void Done(ucs_status_t status) {
    std::lock_guard<std::mutex> lock(mu_);
    --count_;
    if (status != UCS_OK && error_ == UCS_OK) error_ = status;
    cv_.notify_all();
  }
  // Waits until nothing is in flight; gives up (false) when give_up() turns true (checked every
  // `poll`) or at `deadline`.
  bool WaitIdle(absl::Duration poll, absl::Time deadline, const std::function<bool()>& give_up) {
    std::unique_lock<std::mutex> lock(mu_);
    while (count_ > 0) {
      if (give_up() || absl::Now() >= deadline) return false;
      cv_.wait_for(lock, absl::ToChronoNanoseconds(poll));
    }
    return true;
  }
  ucs_status_t error() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t count_ = 0;
  ucs_status_t error_ = UCS_OK;
};

struct SendOp;

// A UCP context and one worker, progressed by a thread of its own. The worker is created with
// UCS_THREAD_MODE_MULTI because the callers' threads post sends and create endpoints while the
// progress thread runs it; the progress thread sleeps on the worker's event fd between events
// (UCP_FEATURE_WAKEUP), so an idle plane burns no core, and posting threads wake it.
class Worker {
 public:
  // `net_devices`: UCX's NET_DEVICES for this context (net_route.h's NetDevicesFor); empty
  // leaves UCX's own (UCX_NET_DEVICES, else all).
  static absl::StatusOr<std::unique_ptr<Worker>> Create(const std::string& net_devices = "");
  ~Worker();  // stops the progress thread, then destroys worker and context

  // Registers the active-message handler of `id` (before Start).
  absl::Status SetAmHandler(uint16_t id, ucp_am_recv_callback_t cb, void* arg);
  void Start();
  void Wake() { ucp_worker_signal(worker_); }

  ucp_worker_h worker() const { return worker_; }
  ucp_context_h context() const { return context_; }
  const std::string& address() const { return address_; }
  const std::string& net_devices() const { return net_devices_; }

  // An endpoint to a peer worker address, with peer error handling: `on_error` is called (on the
  // progress thread) when the peer goes away. Where no transport offers peer error handling (the
  // shared-memory ones in UCX 1.13), the endpoint has none and the Attach stream is the only
  // witness of the peer's death. So a PEER endpoint to a peer on this host goes over TCP unless
  // UCX_TLS leaves UCX nothing but shared memory: an endpoint without peer error handling is not
  // safe to ask for by default, since UCX aborts the whole process when its CMA copy finds the
  // peer gone (uct_cma_ep_tx, "process_vm_readv ... No such process": a trainer killed mid-step
  // took its server down; docs/PERFORMANCE.md, issue 45).
  absl::StatusOr<ucp_ep_h> Connect(const std::string& peer_address, ucp_err_handler_cb_t on_error,
                                   void* arg);
  // Closes with UCP_EP_CLOSE_FLAG_FORCE (outstanding operations complete as cancelled) and waits
  // for the close to finish, at most a few seconds.
  void Close(ucp_ep_h ep);

  // Posts an active message. The header is copied and kept until the send completes; `data` must
  // stay valid until `inflight` says so. Rendezvous above kRndvThreshold.
  absl::Status Send(ucp_ep_h ep, uint16_t id, const Header& header, const void* data, size_t bytes,
                    const std::shared_ptr<Inflight>& inflight, ucp_mem_h memh = nullptr);
  // As Send, with a payload the operation owns until it completes, so the caller may return
  // before it does (a commit's few group lrs).
  absl::Status SendOwned(ucp_ep_h ep, uint16_t id, const Header& header, std::string payload,
                         const std::shared_ptr<Inflight>& inflight);

 private:
  Worker() = default;
  void Loop();
  // Posts `op` (owned from here on, freed when the send completes) with its payload.
  absl::Status Post(ucp_ep_h ep, uint16_t id, SendOp* op, const void* data, size_t bytes,
                    ucp_mem_h memh);

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  std::string net_devices_;
  int efd_ = -1;
  std::atomic<bool> no_peer_error_handling_{false};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// A buffer registered with ucp_mem_map for the lifetime of this object.
class MemMap {
 public:
  MemMap() = default;
  MemMap(ucp_context_h context, void* address, size_t length);
  ~MemMap();
  MemMap(const MemMap&) = delete;
  MemMap& operator=(const MemMap&) = delete;
  ucp_mem_h get() const { return memh_; }

 private:
  ucp_context_h context_ = nullptr;
  ucp_mem_h memh_ = nullptr;
};

absl::Status UcsError(ucs_status_t status, const std::string& what);

}  // namespace ucx
}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_UCX_UCX_COMMON_H_
