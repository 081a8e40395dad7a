#include "cpu_optimizer_server/grpc/optimizer_service.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cpu_optimizer_server/grpc/grpc_tuning.h"
#include "cpu_optimizer_server/grpc/step_wire.h"
#include "cpu_optimizer_server/shard/param_groups.h"
#include "cpu_optimizer_server/shard/state_loader.h"
#include "cpu_optimizer_server/shard/step_session.h"
#include "cpu_optimizer_server/shm/shm_server.h"
#include "google/protobuf/descriptor.h"
#ifdef OFFLOAD_HAVE_UCX
#include "cpu_optimizer_server/ucx/ucx_server.h"
#endif
#include "base/grpc_status.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "base/watchdog.h"
#include "cpu_optimizer_server/shard/server_metrics.h"
#include "cpu_optimizer_server/shard/wire_convert.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"

namespace offload {

namespace {

// Offsets on the wire are uint64. Ranges end below 2^51 (CreateJob checks), so clamping at 2^62
// keeps every offset + length sum in int64 while still being out of every range.
int64_t WireOffset(uint64_t offset) {
  constexpr uint64_t kMax = uint64_t{1} << 62;
  return static_cast<int64_t>(offset > kMax ? kMax : offset);
}

// Writes each finished wave of 16-bit parameters as one ParamChunk message whose payload is a slice
// over the buffer the kernel wrote the wave into (step_wire.h), so the only copies are the
// kernel's. The buffers come from the service's pool: gRPC may still hold a slot's last wave when
// the slot comes round again, and the pool then hands out another.
class GrpcParamSink final : public ParamSink {
 public:
  GrpcParamSink(OptimizerService::RawStepStream* stream, DType dtype, SliceBufferPool* pool)
      : stream_(stream), dtype_(DTypeToProto(dtype)), pool_(pool) {}
  void* Buffer(int slot, int64_t offset, int64_t n) override {
    Slot& s = slots_[slot];
    s.buffer = pool_->Take(n * 2);
    s.offset = offset;
    s.n = n;
    return s.buffer->data();
  }
  bool Send(int slot) override {
    Slot& s = slots_[slot];
    ServerMetrics::Get().Sent(DataPlane::kGrpc, s.n * 2);
    const char* data = s.buffer->data();
    return stream_->Write(ParamChunkMessage(static_cast<uint64_t>(s.offset), dtype_,
                                            SharedSlice(std::move(s.buffer), data, s.n * 2)));
  }

 private:
  struct Slot {
    std::shared_ptr<SliceBuffer> buffer;
    int64_t offset = 0;
    int64_t n = 0;
  };
  OptimizerService::RawStepStream* const stream_;
  const v1::DType dtype_;
  SliceBufferPool* const pool_;
  Slot slots_[2];
};

// The index of OptimizerShard.Step among the service's methods (the generated code's order is the
// proto's).
int StepMethodIndex() {
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          v1::OptimizerShard::service_full_name());
  return service->FindMethodByName("Step")->index();
}

}  // namespace

grpc::Status OptimizerService::CheckJob(const grpc::ServerContextBase& context,
                                        const std::string& job_id) const {
  return access_ == nullptr ? grpc::Status::OK : access_->CheckJob(context, job_id);
}

grpc::Status OptimizerService::CheckCaller(const grpc::ServerContextBase& context,
                                           ShardAccess::Caller* caller) const {
  if (access_ == nullptr) {
    caller->all_jobs = true;
    return grpc::Status::OK;
  }
  return access_->CheckCaller(context, caller);
}

grpc::Status OptimizerService::CreateJob(grpc::ServerContext* context,
                                         const v1::CreateJobRequest* request,
                                         v1::CreateJobResponse* response) {
  if (grpc::Status s = CheckJob(*context, request->job_id()); !s.ok()) return s;
  absl::StatusOr<JobConfig> config = JobConfigFromProto(*request);
  if (!config.ok()) return ToGrpcStatus(config.status());
  absl::StatusOr<int64_t> bytes = store_->CreateJob(*config);
  if (!bytes.ok()) return ToGrpcStatus(bytes.status());
  // The attempt may have been withdrawn while the state was allocated, after its withdrawal
  // dropped what was there: asking again and dropping ours leaves no orphan either way (the
  // withdrawal revokes before it drops).
  if (grpc::Status s = CheckJob(*context, request->job_id()); !s.ok()) {
    store_->DropJob(request->job_id()).IgnoreError();
    return s;
  }
  response->set_state_bytes(*bytes);
  if (absl::StatusOr<std::shared_ptr<Job>> job = store_->FindJob(request->job_id()); job.ok()) {
    const bool on_disk = (*job)->config.state_tier == StateTier::kDisk;
    response->set_state_tier(on_disk ? v1::STATE_TIER_DISK : v1::STATE_TIER_MEMORY);
    response->set_disk_bytes((*job)->disk_bytes());
    // Where a job's state went is an operator's first question about a slow or full server.
    LOG(INFO) << "cpu_optimizer_server: job " << request->job_id() << ": " << (*job)->ranges.size()
              << " ranges, state "
              << (on_disk ? absl::StrCat("on disk (", (*job)->disk_bytes(), " bytes in ",
                                         store_->disk()->dir(), ")")
                          : absl::StrCat("in memory (", *bytes, " bytes)"));
  }
  return grpc::Status::OK;
}

grpc::Status OptimizerService::LoadState(grpc::ServerContext* context,
                                         grpc::ServerReader<v1::LoadStateRequest>* reader,
                                         v1::LoadStateResponse* response) {
  ShardAccess::Caller caller;  // a caller this server knows, before anything is read
  if (grpc::Status s = CheckCaller(*context, &caller); !s.ok()) return s;
  v1::LoadStateRequest request;
  if (!reader->Read(&request)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "empty LoadState stream");
  }
  if (grpc::Status s = CheckJob(*context, request.job_id()); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<StateLoader>> loader =
      StateLoader::Start(store_, request.job_id());
  if (!loader.ok()) return ToGrpcStatus(loader.status());
  if (request.set_steps()) {
    absl::Status s = (*loader)->SetSteps(request.completed_step(), request.adam_step());
    if (!s.ok()) return ToGrpcStatus(s);
  }
  bool first = true;
  do {
    if (!request.job_id().empty() && request.job_id() != (*loader)->job_id()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "job_id changed within one LoadState stream");
    }
    if (!first && request.set_steps()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "set_steps is only read from the first LoadState message");
    }
    first = false;
    for (v1::StateChunk& chunk : *request.mutable_chunks()) {
      absl::StatusOr<StateTensor> tensor = StateTensorFromProto(chunk.tensor(), "chunk.tensor");
      if (!tensor.ok()) return ToGrpcStatus(tensor.status());
      absl::StatusOr<DType> dtype = DTypeFromProto(chunk.dtype(), "chunk.dtype");
      if (!dtype.ok()) return ToGrpcStatus(dtype.status());
      if (absl::Status s = (*loader)->AddChunk(*tensor, WireOffset(chunk.offset()), *dtype,
                                               std::move(*chunk.mutable_data()));
          !s.ok()) {
        return ToGrpcStatus(s);
      }
    }
  } while (reader->Read(&request));
  if (context->IsCancelled()) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "load cancelled; nothing was applied");
  }
  absl::StatusOr<int64_t> loaded = (*loader)->Apply();
  if (!loaded.ok()) return ToGrpcStatus(loaded.status());
  response->set_elements_loaded(*loaded);
  return grpc::Status::OK;
}

void OptimizerService::ServeStepOnRawBytes() {
  MarkMethodStreamed(StepMethodIndex(),
                     new grpc::internal::BidiStreamingHandler<OptimizerService, grpc::ByteBuffer,
                                                              grpc::ByteBuffer>(
                         [](OptimizerService* service, grpc::ServerContext* context,
                            RawStepStream* stream) { return service->RawStep(context, stream); },
                         this));
}

grpc::Status OptimizerService::RawStep(grpc::ServerContext* context, RawStepStream* stream) {
  ShardAccess::Caller caller;  // a caller this server knows, before anything is read
  if (grpc::Status s = CheckCaller(*context, &caller); !s.ok()) return s;
  // The received messages whose bytes gradient chunks are read from in place, and their bytes
  // in the memory budget; both outlive the session, which reads them until its commit ends.
  std::vector<grpc::ByteBuffer> held;
  Reservation held_bytes;
  grpc::ByteBuffer buffer;
  StepRequestView view;
  if (!stream->Read(&buffer)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "empty step stream");
  }
  if (absl::Status s = ParseStepRequest(&buffer, &view); !s.ok()) return ToGrpcStatus(s);
  if (view.is_grad || !view.request.has_open()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "the first message of a step stream must be `open`");
  }
  const v1::StepOpen open = view.request.open();
  if (grpc::Status s = CheckJob(*context, open.job_id()); !s.ok()) return s;
  absl::StatusOr<std::unique_ptr<StepSession>> session =
      StepSession::Open(store_, open.job_id(), open.range_index(), open.step());
  if (!session.ok()) return ToGrpcStatus(session.status());

  StepCommitArgs commit;
  for (;;) {
    if (!stream->Read(&buffer)) {
      // The client went away or closed its side without committing: drop the gradients.
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          "step stream ended before the commit; nothing was applied");
    }
    if (absl::Status s = ParseStepRequest(&buffer, &view); !s.ok()) return ToGrpcStatus(s);
    const v1::StepRequest& request = view.request;
    if (view.is_grad) {
      if (!v1::DType_IsValid(view.dtype)) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("grad.dtype ", view.dtype, " is not a DType"));
      }
      absl::StatusOr<DType> dtype =
          DTypeFromProto(static_cast<v1::DType>(view.dtype), "grad.dtype");
      if (!dtype.ok()) return ToGrpcStatus(dtype.status());
      const int64_t bytes = static_cast<int64_t>(view.size);
      const int size = DTypeSize(*dtype);
      // In place only where the payload is aligned for its dtype: it sits wherever gRPC's frame
      // and message headers left it in the receive slice, and the session reads it as an array.
      const bool in_place = !view.accumulate && view.copied.empty() && bytes > 0 &&
                            bytes % size == 0 && reinterpret_cast<uintptr_t>(view.data) % size == 0;
      absl::Status added;
      if (in_place) {
        // Read where gRPC received it: the buffer is kept (and counted) until the step ends.
        absl::StatusOr<Reservation> taken = store_->budget()->Take(bytes, "gradients in flight");
        if (!taken.ok()) return ToGrpcStatus(taken.status());
        added =
            (*session)->AddGradientsView(WireOffset(view.offset), *dtype, view.data, bytes / size);
        if (added.ok()) {
          held_bytes.Absorb(*std::move(taken));
          held.push_back(std::move(buffer));
        }
      } else {
        // Accumulated (folded at once), split across gRPC's slices (copied already),
        // misaligned, or malformed (the session says how).
        std::string data =
            view.copied.empty() ? std::string(view.data, view.size) : std::move(view.copied);
        added = (*session)->AddGradients(WireOffset(view.offset), *dtype, view.accumulate,
                                         std::move(data));
      }
      if (!added.ok()) return ToGrpcStatus(added);
      ServerMetrics::Get().Received(DataPlane::kGrpc, bytes);
    } else if (request.has_update()) {
      const v1::StepUpdate& u = request.update();
      if (u.group_lr_size() > kMaxParamGroups) {
        return grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("update carries ", u.group_lr_size(), " group lrs; at most ",
                         kMaxParamGroups, " parameter groups are allowed"));
      }
      StepCommitArgs args;
      args.step = u.step();
      args.lr = u.lr();
      args.grad_multiplier = u.grad_multiplier();
      args.group_lr.assign(u.group_lr().begin(), u.group_lr().end());
      const int64_t offset = WireOffset(u.offset()), n = WireOffset(u.n());
      // One t for all of them; its bound (the range's next step) is the session's to check.
      if (u.t() > 0 && n > 0) args.range_steps.push_back(RangeStep{offset, n, u.t()});
      // A decline needs no answer: the commit updates those elements as usual.
      absl::StatusOr<bool> applied = (*session)->UpdateEarly(args, offset, n);
      if (!applied.ok()) return ToGrpcStatus(applied.status());
    } else if (request.has_commit()) {
      commit.step = request.commit().step();
      commit.lr = request.commit().lr();
      commit.grad_multiplier = request.commit().grad_multiplier();
      commit.skip = request.commit().skip();
      commit.group_lr.assign(request.commit().group_lr().begin(),
                             request.commit().group_lr().end());
      commit.range_steps.reserve(request.commit().range_steps_size());
      for (const v1::RangeStep& rs : request.commit().range_steps()) {
        // Values past int64 read as negative, which the session refuses with the entry named.
        commit.range_steps.push_back(RangeStep{static_cast<int64_t>(rs.offset()),
                                               static_cast<int64_t>(rs.length()), rs.t()});
      }
      break;
    } else if (request.has_open()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "`open` sent twice in one stream");
    } else {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "empty StepRequest");
    }
  }

  GrpcParamSink sink(stream, (*session)->param_dtype(), &wave_buffers_);
  absl::StatusOr<StepOutcome> outcome = (*session)->Commit(commit, &sink);
  if (!outcome.ok()) return ToGrpcStatus(outcome.status());
  if (outcome->receiver_gone) {
    return grpc::Status(grpc::StatusCode::CANCELLED,
                        "client left while parameters streamed back; the step was applied whole "
                        "and a replay of it returns them");
  }
  v1::StepResponse response;
  v1::StepResult* result = response.mutable_result();
  result->set_step(outcome->step);
  result->set_applied(outcome->applied);
  result->set_replayed(outcome->replayed);
  result->set_skipped(outcome->skipped);
  result->set_adam_step(outcome->adam_step);
  result->set_skipped_steps(outcome->skipped_steps);
  result->set_early_updated(outcome->early_updated);
  result->set_early_rolled_back(outcome->early_rolled_back);
  stream->Write(SerializedMessage(response));
  return grpc::Status::OK;
}

grpc::Status OptimizerService::ReadState(grpc::ServerContext* context,
                                         const v1::ReadStateRequest* request,
                                         grpc::ServerWriter<v1::StateChunk>* writer) {
  if (grpc::Status s = CheckJob(*context, request->job_id()); !s.ok()) return s;
  absl::StatusOr<StateTensor> tensor = StateTensorFromProto(request->tensor(), "tensor");
  if (!tensor.ok()) return ToGrpcStatus(tensor.status());
  absl::StatusOr<DType> dtype = DTypeFromProto(request->dtype(), "dtype");
  if (!dtype.ok()) return ToGrpcStatus(dtype.status());
  // Keep every chunk under the message limit, with room for the header fields.
  const int64_t max_elements = (max_message_bytes_ - 1024) / DTypeSize(*dtype);
  int64_t chunk_elements = static_cast<int64_t>(
      std::min<uint64_t>(request->chunk_elements(), static_cast<uint64_t>(max_elements)));
  if (chunk_elements == 0) chunk_elements = std::min(store_->options().wave_elements, max_elements);
  v1::StateChunk message;
  message.set_tensor(request->tensor());
  message.set_dtype(request->dtype());
  absl::Status s =
      store_->ReadState(request->job_id(), *tensor, *dtype, WireOffset(request->range().offset()),
                        WireOffset(request->range().length()), chunk_elements,
                        [&](int64_t offset, int64_t n, const std::string& bytes) {
                          message.set_offset(offset);
                          message.set_data(bytes);
                          return writer->Write(message);
                        });
  return ToGrpcStatus(s);
}

grpc::Status OptimizerService::DropJob(grpc::ServerContext* context,
                                       const v1::DropJobRequest* request,
                                       v1::DropJobResponse* response) {
  if (grpc::Status s = CheckJob(*context, request->job_id()); !s.ok()) return s;
  return ToGrpcStatus(store_->DropJob(request->job_id()));
}

grpc::Status OptimizerService::DescribeShard(grpc::ServerContext* context,
                                             const v1::DescribeShardRequest* request,
                                             v1::DescribeShardResponse* response) {
  ShardAccess::Caller caller;
  if (grpc::Status s = CheckCaller(*context, &caller); !s.ok()) return s;
  response->set_simd_path(std::string(SimdPathName(store_->simd_path())));
  response->set_threads(store_->pool()->num_threads());
  response->set_memory_limit_bytes(store_->budget()->limit());
  response->set_memory_used_bytes(store_->budget()->used());
  response->set_max_message_bytes(max_message_bytes_);
  if (const DiskTier* disk = store_->disk(); disk != nullptr) {
    response->set_state_dir(disk->dir());
    response->set_disk_free_bytes(std::max<int64_t>(0, disk->FreeBytes()));
    response->set_state_memory_bytes(disk->ring_bytes());
  }
  for (DataPlaneServer* plane : data_planes_) response->add_data_planes(plane->plane());
  for (const std::shared_ptr<Job>& job : store_->Jobs()) {
    if (!caller.Sees(job->config.job_id)) continue;
    v1::JobStatus* status = response->add_jobs();
    status->set_job_id(job->config.job_id);
    *status->mutable_adam() = AdamConfigToProto(job->config.adam);
    status->set_param_dtype(DTypeToProto(job->config.param_dtype));
    status->set_state_bytes(job->state_bytes());
    status->set_state_tier(job->config.state_tier == StateTier::kDisk ? v1::STATE_TIER_DISK
                                                                      : v1::STATE_TIER_MEMORY);
    status->set_state_dtype(DTypeToProto(job->config.state_dtype));
    status->set_state_rounding(job->config.state_rounding == StateRounding::kNearest
                                   ? v1::STATE_ROUNDING_NEAREST
                                   : v1::STATE_ROUNDING_STOCHASTIC);
    status->set_disk_bytes(job->disk_bytes());
    for (const auto& r : job->ranges) {
      v1::RangeStatus* rs = status->add_ranges();
      rs->mutable_range()->set_offset(r->spec.offset);
      rs->mutable_range()->set_length(r->spec.length);
      std::lock_guard<std::mutex> lock(r->mu);
      rs->set_completed_step(r->completed_step);
      rs->set_adam_step(r->adam_step);
      rs->set_skipped_steps(r->skipped_steps());
      rs->set_has_accumulator(r->accumulator != nullptr);
    }
  }
  return grpc::Status::OK;
}

grpc::Status OptimizerService::Attach(grpc::ServerContext* context, AttachStream* stream) {
  ShardAccess::Caller caller;  // a caller this server knows, before anything is read
  if (grpc::Status s = CheckCaller(*context, &caller); !s.ok()) return s;
  v1::AttachRequest request;
  Watchdog watchdog(setup_timeout_, [context] { context->TryCancel(); });
  const bool opened = stream->Read(&request);
  if (!watchdog.Disarm()) {
    return grpc::Status(
        grpc::StatusCode::DEADLINE_EXCEEDED,
        absl::StrCat("no AttachOpen within ", absl::FormatDuration(setup_timeout_)));
  }
  if (!opened) return grpc::Status(grpc::StatusCode::CANCELLED, "no AttachOpen");
  if (!request.has_open()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "the first message of an Attach stream must be an AttachOpen");
  }
  const v1::AttachOpen& open = request.open();
  if (!open.job_id().empty()) {
    if (grpc::Status s = CheckJob(*context, open.job_id()); !s.ok()) return s;
  }
  for (DataPlaneServer* plane : data_planes_) {
    if (plane->plane() == open.plane()) return plane->Serve(open, context, stream);
  }
  return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                      absl::StrCat("this server does not offer the ",
                                   v1::DataPlane_Name(open.plane()), " data plane"));
}

absl::StatusOr<std::unique_ptr<OptimizerServer>> OptimizerServer::Start(
    const ServerOptions& options, ShardStore* store) {
  const int64_t wave_bytes = store->options().wave_elements * 2;
  if (wave_bytes + 1024 > options.max_message_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a wave of ", store->options().wave_elements, " 16-bit parameters (",
                     wave_bytes, " bytes) does not fit the ", options.max_message_bytes,
                     " byte message limit: lower --wave_elements or raise --max_message_mib"));
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  std::unique_ptr<OptimizerServer> server(new OptimizerServer());
  if (options.enable_shm) {
    ShmOptions shm_options;
    shm_options.setup_timeout = options.attach_setup_timeout;
    server->data_planes_.push_back(CreateShmServer(store, shm_options));
  }
#ifdef OFFLOAD_HAVE_UCX
  if (options.enable_ucx) {
    UcxOptions ucx_options;
    ucx_options.net_devices = options.ucx_net_devices;
    OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<DataPlaneServer> ucx,
                             CreateUcxServer(store, ucx_options));
    server->data_planes_.push_back(std::move(ucx));
  }
#endif
  std::vector<DataPlaneServer*> planes;
  for (const auto& plane : server->data_planes_) planes.push_back(plane.get());
  server->service_ = std::make_unique<OptimizerService>(
      store, options.max_message_bytes, std::move(planes), options.attach_setup_timeout);
  server->service_->SetAccess(options.access);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(
      options.listen_address,
      options.credentials != nullptr ? options.credentials : grpc::InsecureServerCredentials(),
      &server->port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  // Trainers ping every 10 s to notice a dead shard; accept that instead of closing on them.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  ApplyBulkTransferArgs(
      [&](const char* name, int value) { builder.AddChannelArgument(name, value); });
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("could not listen on ", options.listen_address,
                     " (address in use, or not an address this host has)"));
  }
  return server;
}

void OptimizerServer::Shutdown() {
  if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
}

OptimizerServer::~OptimizerServer() { Shutdown(); }

}  // namespace offload
