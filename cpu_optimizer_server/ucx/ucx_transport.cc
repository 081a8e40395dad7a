// The trainer side of the UCX data plane.
//
// Threading: one UCP context and worker per transport, progressed by its own thread that sleeps
// on the worker's event fd (no core spent while idle). The worker is UCS_THREAD_MODE_MULTI because
// the trainer's threads post sends directly; completions and incoming active messages run on the
// progress thread, which only copies small eager payloads, starts rendezvous receives straight
// into their destination and signals the waiting thread.
//
// Registration: the trainer's gradient sources and parameter destinations are the caller's
// buffers, which may change from call to call and may be freed and their addresses reused; a
// registration cache of our own could not see that, so we rely on UCX's registration cache
// (UCX_RCACHE, on by default for the transports that register memory), which watches unmaps. The
// shard's parameter slots are its own and are ucp_mem_map'ed once per attachment.
#include "cpu_optimizer_server/ucx/ucx_transport.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/dtype_proto.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "cpu_optimizer_server/grpc/attach_client.h"
#include "cpu_optimizer_server/transport/attachment_cache.h"
#include "cpu_optimizer_server/ucx/net_route.h"
#include "cpu_optimizer_server/ucx/ucx_common.h"

namespace offload {

namespace {

using ucx::Header;
using ucx::Kind;

// What one StepStream is waiting for; shared with the progress thread's handlers.
struct StreamState {
  std::mutex mu;
  std::condition_variable cv;
  bool opened = false;
  bool ponged = false;
  bool have_result = false;
  absl::Status error;  // the shard's ERROR reply
  v1::StepResult result;
  char* params_out = nullptr;  // set while a Commit waits
  int64_t range_offset = 0;
  int64_t range_length = 0;
  int64_t received = 0;  // parameters landed in params_out
  int pending = 0;       // rendezvous receives into params_out in flight
  bool bad_chunk = false;
  std::shared_ptr<ucx::Inflight> sends = std::make_shared<ucx::Inflight>();
};

class UcxTransport;

// One (job, range) attachment: the Attach stream, its watcher, and the endpoint to the shard.
struct Attachment {
  UcxTransport* transport = nullptr;
  uint64_t session_id = 0;
  ucp_ep_h ep = nullptr;
  std::unique_ptr<AttachClient> link;
  std::atomic<bool> dead{false};

  std::mutex mu;
  std::string dead_reason;
  std::map<uint64_t, std::shared_ptr<StreamState>> streams;
  uint64_t next_stream_id = 1;

  ~Attachment();

  void MarkDead(const std::string& why) {
    std::vector<std::shared_ptr<StreamState>> waiting;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (dead) return;
      dead_reason = why;
      dead = true;
      for (auto& [id, s] : streams) waiting.push_back(s);
    }
    for (auto& s : waiting) {
      std::lock_guard<std::mutex> lock(s->mu);
      s->cv.notify_all();
    }
  }
  absl::Status DeadStatus() {
    std::lock_guard<std::mutex> lock(mu);
    return absl::UnavailableError(dead_reason);
  }
};

class UcxTransport final : public StepTransport {
 public:
  UcxTransport(ShardClient* control, const UcxOptions& options, std::unique_ptr<ucx::Worker> worker)
      : control_(control), options_(options), worker_(std::move(worker)) {}
  ~UcxTransport() override { attachments_.Clear(); }  // before the worker goes

  absl::Status Init() {
    if (auto s = worker_->SetAmHandler(ucx::kToTrainerAm, &UcxTransport::OnAm, this); !s.ok()) {
      return s;
    }
    worker_->Start();
    return absl::OkStatus();
  }

  absl::string_view name() const override { return "ucx"; }
  absl::StatusOr<std::unique_ptr<StepStream>> OpenStep(const std::string& job_id,
                                                       uint32_t range_index, int64_t range_offset,
                                                       int64_t range_length,
                                                       uint64_t step) override;

  // Attaches (job_id empty: a probe) over a new Attach stream.
  absl::StatusOr<std::shared_ptr<Attachment>> Attach(const std::string& job_id,
                                                     uint32_t range_index);
  // A probe round trip on a probe attachment.
  absl::Status Ping(const std::shared_ptr<Attachment>& att);

  std::string shard() const { return control_->options().address; }
  ucx::Worker* worker() { return worker_.get(); }
  const UcxOptions& options() const { return options_; }
  StepTimeout* step_timeout() const { return &control_->step_timeout(); }

  // Registers a stream and returns its id.
  std::pair<uint64_t, std::shared_ptr<StreamState>> AddStream(Attachment* att) {
    auto state = std::make_shared<StreamState>();
    std::lock_guard<std::mutex> lock(att->mu);
    const uint64_t id = att->next_stream_id++;
    att->streams[id] = state;
    return {id, state};
  }
  void RemoveStream(Attachment* att, uint64_t id) {
    std::lock_guard<std::mutex> lock(att->mu);
    att->streams.erase(id);
  }
  void Forget(Attachment* att) {
    std::lock_guard<std::mutex> lock(mu_);
    by_session_.erase(att->session_id);
  }

  // Waits on `state` until done(state) or the attachment dies or the deadline passes.
  absl::Status Wait(Attachment* att, StreamState* state, const std::function<bool()>& done,
                    const char* what);

 private:
  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data,
                           size_t length, const ucp_am_recv_param_t* param);
  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void OnParamsReceived(void* request, ucs_status_t status, size_t length, void* user_data);

  ShardClient* const control_;
  const UcxOptions options_;
  std::unique_ptr<ucx::Worker> worker_;

  // Held by the AM handler for its whole run, so an attachment found here stays alive meanwhile
  // (Forget() takes it before the attachment is torn down).
  std::mutex mu_;
  std::map<uint64_t, Attachment*> by_session_;
  AttachmentCache<Attachment> attachments_;
};

Attachment::~Attachment() {
  if (transport != nullptr) transport->Forget(this);
  link.reset();  // its watcher marks this attachment dead: it stops first
  if (ep != nullptr) transport->worker()->Close(ep);
}

void UcxTransport::OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* att = static_cast<Attachment*>(arg);
  att->MarkDead(absl::StrCat("UCX endpoint to shard ", att->transport->shard(),
                             " failed: ", ucs_status_string(status)));
}

struct ParamsRecv {
  std::shared_ptr<StreamState> state;
  int64_t n;
};

void UcxTransport::OnParamsReceived(void* request, ucs_status_t status, size_t length,
                                    void* user_data) {
  auto* recv = static_cast<ParamsRecv*>(user_data);
  {
    std::lock_guard<std::mutex> lock(recv->state->mu);
    --recv->state->pending;
    if (status == UCS_OK) {
      recv->state->received += recv->n;
    } else {
      recv->state->error = absl::UnavailableError(
          absl::StrCat("receiving parameters failed: ", ucs_status_string(status)));
    }
    recv->state->cv.notify_all();
  }
  delete recv;
  if (request != nullptr) ucp_request_free(request);
}

ucs_status_t UcxTransport::OnAm(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxTransport*>(arg);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  if (header_length != sizeof(Header)) return UCS_OK;  // not ours; dropped
  Header h;
  std::memcpy(&h, header, sizeof(h));
  std::lock_guard<std::mutex> lock(self->mu_);
  auto at = self->by_session_.find(h.session_id);
  if (at == self->by_session_.end()) return UCS_OK;
  std::shared_ptr<StreamState> state;
  {
    std::lock_guard<std::mutex> att_lock(at->second->mu);
    auto it = at->second->streams.find(h.stream_id);
    if (it == at->second->streams.end()) return UCS_OK;  // a stream already gone
    state = it->second;
  }
  std::lock_guard<std::mutex> state_lock(state->mu);
  switch (static_cast<Kind>(h.kind)) {
    case Kind::kOpened:
      state->opened = true;
      break;
    case Kind::kPong:
      state->ponged = true;
      break;
    case Kind::kError:
      if (state->error.ok()) {
        state->error = absl::Status(static_cast<absl::StatusCode>(h.code),
                                    std::string(static_cast<const char*>(data), length));
        if (state->error.ok()) state->error = absl::UnknownError("shard sent an OK error");
      }
      break;
    case Kind::kResult:
      if (!state->result.ParseFromArray(data, static_cast<int>(length))) {
        state->error = absl::DataLossError("shard sent an unreadable step result");
      }
      state->have_result = true;
      break;
    case Kind::kParams: {
      const int64_t at_elem = static_cast<int64_t>(h.offset) - state->range_offset;
      const int64_t n = static_cast<int64_t>(length / 2);
      if (state->params_out == nullptr) return UCS_OK;  // not committing: dropped
      if (at_elem < 0 || n > state->range_length - at_elem || h.n != n || length % 2 != 0) {
        state->bad_chunk = true;
        break;
      }
      char* dest = state->params_out + at_elem * 2;
      if (!rndv) {
        std::memcpy(dest, data, length);
        state->received += n;
        break;
      }
      // Rendezvous: the data lands straight in params_out.
      auto* recv = new ParamsRecv{state, n};
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      p.cb.recv_am = &UcxTransport::OnParamsReceived;
      p.user_data = recv;
      ++state->pending;
      ucs_status_ptr_t r = ucp_am_recv_data_nbx(self->worker_->worker(), data, dest, length, &p);
      if (r == nullptr) {
        --state->pending;
        state->received += n;
        delete recv;
      } else if (UCS_PTR_IS_ERR(r)) {
        --state->pending;
        state->error = ucx::UcsError(UCS_PTR_STATUS(r), "ucp_am_recv_data_nbx");
        delete recv;
      }
      state->cv.notify_all();
      return UCS_INPROGRESS;  // UCX owns the descriptor now
    }
    default:
      break;
  }
  state->cv.notify_all();
  return UCS_OK;
}

absl::Status UcxTransport::Wait(Attachment* att, StreamState* state,
                                const std::function<bool()>& done, const char* what) {
  const absl::Duration limit = step_timeout()->Get();
  const absl::Time deadline = absl::Now() + limit;
  std::unique_lock<std::mutex> lock(state->mu);
  while (!done()) {
    if (att->dead) return att->DeadStatus();
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("shard ", shard(), " over UCX, ", what, ": ",
                                                      step_timeout()->Describe(limit)));
    }
    state->cv.wait_for(lock, absl::ToChronoNanoseconds(options_.poll_interval));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Attachment>> UcxTransport::Attach(const std::string& job_id,
                                                                 uint32_t range_index) {
  auto att = std::make_shared<Attachment>();
  att->link = std::make_unique<AttachClient>(
      control_, absl::StrCat("the UCX Attach stream of shard ", shard()));
  v1::AttachRequest request;
  v1::AttachOpen* open = request.mutable_open();
  open->set_job_id(job_id);
  open->set_range_index(range_index);
  open->set_plane(v1::DATA_PLANE_UCX);
  open->set_ucx_worker_address(worker_->address());
  OFFLOAD_RETURN_IF_ERROR(att->link->Send(request, "the AttachOpen was sent"));
  absl::StatusOr<v1::AttachResponse> response = att->link->Receive("its UcxOffer");
  if (!response.ok()) return response.status();
  if (!response->has_ucx()) {
    att->link->Cancel();
    return absl::DataLossError(
        absl::StrCat("shard ", shard(), " answered a UCX AttachOpen without a UcxOffer"));
  }
  att->session_id = response->ucx().session_id();
  {
    std::lock_guard<std::mutex> lock(mu_);
    att->transport = this;
    by_session_[att->session_id] = att.get();
  }
  absl::StatusOr<ucp_ep_h> ep =
      worker_->Connect(response->ucx().worker_address(), &UcxTransport::OnEpError, att.get());
  if (!ep.ok()) return ep.status();  // ~Attachment cancels the stream
  att->ep = *ep;
  response = att->link->Receive("AttachReady");
  if (!response.ok()) return response.status();
  if (!response->has_ready()) {
    return absl::DataLossError(
        absl::StrCat("shard ", shard(), " sent something else than AttachReady"));
  }
  // The stream stays silent until one side ends it: that is how a dead shard is noticed.
  Attachment* raw = att.get();
  att->link->Watch([raw](const grpc::Status& s) {
    raw->MarkDead(absl::StrCat("shard ", raw->transport->shard(), " ended the UCX attachment: ",
                               s.ok() ? "stream closed" : s.error_message()));
  });
  return att;
}

absl::Status UcxTransport::Ping(const std::shared_ptr<Attachment>& att) {
  auto [id, state] = AddStream(att.get());
  Header h;
  h.session_id = att->session_id;
  h.stream_id = id;
  h.kind = static_cast<uint32_t>(Kind::kPing);
  absl::Status s = worker_->Send(att->ep, ucx::kToShardAm, h, nullptr, 0, state->sends);
  if (s.ok()) {
    StreamState* st = state.get();
    s = Wait(
        att.get(), st, [st] { return st->ponged || !st->error.ok(); }, "the probe");
    if (s.ok()) s = st->error;
  }
  RemoveStream(att.get(), id);
  return s;
}

class UcxStepStream final : public StepStream {
 public:
  UcxStepStream(UcxTransport* transport, std::shared_ptr<Attachment> att, uint64_t id,
                std::shared_ptr<StreamState> state, uint64_t step)
      : transport_(transport),
        att_(std::move(att)),
        id_(id),
        state_(std::move(state)),
        step_(step),
        opened_(absl::Now()) {}
  ~UcxStepStream() override {
    Abandon();
    transport_->RemoveStream(att_.get(), id_);
  }

  absl::Status SendGradients(int64_t offset, const void* data, DType dtype, int64_t n,
                             bool accumulate) override;
  absl::StatusOr<v1::StepResult> Commit(double lr, float grad_multiplier, bool skip,
                                        void* params_out, absl::Span<const double> group_lr = {},
                                        absl::Span<const RangeStep> range_steps = {}) override;
  absl::Status UpdateEarly(int64_t offset, int64_t n, uint64_t t, double lr, float grad_multiplier,
                           absl::Span<const double> group_lr) override;
  void Abandon() override;

  absl::Status Open();

 private:
  Header MakeHeader(Kind kind) const {
    Header h;
    h.session_id = att_->session_id;
    h.stream_id = id_;
    h.kind = static_cast<uint32_t>(kind);
    h.step = step_;
    return h;
  }
  absl::Status ShardError() {
    std::lock_guard<std::mutex> lock(state_->mu);
    return state_->error;
  }
  // Waits until every send of this stream completed (the caller may reuse its buffers).
  absl::Status WaitSends() {
    Attachment* att = att_.get();
    const absl::Duration limit = transport_->step_timeout()->Get();
    if (!state_->sends->WaitIdle(transport_->options().poll_interval, absl::Now() + limit,
                                 [att] { return att->dead.load(); })) {
      if (att->dead) return att->DeadStatus();
      return absl::DeadlineExceededError(
          absl::StrCat("sending to shard ", transport_->shard(),
                       " over UCX: ", transport_->step_timeout()->Describe(limit)));
    }
    if (ucs_status_t e = state_->sends->error(); e != UCS_OK) {
      return ucx::UcsError(e, absl::StrCat("sending to shard ", transport_->shard(), " over UCX"));
    }
    return absl::OkStatus();
  }

  UcxTransport* const transport_;
  const std::shared_ptr<Attachment> att_;
  const uint64_t id_;
  const std::shared_ptr<StreamState> state_;
  const uint64_t step_;
  const absl::Time opened_;  // for the step timeout's record
  bool done_ = false;
};

absl::Status UcxStepStream::Open() {
  const Header h = MakeHeader(Kind::kOpen);
  if (absl::Status s =
          transport_->worker()->Send(att_->ep, ucx::kToShardAm, h, nullptr, 0, state_->sends);
      !s.ok()) {
    return s;
  }
  StreamState* st = state_.get();
  OFFLOAD_RETURN_IF_ERROR(transport_->Wait(
      att_.get(), st, [st] { return st->opened || !st->error.ok(); }, "OPEN"));
  return ShardError();
}

absl::Status UcxStepStream::SendGradients(int64_t offset, const void* data, DType dtype, int64_t n,
                                          bool accumulate) {
  if (done_) return absl::FailedPreconditionError("step stream already finished");
  if (absl::Status s = ShardError(); !s.ok()) {
    done_ = true;
    return s;
  }
  if (att_->dead) return att_->DeadStatus();
  const int size = DTypeSize(dtype);
  const int64_t per_chunk = std::max<int64_t>(1, transport_->options().chunk_bytes / size);
  const char* bytes = static_cast<const char*>(data);
  Header h = MakeHeader(Kind::kGrad);
  h.dtype = static_cast<uint32_t>(DTypeToProto(dtype));
  h.accumulate = accumulate ? 1 : 0;
  // All chunks go out at once (rendezvous ones are pulled by the shard as it gets to them); the
  // call returns when the shard has them all, since the caller may then reuse `data`.
  for (int64_t done = 0; done < n; done += per_chunk) {
    const int64_t m = std::min(per_chunk, n - done);
    h.offset = static_cast<uint64_t>(offset + done);
    h.n = m;
    if (absl::Status s = transport_->worker()->Send(att_->ep, ucx::kToShardAm, h,
                                                    bytes + done * size, m * size, state_->sends);
        !s.ok()) {
      WaitSends().IgnoreError();
      return s;
    }
  }
  OFFLOAD_RETURN_IF_ERROR(WaitSends());
  // A refused chunk: the shard's answer says why (it may also come only with the commit).
  if (absl::Status s = ShardError(); !s.ok()) {
    done_ = true;
    return s;
  }
  return absl::OkStatus();
}

// Queued behind the gradients on the shard, which runs it when it gets there; a refusal comes
// back as the step's error, at the next call or the commit.
absl::Status UcxStepStream::UpdateEarly(int64_t offset, int64_t n, uint64_t t, double lr,
                                        float grad_multiplier, absl::Span<const double> group_lr) {
  if (done_) return absl::FailedPreconditionError("step stream already finished");
  OFFLOAD_RETURN_IF_ERROR(ShardError());
  if (att_->dead) return att_->DeadStatus();
  Header h = MakeHeader(Kind::kUpdate);
  h.offset = static_cast<uint64_t>(offset);  // negative values travel as huge ones, refused
  h.n = n;
  h.lr = lr;
  h.grad_multiplier = grad_multiplier;
  std::string payload(reinterpret_cast<const char*>(&t), sizeof(t));
  if (!group_lr.empty()) {
    payload.append(reinterpret_cast<const char*>(group_lr.data()),
                   group_lr.size() * sizeof(double));
  }
  return transport_->worker()->SendOwned(att_->ep, ucx::kToShardAm, h, std::move(payload),
                                         state_->sends);
}

absl::StatusOr<v1::StepResult> UcxStepStream::Commit(double lr, float grad_multiplier, bool skip,
                                                     void* params_out,
                                                     absl::Span<const double> group_lr,
                                                     absl::Span<const RangeStep> range_steps) {
  if (done_) return absl::FailedPreconditionError("step stream already finished");
  done_ = true;
  OFFLOAD_RETURN_IF_ERROR(ShardError());
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->params_out = static_cast<char*>(params_out);
  }
  Header h = MakeHeader(Kind::kCommit);
  h.lr = lr;
  h.grad_multiplier = grad_multiplier;
  h.skip = skip ? 1 : 0;
  h.n = static_cast<int64_t>(group_lr.size());
  // The group lrs and the range steps are the payload, owned by the send: a commit that gives up
  // early must not leave UCX reading the caller's memory.
  std::string payload;
  if (!group_lr.empty()) {  // an empty span's data() may be null
    payload.assign(reinterpret_cast<const char*>(group_lr.data()),
                   group_lr.size() * sizeof(double));
  }
  if (!range_steps.empty()) {
    payload.append(reinterpret_cast<const char*>(range_steps.data()),
                   range_steps.size() * sizeof(RangeStep));
  }
  absl::Status s = transport_->worker()->SendOwned(att_->ep, ucx::kToShardAm, h, std::move(payload),
                                                   state_->sends);
  StreamState* st = state_.get();
  if (s.ok()) {
    s = transport_->Wait(
        att_.get(), st,
        [st] { return (st->have_result && st->pending == 0) || !st->error.ok() || st->bad_chunk; },
        "the commit");
  }
  std::unique_lock<std::mutex> lock(st->mu);
  // Late parameters must not land in the caller's buffer once we return. Rendezvous receives
  // already started finish (or fail with the endpoint) within the poll interval.
  st->params_out = nullptr;
  const absl::Time drain_deadline = absl::Now() + 4 * transport_->options().poll_interval;
  while (st->pending > 0 && absl::Now() < drain_deadline) {
    st->cv.wait_for(lock, absl::ToChronoNanoseconds(transport_->options().poll_interval));
  }
  if (st->bad_chunk) return absl::DataLossError("shard sent parameters outside the range");
  if (!s.ok()) return s;
  if (!st->error.ok()) return st->error;
  if (!st->have_result) return absl::DataLossError("step stream ended without a result");
  const v1::StepResult& result = st->result;
  if (result.step() != step_) {
    return absl::DataLossError(
        absl::StrCat("shard answered step ", result.step(), " to the commit of step ", step_));
  }
  const int64_t expected = result.skipped() ? 0 : st->range_length;
  if (st->received != expected) {
    return absl::DataLossError(
        absl::StrCat("shard sent ", st->received, " of ", expected, " parameters of the range"));
  }
  transport_->step_timeout()->Record(absl::Now() - opened_);
  return result;
}

void UcxStepStream::Abandon() {
  if (done_) return;
  done_ = true;
  if (att_->dead) return;
  // Fire and forget: the shard drops the step; nothing waits on the answer.
  transport_->worker()
      ->Send(att_->ep, ucx::kToShardAm, MakeHeader(Kind::kAbandon), nullptr, 0, state_->sends)
      .IgnoreError();
}

absl::StatusOr<std::unique_ptr<StepStream>> UcxTransport::OpenStep(const std::string& job_id,
                                                                   uint32_t range_index,
                                                                   int64_t range_offset,
                                                                   int64_t range_length,
                                                                   uint64_t step) {
  if (job_id.empty()) return absl::InvalidArgumentError("OpenStep needs a job_id");
  OFFLOAD_ASSIGN_OR_RETURN(
      std::shared_ptr<Attachment> att,
      attachments_.Get(
          job_id, range_index, [](const Attachment& a) { return !a.dead.load(); },
          [&] { return Attach(job_id, range_index); }));
  auto [id, state] = AddStream(att.get());
  state->range_offset = range_offset;
  state->range_length = range_length;
  auto stream = std::make_unique<UcxStepStream>(this, att, id, state, step);
  if (absl::Status s = stream->Open(); !s.ok()) {
    return s;  // the stream's destructor abandons (the shard opened nothing, or drops it)
  }
  return std::unique_ptr<StepStream>(std::move(stream));
}

absl::StatusOr<std::unique_ptr<UcxTransport>> MakeTransport(ShardClient* control,
                                                            const UcxOptions& options) {
  // The worker offers only the interface that routes to the shard (net_route.h), so the shard
  // never tries one of ours it cannot reach, e.g. a container bridge.
  absl::StatusOr<std::string> devices =
      ucx::NetDevicesFor(options.net_devices, control->options().address);
  if (!devices.ok()) {
    LOG(WARNING) << "UCX to shard " << control->options().address
                 << ": every network device offered (UCX_NET_DEVICES to choose): "
                 << devices.status().message();
    devices = std::string();
  }
  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<ucx::Worker> worker, ucx::Worker::Create(*devices));
  auto t = std::make_unique<UcxTransport>(control, options, std::move(worker));
  OFFLOAD_RETURN_IF_ERROR(t->Init());
  return t;
}

}  // namespace

absl::StatusOr<std::unique_ptr<StepTransport>> CreateUcxTransport(ShardClient* control,
                                                                  const UcxOptions& options) {
  if (options.chunk_bytes < 4) return absl::InvalidArgumentError("UCX chunk_bytes below 4");
  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<UcxTransport> t, MakeTransport(control, options));
  return std::unique_ptr<StepTransport>(std::move(t));
}

absl::Status ProbeUcx(ShardClient* control) {
  absl::StatusOr<std::unique_ptr<UcxTransport>> t = MakeTransport(control, UcxOptions());
  if (!t.ok()) return t.status();
  OFFLOAD_ASSIGN_OR_RETURN(std::shared_ptr<Attachment> att, (*t)->Attach("", 0));
  return (*t)->Ping(att);
}

}  // namespace offload
