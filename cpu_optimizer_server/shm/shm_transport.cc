// The trainer side of the shared-memory data plane (shm_transport.h).
//
// Liveness: each attachment keeps its Attach stream open and runs a watcher thread blocked in
// stream->Read. The shard sends nothing after AttachReady, so Read returns only when the stream
// ends (the shard closed it, died or shut down, or this side cancelled it). The watcher then
// raises `gone` and wakes the segment's event futex; every wait on the segment also wakes up
// every poll_interval to look at `gone`, so no wait outlives the shard by more than that.
#include "cpu_optimizer_server/shm/shm_transport.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "cpu_optimizer_server/grpc/attach_client.h"
#include "cpu_optimizer_server/shm/shm_segment.h"
#include "cpu_optimizer_server/transport/attachment_cache.h"

namespace offload {
namespace {

// Runs the trainer's half of the offer / proof / ready exchange on a fresh Attach stream.
absl::StatusOr<ShmSegment> Handshake(const v1::AttachOpen& open, AttachClient* link) {
  v1::AttachRequest request;
  *request.mutable_open() = open;
  OFFLOAD_RETURN_IF_ERROR(link->Send(request, "the offer"));
  absl::StatusOr<v1::AttachResponse> response = link->Receive("the offer");
  if (!response.ok()) return response.status();
  if (!response->has_shm()) {
    link->Cancel();
    return absl::DataLossError("shard answered a shm AttachOpen with something else than an offer");
  }
  absl::StatusOr<ShmSegment> segment = ShmSegment::Open(response->shm().segment_name());
  if (!segment.ok()) {
    link->Cancel();
    return segment.status();
  }
  request.mutable_proof()->set_secret(segment->header()->secret, kShmSecretBytes);
  OFFLOAD_RETURN_IF_ERROR(link->Send(request, "AttachReady"));
  response = link->Receive("AttachReady");
  if (!response.ok()) return response.status();
  if (!response->has_ready()) {
    link->Cancel();
    return absl::DataLossError("shard answered the AttachProof with something else than ready");
  }
  return segment;
}

// One (job, range) attachment: the mapped segment and the Attach stream that keeps it alive.
class Attachment {
 public:
  Attachment(std::string address, const ShmOptions& options, StepTimeout* timeout)
      : address_(std::move(address)), options_(options), timeout_(timeout) {}

  // Unique among the attachments of this process, never 0 (StepStream::GradientAreaId).
  uint64_t id() const { return id_; }

  absl::Status Start(ShardClient* control, const v1::AttachOpen& open) {
    link_ = std::make_unique<AttachClient>(
        control, absl::StrCat("the shm Attach stream of shard ", control->options().address));
    absl::StatusOr<ShmSegment> segment = Handshake(open, link_.get());
    if (!segment.ok()) {
      link_ = nullptr;
      return segment.status();
    }
    segment_ = *std::move(segment);
    head_ = segment_.header()->cmd_head.load(std::memory_order_relaxed);
    link_->Watch([this](const grpc::Status&) {
      gone_.store(true);
      ShmWake(&segment_.header()->shard_event);
    });
    return absl::OkStatus();
  }

  bool usable() const { return !gone_.load() && !broken_.load(); }
  std::atomic<bool>& busy() { return busy_; }
  const ShmSegment& segment() const { return segment_; }
  ShmHeader* header() const { return segment_.header(); }

  // Waits until done() (called with the segment's state fresh) is true. UNAVAILABLE once the
  // shard is gone; DEADLINE_EXCEEDED after the step timeout, which also retires the attachment
  // (its shard may still act on what was pushed).
  absl::Status WaitUntil(const std::function<bool()>& done) {
    ShmHeader* h = header();
    const absl::Duration limit = timeout_->Get();
    const absl::Time deadline = absl::Now() + limit;
    for (;;) {
      const uint32_t event = h->shard_event.load(std::memory_order_acquire);
      if (done()) return absl::OkStatus();
      if (gone_.load()) {
        return absl::UnavailableError(absl::StrCat("optimizer shard ", address_, " went away"));
      }
      const absl::Time now = absl::Now();
      if (now >= deadline) {
        broken_.store(true);
        return absl::DeadlineExceededError(absl::StrCat(
            "optimizer shard ", address_, " on shared memory: ", timeout_->Describe(limit)));
      }
      ShmWait(&h->shard_event, event, std::min(options_.poll_interval, deadline - now));
    }
  }

  StepTimeout* timeout() const { return timeout_; }

  // Pushes a command, waiting for a free ring entry. Returns its sequence number.
  absl::StatusOr<uint32_t> Push(const ShmCommand& cmd) {
    ShmHeader* h = header();
    OFFLOAD_RETURN_IF_ERROR(WaitUntil(
        [&] { return head_ - h->cmd_tail.load(std::memory_order_acquire) < kShmRingSize; }));
    h->ring[head_ % kShmRingSize] = cmd;
    ++head_;
    h->cmd_head.store(head_, std::memory_order_release);
    ShmWake(&h->cmd_head);
    return head_;
  }

  // The status in the reply area (read after reply_seq was seen with acquire).
  absl::Status ReplyStatus() const {
    const ShmReply& r = header()->reply;
    if (r.code < 0 || r.code > 16) {
      return absl::DataLossError(absl::StrCat("shard replied with status code ", r.code));
    }
    if (r.code == 0) return absl::OkStatus();
    return absl::Status(
        static_cast<absl::StatusCode>(r.code),
        absl::string_view(r.message, std::min<uint32_t>(r.message_bytes, kShmMessageBytes)));
  }

  // Chunk slot uses so far; use k goes to slot k % chunk_slots.
  uint32_t slot_uses = 0;
  const std::string& address() const { return address_; }

 private:
  const std::string address_;
  const ShmOptions options_;
  StepTimeout* const timeout_;  // the control client's, which outlives its transports
  ShmSegment segment_;
  // The Attach stream that keeps the attachment alive. After segment_: its watcher wakes waits
  // through the segment, so it must stop (be destroyed) before the segment is unmapped.
  std::unique_ptr<AttachClient> link_;
  std::atomic<bool> gone_{false};
  std::atomic<bool> broken_{false};
  std::atomic<bool> busy_{false};  // a step stream is in flight
  uint32_t head_ = 0;              // commands pushed
  const uint64_t id_ = NextId();

  static uint64_t NextId() {
    static std::atomic<uint64_t> next{1};
    return next.fetch_add(1);
  }
};

class ShmStepStream final : public StepStream {
 public:
  ShmStepStream(std::shared_ptr<Attachment> attachment, uint64_t step, uint32_t open_seq)
      : a_(std::move(attachment)), step_(step), open_seq_(open_seq), opened_(absl::Now()) {}
  ~ShmStepStream() override { Abandon(); }

  absl::Status SendGradients(int64_t offset, const void* data, DType dtype, int64_t n,
                             bool accumulate) override;
  absl::StatusOr<v1::StepResult> Commit(double lr, float grad_multiplier, bool skip,
                                        void* params_out, absl::Span<const double> group_lr = {},
                                        absl::Span<const RangeStep> range_steps = {}) override;
  absl::Status UpdateEarly(int64_t offset, int64_t n, uint64_t t, double lr, float grad_multiplier,
                           absl::Span<const double> group_lr) override;
  void* GradientArea() override { return done_ ? nullptr : a_->segment().grad_area(); }
  uint64_t GradientAreaId() override { return done_ ? 0 : a_->id(); }
  absl::StatusOr<v1::StepResult> CommitInPlace(
      double lr, float grad_multiplier, bool skip, const ParamWaveFn& on_wave,
      absl::Span<const double> group_lr = {},
      absl::Span<const RangeStep> range_steps = {}) override;
  void Abandon() override {
    if (done_) return;
    ShmCommand cmd{};
    cmd.kind = static_cast<uint32_t>(ShmCommandKind::kAbandon);
    a_->Push(cmd).IgnoreError();  // a shard that is gone dropped the step already
    Finish();
  }

 private:
  // No command follows: the attachment is free for the next step.
  void Finish() {
    done_ = true;
    a_->busy().store(false);
  }
  // The shard's error for this step if it replied one (it then dropped the step).
  absl::Status PendingError() {
    if (a_->header()->reply_seq.load(std::memory_order_acquire) == open_seq_) {
      return absl::OkStatus();
    }
    absl::Status s = a_->ReplyStatus();
    if (s.ok()) s = absl::DataLossError("shard replied OK to a gradient chunk");
    Finish();
    return s;
  }
  absl::StatusOr<uint32_t> PushGrad(int64_t offset, DType dtype, int64_t n, bool accumulate,
                                    uint32_t slot) {
    ShmCommand cmd{};
    cmd.kind = static_cast<uint32_t>(ShmCommandKind::kGrad);
    cmd.dtype = static_cast<uint32_t>(dtype);
    cmd.accumulate = accumulate;
    cmd.slot = slot;
    cmd.offset = offset;
    cmd.n = n;
    return a_->Push(cmd);
  }

  const std::shared_ptr<Attachment> a_;
  const uint64_t step_;
  const uint32_t open_seq_;
  const absl::Time opened_;  // for the step timeout's record
  bool done_ = false;
};

absl::Status ShmStepStream::SendGradients(int64_t offset, const void* data, DType dtype, int64_t n,
                                          bool accumulate) {
  if (done_) return absl::FailedPreconditionError("step stream already finished");
  if (n <= 0) return absl::OkStatus();  // nothing to send, as over gRPC
  OFFLOAD_RETURN_IF_ERROR(PendingError());
  ShmHeader* h = a_->header();
  const int size = DTypeSize(dtype);
  const char* bytes = static_cast<const char*>(data);
  if (!accumulate && size == 2) {
    // Zero-copy for the shard: the gradients go to their place in the gradient area. A chunk
    // outside the range is not copied; the shard refuses it with the gRPC service's error.
    const int64_t at = offset - h->range_offset;
    if (at >= 0 && at < h->range_length && n <= h->range_length - at) {
      char* place = a_->segment().grad_area() + at * 2;
      // Written there by the caller already (GradientArea): nothing to copy.
      if (bytes != place) std::memcpy(place, bytes, n * 2);
    }
    OFFLOAD_RETURN_IF_ERROR(PushGrad(offset, dtype, n, false, kShmInPlace).status());
    return PendingError();
  }
  // Through the chunk slots, in pieces of at most one slot.
  const uint32_t slots = h->chunk_slots;
  const int64_t per_slot = h->chunk_slot_bytes / size;
  if (slots == 0 || per_slot == 0) {
    return absl::FailedPreconditionError("the shm segment has no chunk slots");
  }
  for (int64_t done = 0; done < n; done += per_slot) {
    const int64_t m = std::min(per_slot, n - done);
    OFFLOAD_RETURN_IF_ERROR(a_->WaitUntil(
        [&] { return a_->slot_uses - h->slots_released.load(std::memory_order_acquire) < slots; }));
    const uint32_t slot = a_->slot_uses % slots;
    std::memcpy(a_->segment().slot(slot), bytes + done * size, m * size);
    ++a_->slot_uses;
    OFFLOAD_RETURN_IF_ERROR(PushGrad(offset + done, dtype, m, accumulate, slot).status());
    OFFLOAD_RETURN_IF_ERROR(PendingError());
  }
  return absl::OkStatus();
}

absl::Status ShmStepStream::UpdateEarly(int64_t offset, int64_t n, uint64_t t, double lr,
                                        float grad_multiplier, absl::Span<const double> group_lr) {
  if (done_) return absl::FailedPreconditionError("step stream already finished");
  if (group_lr.size() > static_cast<size_t>(kMaxParamGroups)) {
    return absl::InvalidArgumentError(absl::StrCat("update carries ", group_lr.size(),
                                                   " group lrs; at most ", kMaxParamGroups,
                                                   " parameter groups are allowed"));
  }
  OFFLOAD_RETURN_IF_ERROR(PendingError());
  // Pushed behind the gradients it needs, as a GRAD without a slot: the shard runs it when it
  // gets there, and a refusal comes back as the step's error.
  ShmCommand cmd{};
  cmd.kind = static_cast<uint32_t>(ShmCommandKind::kUpdate);
  cmd.offset = offset;
  cmd.n = n;
  cmd.step = step_;
  cmd.lr = lr;
  cmd.grad_multiplier = grad_multiplier;
  cmd.t = t;
  cmd.group_count = static_cast<uint32_t>(group_lr.size());
  std::copy(group_lr.begin(), group_lr.end(), cmd.group_lr);
  OFFLOAD_RETURN_IF_ERROR(a_->Push(cmd).status());
  return PendingError();
}

absl::StatusOr<v1::StepResult> ShmStepStream::Commit(double lr, float grad_multiplier, bool skip,
                                                     void* params_out,
                                                     absl::Span<const double> group_lr,
                                                     absl::Span<const RangeStep> range_steps) {
  char* out = static_cast<char*>(params_out);
  return CommitInPlace(
      lr, grad_multiplier, skip,
      [out](int64_t begin, int64_t n, const void* params) {
        std::memcpy(out + begin * 2, params, n * 2);
      },
      group_lr, range_steps);
}

// Pushes the COMMIT and hands each wave of parameters to on_wave as it is published.
absl::StatusOr<v1::StepResult> ShmStepStream::CommitInPlace(
    double lr, float grad_multiplier, bool skip, const ParamWaveFn& on_wave,
    absl::Span<const double> group_lr, absl::Span<const RangeStep> range_steps) {
  if (done_) return absl::FailedPreconditionError("step stream already finished");
  // The command has room for kMaxParamGroups lrs, which is all a job can have.
  if (group_lr.size() > static_cast<size_t>(kMaxParamGroups)) {
    return absl::InvalidArgumentError(absl::StrCat("commit carries ", group_lr.size(),
                                                   " group lrs; at most ", kMaxParamGroups,
                                                   " parameter groups are allowed"));
  }
  ShmHeader* h = a_->header();
  const int64_t range_steps_per_slot =
      h->chunk_slot_bytes / static_cast<int64_t>(sizeof(RangeStep));
  if (static_cast<int64_t>(range_steps.size()) > range_steps_per_slot) {
    return absl::InvalidArgumentError(
        absl::StrCat("commit carries ", range_steps.size(), " range steps; one shm chunk slot of ",
                     h->chunk_slot_bytes, " bytes holds at most ", range_steps_per_slot));
  }
  OFFLOAD_RETURN_IF_ERROR(PendingError());
  uint32_t range_steps_slot = 0;
  if (!range_steps.empty()) {
    // Through a chunk slot, as a gradient chunk: the slot is free once the shard released it.
    const uint32_t slots = h->chunk_slots;
    if (slots == 0) return absl::FailedPreconditionError("the shm segment has no chunk slots");
    OFFLOAD_RETURN_IF_ERROR(a_->WaitUntil(
        [&] { return a_->slot_uses - h->slots_released.load(std::memory_order_acquire) < slots; }));
    range_steps_slot = a_->slot_uses % slots;
    std::memcpy(a_->segment().slot(range_steps_slot), range_steps.data(),
                range_steps.size() * sizeof(RangeStep));
    ++a_->slot_uses;
  }
  const int64_t length = h->range_length;
  // Zeroed before the push (which releases it): the shard writes it only for this commit.
  h->params_published.store(0, std::memory_order_relaxed);
  ShmCommand cmd{};
  cmd.kind = static_cast<uint32_t>(ShmCommandKind::kCommit);
  cmd.step = step_;
  cmd.lr = lr;
  cmd.grad_multiplier = grad_multiplier;
  cmd.skip = skip;
  cmd.group_count = static_cast<uint32_t>(group_lr.size());
  std::copy(group_lr.begin(), group_lr.end(), cmd.group_lr);
  cmd.slot = range_steps_slot;
  cmd.n = static_cast<int64_t>(range_steps.size());
  absl::StatusOr<uint32_t> seq = a_->Push(cmd);
  if (!seq.ok()) {
    done_ = true;
    return seq.status();
  }
  // Hand each wave over as it is published, while the shard computes the next one.
  const char* area = a_->segment().param_area();
  int64_t copied = 0;
  bool bad_progress = false;
  auto copy_published = [&] {
    const int64_t published = h->params_published.load(std::memory_order_acquire);
    if (published < copied || published > length) {
      bad_progress = true;
      return;
    }
    if (published > copied) on_wave(copied, published - copied, area + copied * 2);
    copied = published;
  };
  absl::Status waited = a_->WaitUntil([&] {
    const bool replied = h->reply_seq.load(std::memory_order_acquire) == *seq;
    copy_published();  // after the reply's acquire: everything published is visible
    return replied || bad_progress;
  });
  done_ = true;
  if (!waited.ok()) return waited;
  if (bad_progress) {
    a_->busy().store(false);
    return absl::DataLossError("shard published parameters outside the range");
  }
  a_->busy().store(false);
  OFFLOAD_RETURN_IF_ERROR(a_->ReplyStatus());
  const ShmReply& r = h->reply;
  v1::StepResult result;
  result.set_step(r.step);
  result.set_applied(r.applied != 0);
  result.set_replayed(r.replayed != 0);
  result.set_skipped(r.skipped != 0);
  result.set_adam_step(r.adam_step);
  result.set_skipped_steps(r.skipped_steps);
  result.set_early_updated(r.early_updated);
  result.set_early_rolled_back(r.early_rolled_back);
  if (result.step() != step_) {
    return absl::DataLossError(
        absl::StrCat("shard answered step ", result.step(), " to the commit of step ", step_));
  }
  const int64_t expected = result.skipped() ? 0 : length;
  if (copied != expected) {
    return absl::DataLossError(
        absl::StrCat("shard sent ", copied, " of ", expected, " parameters of the range"));
  }
  a_->timeout()->Record(absl::Now() - opened_);
  return result;
}

class ShmTransport final : public StepTransport {
 public:
  ShmTransport(ShardClient* control, const ShmOptions& options)
      : control_(control), options_(options) {}
  absl::string_view name() const override { return "shm"; }
  absl::StatusOr<std::unique_ptr<StepStream>> OpenStep(const std::string& job_id,
                                                       uint32_t range_index, int64_t range_offset,
                                                       int64_t range_length,
                                                       uint64_t step) override;

 private:
  absl::StatusOr<std::shared_ptr<Attachment>> Attach(const std::string& job_id,
                                                     uint32_t range_index);

  ShardClient* const control_;
  const ShmOptions options_;
  AttachmentCache<Attachment> attachments_;
};

absl::StatusOr<std::shared_ptr<Attachment>> ShmTransport::Attach(const std::string& job_id,
                                                                 uint32_t range_index) {
  return attachments_.Get(
      job_id, range_index, [](const Attachment& a) { return a.usable(); },
      [&]() -> absl::StatusOr<std::shared_ptr<Attachment>> {
        auto attachment = std::make_shared<Attachment>(control_->options().address, options_,
                                                       &control_->step_timeout());
        v1::AttachOpen open;
        open.set_job_id(job_id);
        open.set_range_index(range_index);
        open.set_plane(v1::DATA_PLANE_SHM);
        OFFLOAD_RETURN_IF_ERROR(attachment->Start(control_, open));
        return attachment;
      });
}

absl::StatusOr<std::unique_ptr<StepStream>> ShmTransport::OpenStep(const std::string& job_id,
                                                                   uint32_t range_index,
                                                                   int64_t range_offset,
                                                                   int64_t range_length,
                                                                   uint64_t step) {
  OFFLOAD_ASSIGN_OR_RETURN(std::shared_ptr<Attachment> a, Attach(job_id, range_index));
  ShmHeader* h = a->header();
  if (h->range_offset != range_offset || h->range_length != range_length) {
    return absl::InvalidArgumentError(
        absl::StrCat("range ", range_index, " of job ", job_id, " is [", h->range_offset, ", ",
                     h->range_offset + h->range_length, ") on the shard, not [", range_offset, ", ",
                     range_offset + range_length, ")"));
  }
  if (a->busy().exchange(true)) {
    return absl::AbortedError(absl::StrCat("another step stream is open on range ", range_index,
                                           " of job ", job_id, " (this transport)"));
  }
  ShmCommand cmd{};
  cmd.kind = static_cast<uint32_t>(ShmCommandKind::kOpen);
  cmd.step = step;
  absl::StatusOr<uint32_t> seq = a->Push(cmd);
  absl::Status s = seq.status();
  if (s.ok()) {
    s = a->WaitUntil([&] { return h->reply_seq.load(std::memory_order_acquire) == *seq; });
  }
  if (s.ok()) s = a->ReplyStatus();
  if (!s.ok()) {
    a->busy().store(false);
    return s;
  }
  return std::unique_ptr<StepStream>(new ShmStepStream(std::move(a), step, *seq));
}

}  // namespace

absl::StatusOr<std::unique_ptr<StepTransport>> CreateShmTransport(ShardClient* control,
                                                                  const ShmOptions& options) {
  if (control == nullptr)
    return absl::InvalidArgumentError("CreateShmTransport: no control client");
  if (options.poll_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("ShmOptions::poll_interval must be positive");
  }
  return std::unique_ptr<StepTransport>(new ShmTransport(control, options));
}

absl::Status ProbeShm(ShardClient* control) {
  AttachClient link(
      control, absl::StrCat("the shm probe's Attach stream of shard ", control->options().address));
  v1::AttachOpen open;
  open.set_plane(v1::DATA_PLANE_SHM);
  OFFLOAD_ASSIGN_OR_RETURN(ShmSegment segment, Handshake(open, &link));
  return link.Close();
}

}  // namespace offload
