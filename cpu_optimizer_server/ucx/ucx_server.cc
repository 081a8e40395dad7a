// The shard side of the UCX data plane (ucx_transport.h).
//
// Threading: one UCP context and worker per network device set, each progressed by its own thread
// (ucx_common.h). By default an attachment is served by the worker that offers only the interface
// routing to the trainer (net_route.h), made on first use; with UCX_NET_DEVICES or
// --ucx_net_devices set, or when no route is found, by the one worker made at start. The
// active-message handler runs on that thread and only queues: eager payloads are copied into a
// string the StepSession then owns, rendezvous payloads are received (ucp_am_recv_data_nbx)
// straight into the attachment's registered gradient area at their place (16-bit chunks; others
// into such a string), and the command becomes ready when the data has landed. Each
// attachment's commands run in order on its Serve thread (the gRPC handler thread), so a commit's
// Adam pass never stalls the progress of other attachments. The worker is UCS_THREAD_MODE_MULTI
// since the Serve threads post their replies directly.
//
// Sessions exist only for Attach streams the service let in (shard_access.h), and their ids are
// 64 random bits: a message whose id no authenticated Attach set up is dropped, and one cannot be
// guessed into another's session.
//
// Errors follow OptimizerService::Step: the same StepSession calls, the same statuses. A refused
// chunk ends that step (its session is dropped, as when the gRPC handler returns) and the error is
// sent at once and again to the commit.
#include "cpu_optimizer_server/ucx/ucx_server.h"

#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/dtype_proto.h"
#include "base/grpc_status.h"
#include "base/logging.h"
#include "base/security/security.h"
#include "base/status_macros.h"
#include "cpu_optimizer_server/shard/param_groups.h"
#include "cpu_optimizer_server/shard/server_metrics.h"
#include "cpu_optimizer_server/shard/step_session.h"
#include "cpu_optimizer_server/ucx/net_route.h"
#include "cpu_optimizer_server/ucx/ucx_common.h"

namespace offload {
namespace {

using ucx::Header;
using ucx::Kind;

// Offsets on the wire are uint64; as OptimizerService does, clamp so sums stay in int64 while
// still lying outside every range.
int64_t WireOffset(uint64_t offset) {
  constexpr uint64_t kMax = uint64_t{1} << 62;
  return static_cast<int64_t>(offset > kMax ? kMax : offset);
}

struct Command {
  Header header;
  std::string data;
  // A 16-bit gradient chunk received straight into the session's gradient area, at its
  // range-relative place (data stays empty); null otherwise.
  const char* view = nullptr;
  bool ready = false;
  absl::Status status;  // the payload could not be received
};

// A buffer of waves going back to the trainer: kWaveSlots per attachment, registered once
// (ucp_mem_map) and reused by every step; a slot is refilled only when its send is done.
struct Slot {
  std::vector<char> buffer;
  std::unique_ptr<ucx::MemMap> memh;
  std::shared_ptr<ucx::Inflight> inflight = std::make_shared<ucx::Inflight>();
  int64_t offset = 0;
  int64_t n = 0;
};

// Waves in flight back to the trainer. Each is a rendezvous (its request, the trainer's pull, the
// acknowledgement), so with two, one wave's round trip stalls the next across a real network:
// over a veth, UCX over TCP moved the parameters out at 0.6 of gRPC's rate with two. Eight keep
// the link busy for 8 waves of registered memory per attachment: 32 MiB with the store's default
// wave of 2M parameters.
constexpr int kWaveSlots = 8;

struct Session {
  uint64_t id = 0;
  ucx::Worker* worker = nullptr;  // the one `ep` is on
  int64_t max_payload = 0;        // bytes: the range in fp32 (the largest valid chunk)
  ucp_ep_h ep = nullptr;
  Slot slots[kWaveSlots];  // used by the Serve thread only

  // The range's 16-bit gradients, (range length,), registered once: rendezvous gradient chunks
  // land here at their place and the step reads them in place (StepSession::AddGradientsView),
  // with no allocation or copy per chunk. Empty for a probe, or when the memory budget has no
  // room (chunks then arrive into strings, as eager ones always do).
  std::vector<char> grad_area;
  std::unique_ptr<ucx::MemMap> grad_memh;
  Reservation grad_area_bytes;
  int64_t range_offset = 0;
  int64_t range_length = 0;

  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<Command>> queue;
  // Commits that arrived and have not finished. From a commit's arrival until it is done, chunks
  // go into strings, not the area: a step's own chunks arrive before its commit, so nothing a
  // trainer sends after it, in any order, changes the gradients the commit reads.
  int commits_pending = 0;
  bool stream_ended = false;
  bool peer_failed = false;
  std::string why;
};

struct DataRecv {
  std::shared_ptr<Session> session;
  std::shared_ptr<Command> command;
};

// Where in the session's gradient area a rendezvous chunk of `length` bytes lands, or null when it
// goes into a string: an area, a 16-bit chunk that is not accumulated, inside the range, and no
// commit reading the area. Under s->mu.
char* AreaFor(Session& s, const Header& h, size_t length) {
  if (s.grad_area.empty() || s.commits_pending > 0 ||
      h.kind != static_cast<uint32_t>(Kind::kGrad) || h.accumulate != 0) {
    return nullptr;
  }
  if (h.dtype != v1::DTYPE_FP16 && h.dtype != v1::DTYPE_BF16) return nullptr;
  const int64_t begin = WireOffset(h.offset) - s.range_offset;
  if (begin < 0 || h.n <= 0 || static_cast<int64_t>(length) != h.n * 2 ||
      h.n > s.range_length - begin) {
    return nullptr;  // the session refuses it with the reason; it was never in the area
  }
  return s.grad_area.data() + begin * 2;
}

class UcxServer;

// A worker and what its active-message handler needs to know.
struct Plane {
  UcxServer* server = nullptr;
  std::unique_ptr<ucx::Worker> worker;
};

class UcxServer final : public DataPlaneServer {
 public:
  UcxServer(ShardStore* store, const UcxOptions& options) : store_(store), options_(options) {}
  ~UcxServer() override {
    // Sessions (their registrations) go before the contexts, and the workers' progress threads
    // stop while the mutex their handlers take is still there.
    std::map<uint64_t, std::shared_ptr<Session>> sessions;
    {
      std::lock_guard<std::mutex> lock(mu_);
      sessions.swap(sessions_);
    }
    sessions.clear();
    std::lock_guard<std::mutex> lock(planes_mu_);
    planes_.clear();
  }

  // The worker for every attachment when the devices are fixed (UCX_NET_DEVICES, or
  // options.net_devices other than auto), else for those whose route is not found: made now, so
  // that a UCX that cannot work fails the start.
  absl::Status Init() {
    const bool fixed = (!options_.net_devices.empty() && options_.net_devices != "auto") ||
                       std::getenv("UCX_NET_DEVICES") != nullptr;
    routed_ = !fixed;
    fixed_devices_ = fixed && options_.net_devices != "auto" ? options_.net_devices : "";
    return PlaneFor(fixed_devices_).status();
  }

  v1::DataPlane plane() const override { return v1::DATA_PLANE_UCX; }
  grpc::Status Serve(const v1::AttachOpen& open, grpc::ServerContext* context,
                     AttachStream* stream) override;

 private:
  class ParamSinkImpl;
  struct Steps;  // the Serve thread's view of an attachment's step streams

  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data,
                           size_t length, const ucp_am_recv_param_t* param);
  static void OnDataReceived(void* request, ucs_status_t status, size_t length, void* user_data);
  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status);

  void Reply(Session* s, const Header& request, Kind kind, const std::string& payload = "",
             int32_t code = 0);
  void ReplyError(Session* s, const Header& request, const absl::Status& status) {
    Reply(s, request, Kind::kError, std::string(status.message()),
          static_cast<int32_t>(status.code()));
  }
  void Execute(Session* s, Steps* steps, Command* c, const std::string& job_id,
               uint32_t range_index);
  // The worker offering `net_devices` (Worker::Create's), made and started on first use.
  absl::StatusOr<ucx::Worker*> PlaneFor(const std::string& net_devices);

  ShardStore* const store_;
  const UcxOptions options_;
  bool routed_ = true;         // a worker per route to the trainers (Init)
  std::string fixed_devices_;  // otherwise the devices of the one worker
  std::mutex planes_mu_;
  std::map<std::string, std::unique_ptr<Plane>> planes_;  // by net_devices

  std::mutex mu_;  // held by the AM handler for its whole run
  std::map<uint64_t, std::shared_ptr<Session>> sessions_;
};

// A fresh session id: random, non-zero, and not one in use (callers hold mu_).
absl::StatusOr<uint64_t> NewSessionId(const std::map<uint64_t, std::shared_ptr<Session>>& in_use) {
  for (;;) {
    uint64_t id = 0;
    OFFLOAD_RETURN_IF_ERROR(ReadRandom(&id, sizeof(id)));
    if (id != 0 && in_use.count(id) == 0) return id;
  }
}

struct UcxServer::Steps {
  std::map<uint64_t, std::unique_ptr<StepSession>> open;
  std::map<uint64_t, absl::Status> failed;  // recent refused streams: the error, for the commit
  void Fail(uint64_t id, const absl::Status& status) {
    open.erase(id);
    failed[id] = status;
    if (failed.size() > 64) failed.erase(failed.begin());
  }
};

// Sends each wave as one PARAMS active message from the attachment's slot buffers, taken in turn,
// so up to kWaveSlots waves travel at once (the sink's two slots name the current ones).
class UcxServer::ParamSinkImpl final : public ParamSink {
 public:
  ParamSinkImpl(UcxServer* server, Session* session, uint64_t stream_id)
      : server_(server), session_(session), stream_id_(stream_id) {}
  ~ParamSinkImpl() override { Drain(); }

  void* Buffer(int slot, int64_t offset, int64_t n) override {
    current_[slot] = next_;
    next_ = (next_ + 1) % kWaveSlots;
    Slot& s = session_->slots[current_[slot]];
    WaitSlot(&s);
    const size_t bytes = static_cast<size_t>(n) * 2;
    if (s.buffer.size() < bytes) {
      s.memh.reset();
      s.buffer.resize(bytes);
      s.memh = std::make_unique<ucx::MemMap>(session_->worker->context(), s.buffer.data(),
                                             s.buffer.size());
    }
    s.offset = offset;
    s.n = n;
    return s.buffer.data();
  }

  bool Send(int slot) override {
    Slot& s = session_->slots[current_[slot]];
    if (Failed()) return false;
    Header h;
    h.session_id = session_->id;
    h.stream_id = stream_id_;
    h.kind = static_cast<uint32_t>(Kind::kParams);
    h.offset = static_cast<uint64_t>(s.offset);
    h.n = s.n;
    ServerMetrics::Get().Sent(DataPlane::kUcx, s.n * 2);
    return session_->worker
        ->Send(session_->ep, ucx::kToTrainerAm, h, s.buffer.data(), s.n * 2, s.inflight,
               s.memh->get())
        .ok();
  }

  // Waits for every slot; false when the trainer is gone.
  bool Drain() {
    for (Slot& s : session_->slots) WaitSlot(&s);
    for (Slot& s : session_->slots) {
      if (s.inflight->error() != UCS_OK) return false;
    }
    return !Failed();
  }

 private:
  // The trainer is gone: its endpoint failed, or (where the endpoint has no peer error handling,
  // a trainer on this host over shared memory, whose sends to a dead peer never complete) its
  // Attach stream ended.
  bool Failed() {
    std::lock_guard<std::mutex> lock(session_->mu);
    return session_->peer_failed || session_->stream_ended;
  }
  void WaitSlot(Slot* s) {
    s->inflight->WaitIdle(server_->options_.poll_interval, absl::InfiniteFuture(),
                          [this] { return Failed(); });
  }

  UcxServer* const server_;
  Session* const session_;
  const uint64_t stream_id_;
  int current_[2] = {0, 0};  // the session slot behind each of the sink's two
  int next_ = 0;
};

void UcxServer::OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* s = static_cast<Session*>(arg);
  std::lock_guard<std::mutex> lock(s->mu);
  s->peer_failed = true;
  s->why = ucs_status_string(status);
  s->cv.notify_all();
}

void UcxServer::OnDataReceived(void* request, ucs_status_t status, size_t length, void* user_data) {
  auto* recv = static_cast<DataRecv*>(user_data);
  {
    std::lock_guard<std::mutex> lock(recv->session->mu);
    if (status != UCS_OK) {
      recv->command->status = ucx::UcsError(status, "receiving a gradient chunk");
    }
    recv->command->ready = true;
    recv->session->cv.notify_all();
  }
  delete recv;
  if (request != nullptr) ucp_request_free(request);
}

ucs_status_t UcxServer::OnAm(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param) {
  auto* plane = static_cast<Plane*>(arg);
  UcxServer* self = plane->server;
  if (header_length != sizeof(Header)) return UCS_OK;
  auto c = std::make_shared<Command>();
  std::memcpy(&c->header, header, sizeof(Header));
  std::lock_guard<std::mutex> lock(self->mu_);
  auto it = self->sessions_.find(c->header.session_id);
  if (it == self->sessions_.end()) return UCS_OK;  // an attachment already gone: dropped
  const std::shared_ptr<Session>& s = it->second;
  if (s->worker != plane->worker.get()) return UCS_OK;  // not where its attachment is: dropped
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  ucs_status_t ret = UCS_OK;
  if (c->header.kind == static_cast<uint32_t>(Kind::kCommit)) {
    std::lock_guard<std::mutex> session_lock(s->mu);
    ++s->commits_pending;  // the Serve thread counts it down when the commit has run
  }
  if (!rndv) {
    c->data.assign(static_cast<const char*>(data), length);
    c->ready = true;
  } else if (static_cast<int64_t>(length) > s->max_payload) {
    // Refused without receiving it; the step's error says why.
    c->status = absl::OutOfRangeError(absl::StrCat("gradient chunk of ", length,
                                                   " bytes is larger than the whole range (",
                                                   s->max_payload, " bytes in fp32)"));
    c->ready = true;
  } else {
    std::lock_guard<std::mutex> session_lock(s->mu);
    char* dest = AreaFor(*s, c->header, length);
    auto* recv = new DataRecv{s, c};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.recv_am = &UcxServer::OnDataReceived;
    p.user_data = recv;
    if (dest != nullptr) {
      c->view = dest;
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      p.memh = s->grad_memh->get();
    } else {
      c->data.resize(length);
      dest = c->data.data();
    }
    // Completes inline (the callback is not called) or later on this thread, which holds s->mu
    // meanwhile: the callback takes it, so it must not run before the lock is released.
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(plane->worker->worker(), data, dest, length, &p);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) {
      if (UCS_PTR_IS_ERR(r)) c->status = ucx::UcsError(UCS_PTR_STATUS(r), "ucp_am_recv_data_nbx");
      c->ready = true;
      delete recv;
    }
    ret = UCS_INPROGRESS;  // UCX owns the descriptor now
    s->queue.push_back(std::move(c));
    s->cv.notify_all();
    return ret;
  }
  std::lock_guard<std::mutex> session_lock(s->mu);
  s->queue.push_back(std::move(c));
  s->cv.notify_all();
  return ret;
}

void UcxServer::Reply(Session* s, const Header& request, Kind kind, const std::string& payload,
                      int32_t code) {
  Header h;
  h.session_id = s->id;
  h.stream_id = request.stream_id;
  h.kind = static_cast<uint32_t>(kind);
  h.code = code;
  h.step = request.step;
  // Replies are small: eager, so the payload is copied before Send returns... except that UCX may
  // still queue it, so it lives in a string owned by the completion.
  auto owned = std::make_shared<std::string>(payload);
  auto inflight = std::make_shared<ucx::Inflight>();
  s->worker->Send(s->ep, ucx::kToTrainerAm, h, owned->data(), owned->size(), inflight)
      .IgnoreError();
  // Wait for it: replies are rare (one per OPEN / error / commit) and this keeps `owned` alive.
  inflight->WaitIdle(options_.poll_interval, absl::Now() + absl::Seconds(30), [s] {
    std::lock_guard<std::mutex> lock(s->mu);
    return s->peer_failed || s->stream_ended;
  });
}

void UcxServer::Execute(Session* s, Steps* steps, Command* c, const std::string& job_id,
                        uint32_t range_index) {
  const Header& h = c->header;
  const uint64_t id = h.stream_id;
  switch (static_cast<Kind>(h.kind)) {
    case Kind::kPing:
      Reply(s, h, Kind::kPong);
      return;
    case Kind::kOpen: {
      if (job_id.empty()) {
        ReplyError(s, h, absl::FailedPreconditionError("a probe attachment carries no steps"));
        return;
      }
      if (steps->open.count(id) != 0) {
        ReplyError(s, h, absl::InvalidArgumentError("`open` sent twice in one stream"));
        return;
      }
      absl::StatusOr<std::unique_ptr<StepSession>> session =
          StepSession::Open(store_, job_id, range_index, h.step);
      if (!session.ok()) {
        steps->Fail(id, session.status());
        ReplyError(s, h, session.status());
        return;
      }
      steps->open[id] = *std::move(session);
      Reply(s, h, Kind::kOpened);
      return;
    }
    case Kind::kGrad: {
      auto it = steps->open.find(id);
      if (it == steps->open.end()) return;  // the step already failed (and said so) or ended
      absl::Status st = c->status;
      if (st.ok()) {
        absl::StatusOr<DType> dtype = DTypeFromProto(static_cast<v1::DType>(h.dtype), "grad.dtype");
        st = dtype.status();
        if (st.ok()) {
          const int64_t bytes = c->view != nullptr ? h.n * 2 : static_cast<int64_t>(c->data.size());
          st = c->view != nullptr
                   ? it->second->AddGradientsView(WireOffset(h.offset), *dtype, c->view, h.n)
                   : it->second->AddGradients(WireOffset(h.offset), *dtype, h.accumulate != 0,
                                              std::move(c->data));
          if (st.ok()) ServerMetrics::Get().Received(DataPlane::kUcx, bytes);
        }
      }
      if (!st.ok()) {
        steps->Fail(id, st);
        ReplyError(s, h, st);
      }
      return;
    }
    case Kind::kCommit: {
      auto it = steps->open.find(id);
      if (it == steps->open.end()) {
        auto f = steps->failed.find(id);
        ReplyError(s, h,
                   f != steps->failed.end()
                       ? f->second
                       : absl::FailedPreconditionError("commit of a step stream that is not open"));
        return;
      }
      std::unique_ptr<StepSession> session = std::move(it->second);
      steps->open.erase(it);
      StepCommitArgs args;
      args.step = h.step;
      args.lr = h.lr;
      args.grad_multiplier = h.grad_multiplier;
      args.skip = h.skip != 0;
      // The payload is h.n group lrs, then range steps. A refusal here ends the step as a
      // refused commit does.
      absl::Status payload = c->status;
      const size_t lr_bytes = h.n >= 0 && h.n <= kMaxParamGroups ? h.n * sizeof(double) : 0;
      if (payload.ok() && (h.n < 0 || h.n > kMaxParamGroups)) {
        payload = absl::InvalidArgumentError(absl::StrCat("commit carries ", h.n,
                                                          " group lrs; at most ", kMaxParamGroups,
                                                          " parameter groups are allowed"));
      } else if (payload.ok() && (c->data.size() < lr_bytes ||
                                  (c->data.size() - lr_bytes) % sizeof(RangeStep) != 0)) {
        payload = absl::InvalidArgumentError(absl::StrCat(
            "commit payload of ", c->data.size(), " bytes is not ", h.n,
            " fp64 lrs and a whole number of ", sizeof(RangeStep), "-byte range steps"));
      }
      if (!payload.ok()) {
        session.reset();  // the lease goes before the trainer hears of it
        ReplyError(s, h, payload);
        return;
      }
      args.group_lr.resize(h.n);
      if (!args.group_lr.empty()) std::memcpy(args.group_lr.data(), c->data.data(), lr_bytes);
      // Their values are the session's to check, as gRPC's are.
      args.range_steps.resize((c->data.size() - lr_bytes) / sizeof(RangeStep));
      if (!args.range_steps.empty()) {
        std::memcpy(args.range_steps.data(), c->data.data() + lr_bytes, c->data.size() - lr_bytes);
      }
      absl::StatusOr<StepOutcome> outcome;
      bool delivered;
      {
        ParamSinkImpl sink(this, s, id);
        outcome = session->Commit(args, &sink);
        delivered = sink.Drain();
      }

      // Release the range's lease before the trainer hears the result and opens the next step.
      session.reset();
      if (!outcome.ok()) {
        ReplyError(s, h, outcome.status());
        return;
      }
      if (outcome->receiver_gone || !delivered) return;  // nobody to tell
      v1::StepResult result;
      result.set_step(outcome->step);
      result.set_applied(outcome->applied);
      result.set_replayed(outcome->replayed);
      result.set_skipped(outcome->skipped);
      result.set_adam_step(outcome->adam_step);
      result.set_skipped_steps(outcome->skipped_steps);
      result.set_early_updated(outcome->early_updated);
      result.set_early_rolled_back(outcome->early_rolled_back);
      Reply(s, h, Kind::kResult, result.SerializeAsString());
      return;
    }
    case Kind::kUpdate: {
      auto it = steps->open.find(id);
      if (it == steps->open.end()) return;  // the step already failed (and said so) or ended
      // The payload is t, then the group lrs (ucx_common.h).
      absl::Status st = c->status;
      const size_t groups = c->data.size() >= sizeof(uint64_t)
                                ? (c->data.size() - sizeof(uint64_t)) / sizeof(double)
                                : 0;
      if (st.ok() && (c->data.size() < sizeof(uint64_t) ||
                      (c->data.size() - sizeof(uint64_t)) % sizeof(double) != 0)) {
        st = absl::InvalidArgumentError(absl::StrCat("update payload of ", c->data.size(),
                                                     " bytes is not a t and fp64 group lrs"));
      } else if (st.ok() && groups > static_cast<size_t>(kMaxParamGroups)) {
        st = absl::InvalidArgumentError(absl::StrCat("update carries ", groups,
                                                     " group lrs; at most ", kMaxParamGroups,
                                                     " parameter groups are allowed"));
      }
      if (st.ok()) {
        uint64_t t = 0;
        std::memcpy(&t, c->data.data(), sizeof(t));
        StepCommitArgs args;
        args.step = h.step;
        args.lr = h.lr;
        args.grad_multiplier = h.grad_multiplier;
        args.group_lr.resize(groups);
        if (groups > 0) {
          std::memcpy(args.group_lr.data(), c->data.data() + sizeof(t), groups * sizeof(double));
        }
        const int64_t offset = WireOffset(h.offset);
        // One t for all of them; its bound (the range's next step) is the session's to check.
        if (t > 0 && h.n > 0) args.range_steps.push_back(RangeStep{offset, h.n, t});
        // A decline needs no answer: the commit updates those elements as usual.
        st = it->second->UpdateEarly(args, offset, h.n).status();
      }
      if (!st.ok()) {
        steps->Fail(id, st);
        ReplyError(s, h, st);
      }
      return;
    }
    case Kind::kAbandon:
      steps->open.erase(id);
      steps->failed.erase(id);
      return;
    default:
      ReplyError(s, h,
                 absl::InvalidArgumentError(absl::StrCat("unknown UCX message kind ", h.kind)));
      return;
  }
}

grpc::Status UcxServer::Serve(const v1::AttachOpen& open, grpc::ServerContext* context,
                              AttachStream* stream) {
  if (open.ucx_worker_address().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "a UCX AttachOpen must carry ucx_worker_address");
  }
  const bool probe = open.job_id().empty();
  auto session = std::make_shared<Session>();
  if (!probe) {
    // The same checks (and messages) as StepSession::Open, before anything is set up.
    absl::StatusOr<ShardStore::JobRange> found =
        store_->FindJobRange(open.job_id(), open.range_index());
    if (!found.ok()) return ToGrpcStatus(found.status());
    session->max_payload = found->range->spec.length * 4;
    session->range_offset = found->range->spec.offset;
    session->range_length = found->range->spec.length;
  }
  // The worker offering the interface that routes to this trainer (its gRPC peer address).
  std::string devices = fixed_devices_;
  if (routed_) {
    absl::StatusOr<std::string> routed = ucx::NetDevicesFor("auto", context->peer());
    if (routed.ok()) {
      devices = *std::move(routed);
    } else {
      LOG(WARNING) << "UCX to trainer " << context->peer()
                   << ": every network device offered: " << routed.status().message();
    }
  }
  absl::StatusOr<ucx::Worker*> worker = PlaneFor(devices);
  if (!worker.ok()) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        absl::StrCat("no UCX worker: ", worker.status().message()));
  }
  session->worker = *worker;
  if (!probe) {
    absl::StatusOr<Reservation> area =
        store_->budget()->Take(session->range_length * 2, "the UCX gradient area");
    if (area.ok()) {
      session->grad_area_bytes = *std::move(area);
      session->grad_area.resize(session->range_length * 2);
      session->grad_memh = std::make_unique<ucx::MemMap>(
          session->worker->context(), session->grad_area.data(), session->grad_area.size());
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    absl::StatusOr<uint64_t> id = NewSessionId(sessions_);
    if (!id.ok()) return ToGrpcStatus(id.status());
    session->id = *id;
    sessions_[session->id] = session;
  }
  Session* s = session.get();
  auto forget = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    sessions_.erase(s->id);
  };
  absl::StatusOr<ucp_ep_h> ep =
      s->worker->Connect(open.ucx_worker_address(), &UcxServer::OnEpError, s);
  if (!ep.ok()) {
    forget();
    return grpc::Status(
        grpc::StatusCode::UNAVAILABLE,
        absl::StrCat("cannot reach the trainer's UCX worker: ", ep.status().message()));
  }
  s->ep = *ep;
  v1::AttachResponse response;
  response.mutable_ucx()->set_worker_address(s->worker->address());
  response.mutable_ucx()->set_session_id(s->id);
  bool ok = stream->Write(response);
  response.mutable_ready();
  ok = ok && stream->Write(response);

  // Notices the trainer closing or losing its Attach stream.
  std::thread reader;
  if (ok) {
    reader = std::thread([stream, s] {
      v1::AttachRequest ignored;
      while (stream->Read(&ignored)) {
      }
      std::lock_guard<std::mutex> lock(s->mu);
      s->stream_ended = true;
      s->cv.notify_all();
    });
  }

  Steps steps;
  while (ok) {
    std::shared_ptr<Command> c;
    {
      std::unique_lock<std::mutex> lock(s->mu);
      while (!s->stream_ended && !s->peer_failed && !context->IsCancelled() &&
             (s->queue.empty() || !s->queue.front()->ready)) {
        s->cv.wait_for(lock, absl::ToChronoNanoseconds(options_.poll_interval));
      }
      if (s->stream_ended || s->peer_failed || context->IsCancelled()) break;
      c = std::move(s->queue.front());
      s->queue.pop_front();
    }
    Execute(s, &steps, c.get(), open.job_id(), open.range_index());
    if (c->header.kind == static_cast<uint32_t>(Kind::kCommit)) {
      std::lock_guard<std::mutex> lock(s->mu);
      --s->commits_pending;
    }
  }

  steps.open.clear();  // uncommitted steps are dropped, their leases released
  forget();            // no new commands for this session
  if (reader.joinable()) {
    context->TryCancel();  // unblocks the reader if the trainer's stream is still up
    reader.join();
  }
  s->worker->Close(s->ep);  // forced: slot sends still in flight complete as cancelled
  for (Slot& slot : s->slots) {
    slot.inflight->WaitIdle(options_.poll_interval, absl::Now() + absl::Seconds(5),
                            [] { return false; });
  }
  return grpc::Status::OK;
}

absl::StatusOr<ucx::Worker*> UcxServer::PlaneFor(const std::string& net_devices) {
  std::lock_guard<std::mutex> lock(planes_mu_);
  std::unique_ptr<Plane>& plane = planes_[net_devices];
  if (plane != nullptr) return plane->worker.get();
  absl::StatusOr<std::unique_ptr<ucx::Worker>> worker = ucx::Worker::Create(net_devices);
  if (!worker.ok()) {
    planes_.erase(net_devices);
    return worker.status();
  }
  auto made = std::make_unique<Plane>();
  made->server = this;
  made->worker = *std::move(worker);
  if (absl::Status s = made->worker->SetAmHandler(ucx::kToShardAm, &UcxServer::OnAm, made.get());
      !s.ok()) {
    planes_.erase(net_devices);
    return s;
  }
  made->worker->Start();
  if (!net_devices.empty()) {
    LOG(INFO) << "cpu_optimizer_server: UCX worker on network devices " << net_devices;
  }
  plane = std::move(made);
  return plane->worker.get();
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataPlaneServer>> CreateUcxServer(ShardStore* store,
                                                                 const UcxOptions& options) {
  auto server = std::make_unique<UcxServer>(store, options);
  OFFLOAD_RETURN_IF_ERROR(server->Init());
  return std::unique_ptr<DataPlaneServer>(std::move(server));
}

}  // namespace offload
