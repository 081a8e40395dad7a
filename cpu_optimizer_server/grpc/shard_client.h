// Client of offload.v1.OptimizerShard: what a trainer rank uses to talk to one shard. It keeps a
// small pool of channels (one HTTP/2 connection carries about 1 GB/s; several streams in flight
// spread over them) and cuts tensors into chunks under the message limit.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_SHARD_CLIENT_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_SHARD_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/dtype.h"
#include "base/security/security.h"
#include "cpu_optimizer_server/grpc/slice_buffer_pool.h"
#include "cpu_optimizer_server/stall/stall_monitor.h"
#include "cpu_optimizer_server/stall/step_timeout.h"
#include "cpu_optimizer_server/transport/step_transport.h"
#include "grpcpp/grpcpp.h"
#include "offload/v1/optimizer.grpc.pb.h"

namespace offload {

struct ClientOptions {
  std::string address;  // host:port
  int num_channels = 2;
  int64_t chunk_bytes = int64_t{4} << 20;  // payload bytes per gradient / weight chunk
  int64_t max_message_bytes = int64_t{64} << 20;
  absl::Duration connect_timeout = absl::Seconds(10);
  // Deadline of every call, a whole step stream included. Keepalive notices a vanished host;
  // this bounds a live shard that stops answering, so a trainer never waits forever.
  absl::Duration call_timeout = absl::Minutes(10);
  // Inside a step, a shard that makes no progress is hung after step_timeout_multiple x its
  // median step, at least step_timeout_floor, at most call_timeout (step_timeout.h). A stopped
  // host is found sooner by keepalive.
  absl::Duration step_timeout_floor = absl::Seconds(60);
  double step_timeout_multiple = 10;
  // Each answer of a data plane's Attach set-up (the stream itself has no deadline: it lives as
  // long as the attachment).
  absl::Duration attach_setup_timeout = absl::Seconds(30);
  // Presented on every call as "authorization: Bearer <token>": the attempt's secret for a pool
  // server, an operator token for a standalone one (shard_access.h). None when empty.
  std::string token;
  // TLS (or mTLS, with a client certificate) to the shard when tls.ca_file is set.
  TlsConfig tls;
};

class ShardClient;

// fp32 values of one state tensor for flat elements [offset, offset + n).
struct StateSliceRef {
  v1::StateTensor tensor = v1::STATE_TENSOR_MASTER_WEIGHTS;
  int64_t offset = 0;
  const float* values = nullptr;  // (n,)
  int64_t n = 0;
};

// Step counters restored with a checkpoint's state.
struct StepCounters {
  uint64_t completed_step = 0;
  uint64_t adam_step = 0;
  // After a commit, summed over the slices committed (StepResult): elements updated during
  // backward whose update stood, and those undone and redone or skipped. Not part of a checkpoint.
  uint64_t early_updated = 0;
  uint64_t early_rolled_back = 0;
};

// One LoadState stream to one shard (ARCHITECTURE.md section 4.2): chunks go out as they are added,
// the shard applies them all when Finish closes the stream, and nothing when Cancel (or the
// destructor) ends it first. Made by ShardClient::OpenLoad.
class StateLoadStream {
 public:
  // (n,) fp32 values of one tensor, in messages of at most the client's chunk_bytes. An error
  // (the shard refused a chunk, or went away) ends the stream: Finish then says why.
  absl::Status Add(const StateSliceRef& slice);
  // Closes the stream and waits for the shard to apply the load.
  absl::Status Finish();
  void Cancel();
  ~StateLoadStream();

 private:
  friend class ShardClient;

  StateLoadStream() = default;

  std::unique_ptr<grpc::ClientContext> context_;
  v1::LoadStateResponse response_;
  std::unique_ptr<grpc::ClientWriter<v1::LoadStateRequest>> writer_;
  v1::LoadStateRequest request_;  // the first carries job id and step counters
  int64_t chunk_bytes_ = 0;
  bool open_ = true;    // false once the shard ended the call
  bool wrote_ = false;  // a message went out
  bool done_ = false;   // Finish or Cancel ran
};

// One step of one range over a gRPC Step stream. Made by ShardClient::OpenStep. The stream
// carries raw bytes (step_wire.h): a gradient chunk is copied once, into a buffer its message's
// slice owns, unless it was written into the gradient area, whose slices then go out as they are;
// parameter waves are read from gRPC's receive slices straight into params_out.
class GrpcStepStream final : public StepStream {
 public:
  absl::Status SendGradients(int64_t offset, const void* data, DType dtype, int64_t n,
                             bool accumulate = false) override;
  // The range's 16-bit gradients as gRPC sends them, owned by the client and kept for the range's
  // next steps (so a caller that page-locked it keeps its lock). Chunks sent from their place here
  // go out with no copy. gRPC may still hold slices of it after a step; once a commit returned,
  // the shard had every byte, so the next step of the range writes the same memory. After a
  // failed or abandoned step whose slices gRPC still holds, the next step gets other memory
  // (another GradientAreaId).
  void* GradientArea() override;
  uint64_t GradientAreaId() override;
  absl::StatusOr<v1::StepResult> Commit(double lr, float grad_multiplier, bool skip,
                                        void* params_out, absl::Span<const double> group_lr = {},
                                        absl::Span<const RangeStep> range_steps = {}) override;
  // Sent behind the gradients as a StepUpdate; the shard runs it when it reads it, and a refusal
  // ends the stream: the next call (at the latest the commit) returns the shard's error.
  absl::Status UpdateEarly(int64_t offset, int64_t n, uint64_t t, double lr, float grad_multiplier,
                           absl::Span<const double> group_lr) override;
  void Abandon() override;
  ~GrpcStepStream() override;

 private:
  friend class ShardClient;

  GrpcStepStream() = default;
  // Writes a small message (open, update, commit); false when the shard ended the stream.
  bool WriteMessage(const v1::StepRequest& request);
  absl::StatusOr<v1::StepResult> CommitAndReceive(double lr, float grad_multiplier, bool skip,
                                                  void* params_out,
                                                  absl::Span<const double> group_lr,
                                                  absl::Span<const RangeStep> range_steps);
  // Gives the gradient area back to the client; `committed`: the shard has all it was sent.
  void ReturnArea(bool committed);
  // The stream's end status; after the stall monitor cancelled it, the step timeout's.
  absl::Status Finish();
  // stream_->Write of a message, watched.
  bool Write(const grpc::ByteBuffer& message);

  ShardClient* client_ = nullptr;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream_;
  v1::StepRequest request_;  // reused for the small messages
  uint64_t step_ = 0;
  int64_t range_offset_ = 0;
  int64_t range_length_ = 0;
  int64_t chunk_bytes_ = 0;
  bool done_ = false;
  std::string job_id_;
  uint32_t range_index_ = 0;
  absl::Time opened_;     // for the step timeout's record
  absl::Duration limit_;  // the step timeout: the longest a blocking call may wait on the shard
  // Watched by the client's StallMonitor while a call blocks (Begin/End around it).
  std::unique_ptr<StallMonitor::Watch> watch_;
  std::mutex area_mu_;  // guards the three below
  bool area_asked_ = false;
  // (range_length_,) 16-bit values; null when none, and once given back
  std::shared_ptr<SliceBuffer> area_;
  uint64_t area_id_ = 0;
};

// The control plane to one shard, and its gRPC data plane.
class ShardClient final : public StepTransport {
 public:
  // Connects every channel; fails if the shard does not answer within the connect timeout.
  static absl::StatusOr<std::unique_ptr<ShardClient>> Connect(const ClientOptions& options);

  absl::StatusOr<v1::CreateJobResponse> CreateJob(const v1::CreateJobRequest& request);
  // Loads (n,) fp32 values of `tensor` for flat elements [offset, offset + n).
  absl::Status LoadState(const std::string& job_id, v1::StateTensor tensor, int64_t offset,
                         const float* values, int64_t n);
  // One all-or-nothing load of several slices; with `steps`, the ranges' step counters too.
  absl::Status LoadState(const std::string& job_id, const std::vector<StateSliceRef>& slices,
                         const StepCounters* steps);
  // A load streamed chunk by chunk (StateLoadStream); with `steps`, the ranges' counters too.
  absl::StatusOr<std::unique_ptr<StateLoadStream>> OpenLoad(const std::string& job_id,
                                                            const StepCounters* steps);
  // Reads (n,) values of flat elements [offset, offset + n) as dtype into out.
  absl::Status ReadState(const std::string& job_id, v1::StateTensor tensor, DType dtype,
                         int64_t offset, int64_t n, void* out);
  absl::Status DropJob(const std::string& job_id);
  absl::StatusOr<v1::DescribeShardResponse> DescribeShard();

  absl::string_view name() const override { return "grpc"; }
  // Opens the step stream of range `range_index` (flat [range_offset, +range_length)).
  absl::StatusOr<std::unique_ptr<StepStream>> OpenStep(const std::string& job_id,
                                                       uint32_t range_index, int64_t range_offset,
                                                       int64_t range_length,
                                                       uint64_t step) override;

  // The Attach stream of a data plane (shm_transport.h, ucx_transport.h): no deadline, since it
  // lives as long as the attachment; keepalive notices a vanished shard.
  std::unique_ptr<grpc::ClientReaderWriter<v1::AttachRequest, v1::AttachResponse>> Attach(
      grpc::ClientContext* context);
  const ClientOptions& options() const { return options_; }
  // The bound on a wait for this shard inside a step, which every plane's streams feed.
  StepTimeout& step_timeout() { return step_timeout_; }

 private:
  friend class GrpcStepStream;

  explicit ShardClient(const ClientOptions& options)
      : options_(options),
        step_timeout_(StepTimeoutOptions{options.call_timeout, options.step_timeout_floor,
                                         options.step_timeout_multiple}) {}
  // The gradient area of range `range_index` of job_id (GrpcStepStream::GradientArea) for a
  // stream, with its id; null when another stream of the range has it.
  std::shared_ptr<SliceBuffer> TakeGradientArea(const std::string& job_id, uint32_t range_index,
                                                size_t bytes, uint64_t* id);
  void ReturnGradientArea(const std::string& job_id, uint32_t range_index, bool committed);
  // The next channel's index, round robin.
  size_t Next();
  v1::OptimizerShard::Stub* NextStub() { return stubs_[Next()].get(); }
  // The call's deadline and credential.
  void Prepare(grpc::ClientContext* context) const;

  ClientOptions options_;
  StepTimeout step_timeout_;
  StallMonitor stall_monitor_;  // of the step streams' blocking calls
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<v1::OptimizerShard::Stub>> stubs_;
  // OptimizerShard.Step on each channel, for streams of raw bytes (step_wire.h).
  std::vector<std::unique_ptr<grpc::internal::RpcMethod>> raw_step_;
  // Copied gradient chunks' payloads: enough for the chunks gRPC's write buffer holds for a few
  // streams at once.
  SliceBufferPool chunk_buffers_{64};
  struct GradientAreaSlot {
    std::shared_ptr<SliceBuffer> buffer;
    uint64_t id = 0;
    bool taken = false;     // a stream has it
    bool reusable = false;  // its last step committed, so gRPC reads none of it any more
  };
  std::mutex areas_mu_;
  std::map<std::pair<std::string, uint32_t>, GradientAreaSlot> areas_;  // by (job, range)
  std::atomic<uint64_t> next_{0};
};

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_SHARD_CLIENT_H_
