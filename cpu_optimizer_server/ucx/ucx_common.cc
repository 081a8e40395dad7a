// The UCX plumbing both halves of the plane share (ucx_common.h): a context and worker with its
// progress thread, endpoints, active-message sends and memory registration.
#include "cpu_optimizer_server/ucx/ucx_common.h"

#include <poll.h>

#include <cstdlib>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace offload {
namespace ucx {

absl::Status UcsError(ucs_status_t status, const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", ucs_status_string(status)));
}

namespace {

// Whether UCX_TLS leaves UCX its TCP transport: unset, "all", a list naming tcp, or an exclusion
// ("^...") that does not.
bool TcpSelected() {
  const char* tls = std::getenv("UCX_TLS");
  if (tls == nullptr) return true;
  const absl::string_view list(tls);
  const bool names_tcp = absl::StrContains(list, "tcp");
  if (absl::StartsWith(list, "^")) return !names_tcp;
  return names_tcp || absl::StrContains(list, "all");
}

}  // namespace

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create(const std::string& net_devices) {
  std::unique_ptr<Worker> w(new Worker());
  w->net_devices_ = net_devices;
  ucp_config_t* config = nullptr;
  // UCX_TLS and the other UCX_* variables are read here.
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return UcsError(s, "ucp_config_read");
  // Defaults for bulk partitions, each kept only where the environment does not set it.
  struct Default {
    const char* env;  // the variable that overrides it
    const char* key;  // as ucp_config_modify takes it (a transport's key without its prefix)
    const char* value;
    bool tcp_only;  // a key of the TCP transport, which UCX calls invalid where TCP is left out
  };
  static constexpr Default kDefaults[] = {
      // The worker is shared by the progress thread and the posting threads
      // (UCS_THREAD_MODE_MULTI). UCX's default lock for that is a spinlock: a thread that posts
      // while the progress thread runs spins on a core the transfer needs. A mutex sleeps instead:
      // UCX over TCP moved a partition in 0.78 of the TCP bound with it against 0.67 without
      // (bench_transport, docs/PERFORMANCE.md).
      {"UCX_USE_MT_MUTEX", "USE_MT_MUTEX", "y", false},
      // UCX's TCP transport moves a message in segments of 8 KiB out and 64 KiB in by default,
      // a system call and a wake-up each; a 4 MiB chunk is then 512 sends. With 512 KiB and 1 MiB
      // segments UCX over TCP moved a partition in 0.81-0.91 of the TCP bound against 0.58-0.65
      // (bench_transport, docs/PERFORMANCE.md). Buffers of this size are per endpoint.
      {"UCX_TCP_TX_SEG_SIZE", "TX_SEG_SIZE", "512k", true},
      {"UCX_TCP_RX_SEG_SIZE", "RX_SEG_SIZE", "1m", true},
  };
  for (const Default& d : kDefaults) {
    if (std::getenv(d.env) != nullptr || (d.tcp_only && !TcpSelected())) continue;
    s = ucp_config_modify(config, d.key, d.value);
    if (s != UCS_OK) {
      ucp_config_release(config);
      return UcsError(s, absl::StrCat("UCX ", d.key, "=", d.value));
    }
  }
  if (!net_devices.empty()) {
    // Only these network devices go into the worker address (shared memory is not affected).
    s = ucp_config_modify(config, "NET_DEVICES", net_devices.c_str());
    if (s != UCS_OK) {
      ucp_config_release(config);
      return UcsError(s, absl::StrCat("UCX NET_DEVICES=", net_devices));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  s = ucp_init(&params, config, &w->context_);
  ucp_config_release(config);
  if (s != UCS_OK) return UcsError(s, "ucp_init");
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_MULTI;
  s = ucp_worker_create(w->context_, &wp, &w->worker_);
  if (s != UCS_OK) return UcsError(s, "ucp_worker_create");
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE;
  if (ucp_worker_query(w->worker_, &attr) == UCS_OK && attr.thread_mode != UCS_THREAD_MODE_MULTI) {
    return absl::FailedPreconditionError(
        "this UCX build has no multi-threaded workers (built without thread support)");
  }
  ucp_address_t* address = nullptr;
  size_t length = 0;
  s = ucp_worker_get_address(w->worker_, &address, &length);
  if (s != UCS_OK) return UcsError(s, "ucp_worker_get_address");
  w->address_.assign(reinterpret_cast<const char*>(address), length);
  ucp_worker_release_address(w->worker_, address);
  // Without an event fd (a transport without wake-up support) the thread polls with short sleeps.
  if (ucp_worker_get_efd(w->worker_, &w->efd_) != UCS_OK) w->efd_ = -1;
  return w;
}

Worker::~Worker() {
  if (thread_.joinable()) {
    stop_ = true;
    Wake();
    thread_.join();
  }
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
}

absl::Status Worker::SetAmHandler(uint16_t id, ucp_am_recv_callback_t cb, void* arg) {
  ucp_am_handler_param_t p{};
  p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                 UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  p.id = id;
  p.cb = cb;
  p.arg = arg;
  p.flags = UCP_AM_FLAG_WHOLE_MSG;
  ucs_status_t s = ucp_worker_set_am_recv_handler(worker_, &p);
  if (s != UCS_OK) return UcsError(s, "ucp_worker_set_am_recv_handler");
  return absl::OkStatus();
}

void Worker::Start() {
  thread_ = std::thread([this] { Loop(); });
}

void Worker::Loop() {
  while (!stop_.load(std::memory_order_relaxed)) {
    while (ucp_worker_progress(worker_) != 0) {
    }
    if (efd_ < 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      continue;
    }
    const ucs_status_t s = ucp_worker_arm(worker_);
    if (s == UCS_ERR_BUSY) continue;  // events arrived meanwhile: progress again
    pollfd pfd{efd_, POLLIN, 0};
    // The timeout only bounds a missed wake-up; posting threads call Wake().
    poll(&pfd, 1, /*timeout_ms=*/5);
  }
}

absl::StatusOr<ucp_ep_h> Worker::Connect(const std::string& peer_address,
                                         ucp_err_handler_cb_t on_error, void* arg) {
  if (peer_address.empty()) return absl::InvalidArgumentError("empty UCX worker address");
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                 UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.address = reinterpret_cast<const ucp_address_t*>(peer_address.data());
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = on_error;
  p.err_handler.arg = arg;
  ucp_ep_h ep = nullptr;
  ucs_status_t s = UCS_ERR_UNREACHABLE;
  if (!no_peer_error_handling_) s = ucp_ep_create(worker_, &p, &ep);
  if (s == UCS_ERR_UNREACHABLE) {
    no_peer_error_handling_ = true;  // UCX logs the refusal once per worker, not per endpoint
    // UCX 1.13's shared-memory transports (posix, sysv) have no peer failure handling, so with
    // UCX_TLS=sm,self a PEER endpoint finds no transport at all. Fall back to no error handling:
    // the death of the peer is still noticed through the Attach stream, and teardown force-closes
    // the endpoint, cancelling whatever was in flight.
    p.field_mask &= ~UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    s = ucp_ep_create(worker_, &p, &ep);
  }
  if (s != UCS_OK) return UcsError(s, "ucp_ep_create");
  Wake();
  return ep;
}

void Worker::Close(ucp_ep_h ep) {
  if (ep == nullptr) return;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
  if (r == nullptr || UCS_PTR_IS_ERR(r)) return;
  Wake();
  // The progress thread completes it; a forced close does not wait for the peer.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (ucp_request_check_status(r) == UCS_INPROGRESS && absl::Now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ucp_request_free(r);
}

// One posted send: what must outlive it.
struct SendOp {
  Header header;
  std::shared_ptr<Inflight> inflight;
  std::string payload;  // SendOwned's
};

namespace {

void OnSent(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<SendOp*>(user_data);
  op->inflight->Done(status);
  delete op;
  ucp_request_free(request);
}

}  // namespace

absl::Status Worker::SendOwned(ucp_ep_h ep, uint16_t id, const Header& header, std::string payload,
                               const std::shared_ptr<Inflight>& inflight) {
  auto* op = new SendOp{header, inflight, std::move(payload)};
  return Post(ep, id, op, op->payload.data(), op->payload.size(), nullptr);
}

absl::Status Worker::Send(ucp_ep_h ep, uint16_t id, const Header& header, const void* data,
                          size_t bytes, const std::shared_ptr<Inflight>& inflight, ucp_mem_h memh) {
  // The header must outlive the operation (UCX 1.13 has no COPY_HEADER flag).
  return Post(ep, id, new SendOp{header, inflight, std::string()}, data, bytes, memh);
}

absl::Status Worker::Post(ucp_ep_h ep, uint16_t id, SendOp* op, const void* data, size_t bytes,
                          ucp_mem_h memh) {
  const std::shared_ptr<Inflight> inflight = op->inflight;
  inflight->Add();
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = OnSent;
  p.user_data = op;
  p.flags = bytes > kRndvThreshold ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER;
  if (memh != nullptr) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    p.memh = memh;
  }
  ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, &op->header, sizeof(Header), data, bytes, &p);
  if (r == nullptr) {
    inflight->Done(UCS_OK);
    delete op;
    return absl::OkStatus();
  }
  if (UCS_PTR_IS_ERR(r)) {
    inflight->Done(UCS_PTR_STATUS(r));
    delete op;
    return UcsError(UCS_PTR_STATUS(r), "ucp_am_send_nbx");
  }
  Wake();  // the progress thread moves the rest (rendezvous, TCP back-pressure)
  return absl::OkStatus();
}

MemMap::MemMap(ucp_context_h context, void* address, size_t length) {
  ucp_mem_map_params_t p{};
  p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  p.address = address;
  p.length = length;
  if (ucp_mem_map(context, &p, &memh_) == UCS_OK) {
    context_ = context;
  } else {
    memh_ = nullptr;  // sends still work, registering per operation (through the rcache)
  }
}

MemMap::~MemMap() {
  if (memh_ != nullptr) ucp_mem_unmap(context_, memh_);
}

}  // namespace ucx

}  // namespace offload
