#include "cpu_optimizer_server/grpc/shard_client.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "base/dtype_proto.h"
#include "base/grpc_status.h"
#include "base/status_macros.h"
#include "cpu_optimizer_server/grpc/grpc_tuning.h"
#include "cpu_optimizer_server/grpc/step_wire.h"

namespace offload {

namespace {

// The method the generated stub calls; the bytes are its messages (step_wire.h).
constexpr char kStepMethod[] = "/offload.v1.OptimizerShard/Step";

}  // namespace

absl::StatusOr<std::unique_ptr<ShardClient>> ShardClient::Connect(const ClientOptions& options) {
  if (options.num_channels < 1) return absl::InvalidArgumentError("num_channels must be >= 1");
  if (options.chunk_bytes < 64 || options.chunk_bytes > options.max_message_bytes - 1024) {
    return absl::InvalidArgumentError(absl::StrCat("chunk_bytes ", options.chunk_bytes,
                                                   " must be in [64, max_message_bytes - 1024]"));
  }
  std::unique_ptr<ShardClient> client(new ShardClient(options));
  const gpr_timespec deadline = gpr_time_add(
      gpr_now(GPR_CLOCK_MONOTONIC),
      gpr_time_from_millis(absl::ToInt64Milliseconds(options.connect_timeout), GPR_TIMESPAN));
  OFFLOAD_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                           MakeChannelCredentials(options.tls));
  for (int i = 0; i < options.num_channels; ++i) {
    grpc::ChannelArguments args = ChannelArgumentsFor(options.tls);
    args.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
    args.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
    // Without a channel-local subchannel pool, channels to one address share one connection.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    // A shard that vanishes without closing its connections is noticed within seconds.
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    ApplyBulkTransferArgs([&](const char* name, int value) { args.SetInt(name, value); });
    std::shared_ptr<grpc::Channel> channel =
        grpc::CreateCustomChannel(options.address, credentials, args);
    if (!channel->WaitForConnected(deadline)) {
      return absl::UnavailableError(absl::StrCat("optimizer shard at ", options.address,
                                                 " did not answer within ",
                                                 absl::FormatDuration(options.connect_timeout)));
    }
    client->stubs_.push_back(v1::OptimizerShard::NewStub(channel));
    client->raw_step_.push_back(std::make_unique<grpc::internal::RpcMethod>(
        kStepMethod, grpc::internal::RpcMethod::BIDI_STREAMING, channel));
    client->channels_.push_back(std::move(channel));
  }
  return client;
}

void ShardClient::Prepare(grpc::ClientContext* context) const {
  context->set_deadline(std::chrono::system_clock::now() +
                        absl::ToChronoMilliseconds(options_.call_timeout));
  AttachBearer(context, options_.token);
}

size_t ShardClient::Next() { return next_.fetch_add(1, std::memory_order_relaxed) % stubs_.size(); }

absl::StatusOr<v1::CreateJobResponse> ShardClient::CreateJob(const v1::CreateJobRequest& request) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::CreateJobResponse response;
  grpc::Status s = NextStub()->CreateJob(&context, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

absl::Status ShardClient::LoadState(const std::string& job_id, v1::StateTensor tensor,
                                    int64_t offset, const float* values, int64_t n) {
  return LoadState(job_id, {StateSliceRef{tensor, offset, values, n}}, nullptr);
}

absl::Status ShardClient::LoadState(const std::string& job_id,
                                    const std::vector<StateSliceRef>& slices,
                                    const StepCounters* steps) {
  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<StateLoadStream> load, OpenLoad(job_id, steps));
  for (const StateSliceRef& slice : slices) {
    if (!load->Add(slice).ok()) break;  // Finish says why
  }
  return load->Finish();
}

absl::StatusOr<std::unique_ptr<StateLoadStream>> ShardClient::OpenLoad(const std::string& job_id,
                                                                       const StepCounters* steps) {
  std::unique_ptr<StateLoadStream> load(new StateLoadStream());
  load->context_ = std::make_unique<grpc::ClientContext>();
  Prepare(load->context_.get());
  load->writer_ = NextStub()->LoadState(load->context_.get(), &load->response_);
  load->chunk_bytes_ = options_.chunk_bytes;
  load->request_.set_job_id(job_id);
  if (steps != nullptr) {
    load->request_.set_set_steps(true);
    load->request_.set_completed_step(steps->completed_step);
    load->request_.set_adam_step(steps->adam_step);
  }
  load->request_.add_chunks()->set_dtype(v1::DTYPE_FP32);
  return load;
}

absl::Status StateLoadStream::Add(const StateSliceRef& slice) {
  if (done_) return absl::FailedPreconditionError("the load stream is finished");
  v1::StateChunk* chunk = request_.mutable_chunks(0);
  chunk->set_tensor(slice.tensor);
  const int64_t per_chunk = chunk_bytes_ / 4;
  for (int64_t done = 0; open_ && done < slice.n; done += per_chunk) {
    const int64_t m = std::min(per_chunk, slice.n - done);
    chunk->set_offset(slice.offset + done);
    chunk->set_data(slice.values + done, m * 4);
    open_ = writer_->Write(request_);  // false: the shard ended the call; Finish says why
    wrote_ = true;
    // The job id and step counters travel in the first message only.
    request_.clear_job_id();
    request_.clear_set_steps();
    request_.clear_completed_step();
    request_.clear_adam_step();
  }
  if (!open_) return absl::UnavailableError("the shard ended the load stream");
  return absl::OkStatus();
}

absl::Status StateLoadStream::Finish() {
  if (done_) return absl::FailedPreconditionError("the load stream is finished");
  done_ = true;
  if (!wrote_ && open_) {
    // A load of no chunks still names the job (and may set the counters).
    request_.clear_chunks();
    open_ = writer_->Write(request_);
  }
  writer_->WritesDone();
  return FromGrpcStatus(writer_->Finish());
}

void StateLoadStream::Cancel() {
  if (done_) return;
  done_ = true;
  // The shard applies a load only when the stream ends cleanly: a cancelled one changes nothing.
  context_->TryCancel();
  (void)writer_->Finish();
}

StateLoadStream::~StateLoadStream() { Cancel(); }

absl::Status ShardClient::ReadState(const std::string& job_id, v1::StateTensor tensor, DType dtype,
                                    int64_t offset, int64_t n, void* out) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::ReadStateRequest request;
  request.set_job_id(job_id);
  request.set_tensor(tensor);
  request.set_dtype(DTypeToProto(dtype));
  request.mutable_range()->set_offset(offset);
  request.mutable_range()->set_length(n);
  std::unique_ptr<grpc::ClientReader<v1::StateChunk>> reader =
      NextStub()->ReadState(&context, request);
  v1::StateChunk chunk;
  const int size = DTypeSize(dtype);
  int64_t received = 0;
  while (reader->Read(&chunk)) {
    const int64_t at = static_cast<int64_t>(chunk.offset()) - offset;
    const int64_t bytes = static_cast<int64_t>(chunk.data().size());
    if (at < 0 || bytes % size != 0 || at + bytes / size > n) {
      context.TryCancel();
      reader->Finish();
      return absl::DataLossError("shard sent a state chunk outside the range asked for");
    }
    std::memcpy(static_cast<char*>(out) + at * size, chunk.data().data(), bytes);
    received += bytes / size;
  }
  OFFLOAD_RETURN_IF_ERROR(FromGrpcStatus(reader->Finish()));
  if (received != n) {
    return absl::DataLossError(absl::StrCat("shard sent ", received, " of ", n, " elements"));
  }
  return absl::OkStatus();
}

absl::Status ShardClient::DropJob(const std::string& job_id) {
  grpc::ClientContext context;
  Prepare(&context);
  v1::DropJobRequest request;
  request.set_job_id(job_id);
  v1::DropJobResponse response;
  {
    std::lock_guard<std::mutex> lock(areas_mu_);
    for (auto it = areas_.lower_bound({job_id, 0});
         it != areas_.end() && it->first.first == job_id;) {
      it = it->second.taken ? std::next(it) : areas_.erase(it);
    }
  }
  return FromGrpcStatus(NextStub()->DropJob(&context, request, &response));
}

absl::StatusOr<v1::DescribeShardResponse> ShardClient::DescribeShard() {
  grpc::ClientContext context;
  Prepare(&context);
  v1::DescribeShardResponse response;
  grpc::Status s = NextStub()->DescribeShard(&context, v1::DescribeShardRequest(), &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

absl::StatusOr<std::unique_ptr<StepStream>> ShardClient::OpenStep(const std::string& job_id,
                                                                  uint32_t range_index,
                                                                  int64_t range_offset,
                                                                  int64_t range_length,
                                                                  uint64_t step) {
  std::unique_ptr<GrpcStepStream> s(new GrpcStepStream());
  s->context_ = std::make_unique<grpc::ClientContext>();
  Prepare(s->context_.get());
  // The call timeout bounds the whole stream; the step timeout each wait on the shard inside it.
  s->opened_ = absl::Now();
  s->limit_ = step_timeout_.Get();
  s->watch_ = std::make_unique<StallMonitor::Watch>(s->context_.get());
  stall_monitor_.Add(s->watch_.get());
  const size_t channel = Next();
  s->stream_.reset(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          channels_[channel].get(), *raw_step_[channel], s->context_.get()));
  s->client_ = this;
  s->step_ = step;
  s->range_offset_ = range_offset;
  s->range_length_ = range_length;
  s->chunk_bytes_ = options_.chunk_bytes;
  s->job_id_ = job_id;
  s->range_index_ = range_index;
  v1::StepOpen* open = s->request_.mutable_open();
  open->set_job_id(job_id);
  open->set_range_index(range_index);
  open->set_step(step);
  if (!s->WriteMessage(s->request_)) {
    s->done_ = true;
    return s->Finish();
  }
  return std::unique_ptr<StepStream>(std::move(s));
}

std::unique_ptr<grpc::ClientReaderWriter<v1::AttachRequest, v1::AttachResponse>>
ShardClient::Attach(grpc::ClientContext* context) {
  AttachBearer(context, options_.token);
  return NextStub()->Attach(context);
}

bool GrpcStepStream::Write(const grpc::ByteBuffer& message) {
  watch_->Begin(limit_);
  const bool written = stream_->Write(message);
  watch_->End();
  return written;
}

bool GrpcStepStream::WriteMessage(const v1::StepRequest& request) {
  return Write(SerializedMessage(request));
}

absl::Status GrpcStepStream::SendGradients(int64_t offset, const void* data, DType dtype, int64_t n,
                                           bool accumulate) {
  if (done_) return absl::FailedPreconditionError("step stream already finished");
  const int size = DTypeSize(dtype);
  const int64_t per_chunk = std::max<int64_t>(1, chunk_bytes_ / size);
  const v1::DType wire_dtype = DTypeToProto(dtype);
  const char* bytes = static_cast<const char*>(data);
  std::shared_ptr<SliceBuffer> area;
  {
    std::lock_guard<std::mutex> lock(area_mu_);
    area = area_;
  }
  // Sent from the gradient area where the caller wrote the chunk there, at its place.
  const bool in_area = area != nullptr && size == 2 && !accumulate && offset >= range_offset_ &&
                       n >= 0 && offset + n <= range_offset_ + range_length_ &&
                       bytes == area->data() + (offset - range_offset_) * 2;
  // Otherwise each chunk is copied once, into a buffer the message's slice owns, and sent from
  // there: the caller's memory is free again when this returns, whatever gRPC still holds.
  for (int64_t done = 0; done < n; done += per_chunk) {
    const int64_t m = std::min(per_chunk, n - done);
    grpc::Slice payload;
    if (in_area) {
      payload = SharedSlice(area, bytes + done * size, m * size);
    } else {
      std::shared_ptr<SliceBuffer> buffer = client_->chunk_buffers_.Take(m * size);
      std::memcpy(buffer->data(), bytes + done * size, m * size);
      char* copy = buffer->data();
      payload = SharedSlice(std::move(buffer), copy, m * size);
    }
    if (!Write(GradChunkMessage(static_cast<uint64_t>(offset + done), wire_dtype, accumulate,
                                payload))) {
      // The shard ended the stream (a refused chunk): its status says why.
      done_ = true;
      return Finish();
    }
  }
  return absl::OkStatus();
}

void* GrpcStepStream::GradientArea() {
  if (done_) return nullptr;
  // A trainer asks from the threads that produce gradients while its sender sends.
  std::lock_guard<std::mutex> lock(area_mu_);
  if (!area_asked_) {
    area_asked_ = true;
    area_ = client_->TakeGradientArea(job_id_, range_index_, range_length_ * 2, &area_id_);
  }
  return area_ != nullptr ? area_->data() : nullptr;
}

uint64_t GrpcStepStream::GradientAreaId() {
  if (GradientArea() == nullptr) return 0;
  std::lock_guard<std::mutex> lock(area_mu_);
  return area_id_;
}

void GrpcStepStream::ReturnArea(bool committed) {
  std::lock_guard<std::mutex> lock(area_mu_);
  area_asked_ = true;  // none after the step, even for a caller that asks too late
  if (area_ == nullptr) return;
  area_.reset();
  client_->ReturnGradientArea(job_id_, range_index_, committed);
}

std::shared_ptr<SliceBuffer> ShardClient::TakeGradientArea(const std::string& job_id,
                                                           uint32_t range_index, size_t bytes,
                                                           uint64_t* id) {
  // Ids are unique in the process, so a caller holding several clients' areas tells them apart.
  static std::atomic<uint64_t> next_id{1};
  std::lock_guard<std::mutex> lock(areas_mu_);
  GradientAreaSlot& slot = areas_[{job_id, range_index}];
  if (slot.taken) return nullptr;
  // After a step that did not commit, gRPC may still send from the old memory: use other memory
  // unless it has let go (with release order) of every slice.
  const bool free_of_grpc = slot.buffer != nullptr && HeldOnlyHere(slot.buffer);
  if (slot.buffer == nullptr || slot.buffer->capacity() < bytes ||
      !(slot.reusable || free_of_grpc)) {
    slot.buffer = std::make_shared<SliceBuffer>(bytes);
    slot.id = next_id.fetch_add(1);
  }
  slot.taken = true;
  slot.reusable = false;
  *id = slot.id;
  return slot.buffer;
}

void ShardClient::ReturnGradientArea(const std::string& job_id, uint32_t range_index,
                                     bool committed) {
  std::lock_guard<std::mutex> lock(areas_mu_);
  auto it = areas_.find({job_id, range_index});
  if (it == areas_.end()) return;
  it->second.taken = false;
  it->second.reusable = committed;
}

absl::Status GrpcStepStream::UpdateEarly(int64_t offset, int64_t n, uint64_t t, double lr,
                                         float grad_multiplier, absl::Span<const double> group_lr) {
  if (done_) return absl::FailedPreconditionError("step stream already finished");
  v1::StepUpdate* update = request_.mutable_update();
  update->set_step(step_);
  // Negative values travel as huge ones, which the shard refuses as it would these.
  update->set_offset(static_cast<uint64_t>(offset));
  update->set_n(static_cast<uint64_t>(n));
  update->set_t(t);
  update->set_lr(lr);
  update->set_grad_multiplier(grad_multiplier);
  update->mutable_group_lr()->Assign(group_lr.begin(), group_lr.end());
  if (!WriteMessage(request_)) {
    done_ = true;
    return Finish();
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::StepResult> GrpcStepStream::Commit(double lr, float grad_multiplier, bool skip,
                                                      void* params_out,
                                                      absl::Span<const double> group_lr,
                                                      absl::Span<const RangeStep> range_steps) {
  absl::StatusOr<v1::StepResult> result =
      CommitAndReceive(lr, grad_multiplier, skip, params_out, group_lr, range_steps);
  ReturnArea(/*committed=*/result.ok());
  return result;
}

absl::StatusOr<v1::StepResult> GrpcStepStream::CommitAndReceive(
    double lr, float grad_multiplier, bool skip, void* params_out,
    absl::Span<const double> group_lr, absl::Span<const RangeStep> range_steps) {
  if (done_) return absl::FailedPreconditionError("step stream already finished");
  v1::StepCommit* commit = request_.mutable_commit();
  commit->set_step(step_);
  commit->set_lr(lr);
  commit->mutable_group_lr()->Assign(group_lr.begin(), group_lr.end());
  commit->clear_range_steps();
  for (const RangeStep& rs : range_steps) {
    v1::RangeStep* out = commit->add_range_steps();
    // Negative values travel as huge ones, which the shard refuses as it would these.
    out->set_offset(static_cast<uint64_t>(rs.offset));
    out->set_length(static_cast<uint64_t>(rs.length));
    out->set_t(rs.t);
  }
  commit->set_grad_multiplier(grad_multiplier);
  commit->set_skip(skip);
  done_ = true;
  if (!WriteMessage(request_)) return Finish();
  watch_->Begin(limit_);
  stream_->WritesDone();
  watch_->End();
  v1::StepResult result;
  bool have_result = false;
  absl::Status bad_chunk;
  int64_t received = 0;
  char* const out = static_cast<char*>(params_out);
  ParamPlacement placement;
  placement.place = [&](uint64_t offset, int /*dtype*/, size_t bytes) -> char* {
    const int64_t at =
        static_cast<int64_t>(std::min<uint64_t>(offset, uint64_t{1} << 62)) - range_offset_;
    const int64_t n = static_cast<int64_t>(bytes / 2);
    if (at < 0 || bytes % 2 != 0 || at + n > range_length_) return nullptr;
    received += n;
    return out + at * 2;
  };
  grpc::ByteBuffer response;
  for (;;) {
    // Each wave is a wait on the shard's Adam pass.
    watch_->Begin(limit_);
    const bool read = stream_->Read(&response);
    watch_->End();
    if (!read) break;
    bad_chunk = ReadStepResponse(&response, placement, &result, &have_result);
    if (!bad_chunk.ok()) {
      context_->TryCancel();
      break;
    }
  }
  absl::Status s = Finish();
  if (!bad_chunk.ok()) return bad_chunk;
  if (!s.ok()) return s;
  if (!have_result) return absl::DataLossError("step stream ended without a result");
  if (result.step() != step_) {
    return absl::DataLossError(
        absl::StrCat("shard answered step ", result.step(), " to the commit of step ", step_));
  }
  // Waves do not overlap, so counting elements checks the whole range came back.
  const int64_t expected = result.skipped() ? 0 : range_length_;
  if (received != expected) {
    return absl::DataLossError(
        absl::StrCat("shard sent ", received, " of ", expected, " parameters of the range"));
  }
  client_->step_timeout().Record(absl::Now() - opened_);
  return result;
}

absl::Status GrpcStepStream::Finish() {
  watch_->Begin(limit_);
  const grpc::Status s = stream_->Finish();
  watch_->End();
  if (watch_->fired()) return absl::DeadlineExceededError(client_->step_timeout().Describe(limit_));
  return FromGrpcStatus(s);
}

void GrpcStepStream::Abandon() {
  if (done_) return;
  done_ = true;
  context_->TryCancel();
  stream_->Finish();
}

GrpcStepStream::~GrpcStepStream() {
  Abandon();
  ReturnArea(/*committed=*/false);
  // Before context_ goes: the monitor holds a pointer to it until Remove returns.
  if (watch_ != nullptr) client_->stall_monitor_.Remove(watch_.get());
}

}  // namespace offload
