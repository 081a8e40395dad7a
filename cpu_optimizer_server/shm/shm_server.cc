// The shard side of the shared-memory data plane (shm_transport.h).
//
// Liveness: Serve runs the command loop on the gRPC handler thread, and a second thread sits in
// stream->Read for the whole attachment. The trainer never sends anything after its proof, so
// Read returns only when the stream ends: the trainer closed it, its process died (the
// connection breaks) or the server is shutting down. The reader then raises `peer_gone` and
// wakes the loop's futex. The loop also checks context->IsCancelled() at each poll timeout, which
// covers a cancellation the reader has not seen yet. Either way the loop ends, the step's
// session is dropped (nothing applied) and the segment unmapped.
#include "cpu_optimizer_server/shm/shm_server.h"

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/grpc_status.h"
#include "base/watchdog.h"
#include "cpu_optimizer_server/shard/server_metrics.h"
#include "cpu_optimizer_server/shard/step_session.h"
#include "cpu_optimizer_server/shm/shm_segment.h"

namespace offload {
namespace {

// The Adam pass writes each wave straight into the segment's parameter area and publishes how
// far it got, so the trainer copies a wave out while the next one computes.
class ShmParamSink final : public ParamSink {
 public:
  explicit ShmParamSink(const ShmSegment* segment) : segment_(segment) {}
  void* Buffer(int slot, int64_t offset, int64_t n) override {
    ShmHeader* h = segment_->header();
    end_[slot] = offset - h->range_offset + n;
    n_[slot] = n;
    return segment_->param_area() + (offset - h->range_offset) * 2;
  }
  bool Send(int slot) override {
    ShmHeader* h = segment_->header();
    h->params_published.store(end_[slot], std::memory_order_release);
    h->shard_event.fetch_add(1, std::memory_order_release);
    ShmWake(&h->shard_event);
    ServerMetrics::Get().Sent(DataPlane::kShm, n_[slot] * 2);
    return true;  // the step completes whether or not the trainer is still there
  }

 private:
  const ShmSegment* const segment_;
  int64_t end_[2] = {0, 0};
  int64_t n_[2] = {0, 0};  // 16-bit values in each slot's wave
};

class ShmServer final : public DataPlaneServer {
 public:
  ShmServer(ShardStore* store, const ShmOptions& options) : store_(store), options_(options) {}
  v1::DataPlane plane() const override { return v1::DATA_PLANE_SHM; }
  grpc::Status Serve(const v1::AttachOpen& open, grpc::ServerContext* context,
                     AttachStream* stream) override;

 private:
  // Offers the segment, checks the proof and unlinks the name, whatever the outcome.
  grpc::Status Handshake(ShmSegment* segment, grpc::ServerContext* context, AttachStream* stream);
  // Serves commands until the stream ends.
  void ServeCommands(ShmSegment* segment, const std::string& job_id, uint32_t range_index,
                     grpc::ServerContext* context, AttachStream* stream);

  ShardStore* const store_;
  const ShmOptions options_;
};

grpc::Status ShmServer::Handshake(ShmSegment* segment, grpc::ServerContext* context,
                                  AttachStream* stream) {
  v1::AttachResponse offer;
  offer.mutable_shm()->set_segment_name(segment->name());
  offer.mutable_shm()->set_segment_bytes(segment->size());
  v1::AttachRequest request;
  Watchdog watchdog(options_.setup_timeout, [context] { context->TryCancel(); });
  const bool offered = stream->Write(offer);
  const bool answered = offered && stream->Read(&request);
  const bool in_time = watchdog.Disarm();
  // Proof or not, the name goes now: only the two mappings keep the memory alive, so no crash
  // of either side can leave a segment behind in /dev/shm.
  segment->Unlink();
  if (!in_time) {
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                        absl::StrCat("the trainer did not prove the shm offer within ",
                                     absl::FormatDuration(options_.setup_timeout)));
  }
  if (!answered) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "trainer left before proving the shm offer");
  }
  if (!request.has_proof()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "the second message of a shm Attach stream must be an AttachProof");
  }
  const std::string& secret = request.proof().secret();
  if (secret.size() != kShmSecretBytes ||
      !ShmSecretEquals(secret.data(), segment->header()->secret, kShmSecretBytes)) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        "AttachProof secret does not match the offered shm segment's: the "
                        "trainer cannot map this shard's shared memory");
  }
  v1::AttachResponse ready;
  ready.mutable_ready();
  if (!stream->Write(ready)) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "trainer left during the shm attach");
  }
  return grpc::Status::OK;
}

grpc::Status ShmServer::Serve(const v1::AttachOpen& open, grpc::ServerContext* context,
                              AttachStream* stream) {
  if (open.job_id().empty()) {
    // A probe: a header-only segment, proved and dropped.
    absl::StatusOr<ShmSegment> segment = ShmSegment::Create(ShmLayout{});
    if (!segment.ok()) return ToGrpcStatus(segment.status());
    if (grpc::Status s = Handshake(&*segment, context, stream); !s.ok()) return s;
    v1::AttachRequest request;
    while (stream->Read(&request)) {
    }
    return grpc::Status::OK;
  }

  // The same checks, and messages, as StepSession::Open.
  absl::StatusOr<ShardStore::JobRange> found =
      store_->FindJobRange(open.job_id(), open.range_index());
  if (!found.ok()) return ToGrpcStatus(found.status());
  const RangeSpec spec = found->range->spec;
  ShmLayout layout;
  layout.range_offset = spec.offset;
  layout.range_length = spec.length;
  layout.param_dtype = static_cast<uint32_t>(found->job->config.param_dtype);
  layout.chunk_slots = options_.chunk_slots;
  layout.chunk_slot_bytes = options_.chunk_slot_bytes;
  // The segment is memory the shard holds for the trainer: count it like gradients in flight.
  const int64_t bytes = static_cast<int64_t>(kShmHeaderBytes) + spec.length * 4 +
                        int64_t{options_.chunk_slots} * options_.chunk_slot_bytes;
  absl::StatusOr<Reservation> reservation = store_->budget()->Take(
      bytes,
      absl::StrCat("the shm segment of range ", open.range_index(), " of job ", open.job_id()));
  if (!reservation.ok()) return ToGrpcStatus(reservation.status());
  found->job.reset();  // a dropped job must not be kept alive by an idle attachment
  absl::StatusOr<ShmSegment> segment = ShmSegment::Create(layout);
  if (!segment.ok()) return ToGrpcStatus(segment.status());
  if (grpc::Status s = Handshake(&*segment, context, stream); !s.ok()) return s;
  ServeCommands(&*segment, open.job_id(), open.range_index(), context, stream);
  return grpc::Status::OK;
}

void ShmServer::ServeCommands(ShmSegment* segment, const std::string& job_id, uint32_t range_index,
                              grpc::ServerContext* context, AttachStream* stream) {
  ShmHeader* h = segment->header();
  std::atomic<bool> peer_gone{false};
  std::thread reader([&] {
    v1::AttachRequest ignored;
    while (stream->Read(&ignored)) {
    }
    peer_gone.store(true);
    ShmWake(&h->cmd_head);
  });

  std::unique_ptr<StepSession> session;
  absl::Status step_error;  // the first error of the current step, repeated to its COMMIT
  const int64_t range_offset = h->range_offset;
  const int64_t range_length = h->range_length;
  const uint32_t slots = h->chunk_slots;
  const int64_t slot_bytes = h->chunk_slot_bytes;

  auto reply = [&](uint32_t seq, const absl::Status& status, const StepOutcome* outcome) {
    ShmReply& r = h->reply;
    r.code = static_cast<int32_t>(status.code());
    const size_t len = std::min<size_t>(status.message().size(), kShmMessageBytes);
    // An OK status's message is an empty view with a null data(), and memcpy from null is
    // undefined even for 0 bytes (UBSan, issue 18).
    if (len > 0) std::memcpy(r.message, status.message().data(), len);
    r.message_bytes = static_cast<uint32_t>(len);
    StepOutcome none;
    if (outcome == nullptr) outcome = &none;
    r.step = outcome->step;
    r.adam_step = outcome->adam_step;
    r.skipped_steps = outcome->skipped_steps;
    r.applied = outcome->applied;
    r.replayed = outcome->replayed;
    r.skipped = outcome->skipped;
    r.early_updated = outcome->early_updated;
    r.early_rolled_back = outcome->early_rolled_back;
    h->reply_seq.store(seq, std::memory_order_release);
    h->shard_event.fetch_add(1, std::memory_order_release);
    ShmWake(&h->shard_event);
  };
  // Ends the step on its first error, as the gRPC Step stream does on the first bad chunk.
  auto fail = [&](uint32_t seq, absl::Status status) {
    session.reset();
    step_error = std::move(status);
    reply(seq, step_error, nullptr);
  };

  uint32_t tail = h->cmd_tail.load(std::memory_order_relaxed);
  for (;;) {
    const uint32_t head = h->cmd_head.load(std::memory_order_acquire);
    if (head == tail) {
      if (peer_gone.load() || context->IsCancelled()) break;
      ShmWait(&h->cmd_head, tail, options_.poll_interval);
      continue;
    }
    // Copied out: the trainer could rewrite the entry, and every field is checked before use.
    const ShmCommand cmd = h->ring[tail % kShmRingSize];
    const uint32_t seq = tail + 1;
    switch (static_cast<ShmCommandKind>(cmd.kind)) {
      case ShmCommandKind::kOpen: {
        session.reset();
        step_error = absl::OkStatus();
        absl::StatusOr<std::unique_ptr<StepSession>> opened =
            StepSession::Open(store_, job_id, range_index, cmd.step);
        if (opened.ok()) {
          session = *std::move(opened);
          reply(seq, absl::OkStatus(), nullptr);
        } else {
          fail(seq, opened.status());
        }
        break;
      }
      case ShmCommandKind::kGrad: {
        const bool in_place = cmd.slot == kShmInPlace;
        if (session != nullptr) {
          absl::Status s;
          if (cmd.dtype > 2) {
            s = absl::InvalidArgumentError(absl::StrCat("grad.dtype ", cmd.dtype, " is unknown"));
          } else if (in_place) {
            const DType dtype = static_cast<DType>(cmd.dtype);
            const int64_t at = cmd.offset - range_offset;
            if (DTypeSize(dtype) != 2) {
              s = absl::InvalidArgumentError("an in-place shm gradient chunk must be 16-bit");
            } else if (cmd.accumulate != 0) {
              s = absl::InvalidArgumentError(
                  "accumulate chunks travel through chunk slots, not in place");
            } else {
              // Validated by the session before anything is read; out of range points nowhere.
              const bool inside =
                  at >= 0 && at < range_length && cmd.n > 0 && cmd.n <= range_length - at;
              s = session->AddGradientsView(cmd.offset, dtype,
                                            segment->grad_area() + (inside ? at * 2 : 0), cmd.n);
            }
          } else {
            const DType dtype = static_cast<DType>(cmd.dtype);
            if (cmd.slot >= slots || cmd.n <= 0 || cmd.n * DTypeSize(dtype) > slot_bytes) {
              s = absl::InvalidArgumentError(absl::StrCat(
                  "shm gradient chunk names slot ", cmd.slot, " with ", cmd.n,
                  " elements; the segment has ", slots, " slots of ", slot_bytes, " bytes"));
            } else {
              s = session->AddGradients(
                  cmd.offset, dtype, cmd.accumulate != 0,
                  std::string(segment->slot(cmd.slot), cmd.n * DTypeSize(dtype)));
            }
          }
          if (s.ok()) {
            ServerMetrics::Get().Received(DataPlane::kShm,
                                          cmd.n * DTypeSize(static_cast<DType>(cmd.dtype)));
          }
          if (!s.ok()) fail(seq, std::move(s));
        }
        if (!in_place) {
          h->slots_released.fetch_add(1, std::memory_order_release);
          h->shard_event.fetch_add(1, std::memory_order_release);
          ShmWake(&h->shard_event);
        }
        break;
      }
      case ShmCommandKind::kCommit: {
        // The range steps are copied out of their slot first, and the slot released whatever
        // follows, as a GRAD's is: the trainer counts it used once it pushed the COMMIT.
        std::vector<RangeStep> range_steps;
        absl::Status range_steps_status;
        if (cmd.n != 0) {
          constexpr int64_t kRecord = sizeof(RangeStep);
          if (cmd.slot >= slots || cmd.n < 0 || cmd.n > slot_bytes / kRecord) {
            range_steps_status = absl::InvalidArgumentError(
                absl::StrCat("shm commit names slot ", cmd.slot, " with ", cmd.n,
                             " range steps; the segment has ", slots, " slots of ",
                             slot_bytes / kRecord, " range steps each"));
          } else {
            range_steps.resize(cmd.n);
            std::memcpy(range_steps.data(), segment->slot(cmd.slot), cmd.n * kRecord);
          }
          h->slots_released.fetch_add(1, std::memory_order_release);
          h->shard_event.fetch_add(1, std::memory_order_release);
          ShmWake(&h->shard_event);
        }
        if (session == nullptr) {
          reply(seq,
                step_error.ok() ? absl::FailedPreconditionError("COMMIT without an open step")
                                : step_error,
                nullptr);
          break;
        }
        StepCommitArgs args;
        args.step = cmd.step;
        args.lr = cmd.lr;
        args.grad_multiplier = cmd.grad_multiplier;
        args.skip = cmd.skip != 0;
        // The count comes from memory the trainer writes: bound it before reading the lrs.
        if (cmd.group_count > static_cast<uint32_t>(kMaxParamGroups)) {
          fail(seq, absl::InvalidArgumentError(absl::StrCat("commit carries ", cmd.group_count,
                                                            " group lrs; at most ", kMaxParamGroups,
                                                            " parameter groups are allowed")));
          break;
        }
        args.group_lr.assign(cmd.group_lr, cmd.group_lr + cmd.group_count);
        if (!range_steps_status.ok()) {
          fail(seq, std::move(range_steps_status));
          break;
        }
        // Their values are the session's to check, as gRPC's are.
        args.range_steps = std::move(range_steps);
        ShmParamSink sink(segment);
        absl::StatusOr<StepOutcome> outcome = session->Commit(args, &sink);
        session.reset();
        if (outcome.ok()) {
          reply(seq, absl::OkStatus(), &*outcome);
        } else {
          fail(seq, outcome.status());
        }
        break;
      }
      case ShmCommandKind::kUpdate: {
        if (session == nullptr) break;  // the step failed already; its COMMIT hears why
        // The count comes from memory the trainer writes: bound it before reading the lrs.
        if (cmd.group_count > static_cast<uint32_t>(kMaxParamGroups)) {
          fail(seq, absl::InvalidArgumentError(absl::StrCat("update carries ", cmd.group_count,
                                                            " group lrs; at most ", kMaxParamGroups,
                                                            " parameter groups are allowed")));
          break;
        }
        StepCommitArgs args;
        args.step = cmd.step;
        args.lr = cmd.lr;
        args.grad_multiplier = cmd.grad_multiplier;
        args.group_lr.assign(cmd.group_lr, cmd.group_lr + cmd.group_count);
        // One t for all of them; its bound (the range's next step) is the session's to check.
        if (cmd.t > 0 && cmd.n > 0) args.range_steps.push_back(RangeStep{cmd.offset, cmd.n, cmd.t});
        // A decline needs no answer: the commit updates those elements as usual.
        absl::StatusOr<bool> applied = session->UpdateEarly(args, cmd.offset, cmd.n);
        if (!applied.ok()) fail(seq, applied.status());
        break;
      }
      case ShmCommandKind::kAbandon:
        session.reset();
        step_error = absl::OkStatus();
        break;
      default:
        fail(seq, absl::InvalidArgumentError(absl::StrCat("unknown shm command kind ", cmd.kind)));
        break;
    }
    tail = seq;
    h->cmd_tail.store(tail, std::memory_order_release);
    h->shard_event.fetch_add(1, std::memory_order_release);
    ShmWake(&h->shard_event);
  }
  session.reset();
  // The reader leaves once the stream ends; a cancelled context ends it too.
  if (!peer_gone.load()) context->TryCancel();
  reader.join();
}

}  // namespace

std::unique_ptr<DataPlaneServer> CreateShmServer(ShardStore* store, const ShmOptions& options) {
  return std::make_unique<ShmServer>(store, options);
}

}  // namespace offload
