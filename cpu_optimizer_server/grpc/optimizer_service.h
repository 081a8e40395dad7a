// The gRPC face of a shard store: offload.v1.OptimizerShard. It only translates wire messages to
// ShardStore / StepSession / StateLoader calls and back; every rule lives in those.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_OPTIMIZER_SERVICE_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_OPTIMIZER_SERVICE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cpu_optimizer_server/grpc/shard_access.h"
#include "cpu_optimizer_server/grpc/slice_buffer_pool.h"
#include "cpu_optimizer_server/shard/shard_store.h"
#include "cpu_optimizer_server/transport/data_plane.h"
#include "grpcpp/grpcpp.h"
#include "offload/v1/optimizer.grpc.pb.h"

namespace offload {

class OptimizerService final : public v1::OptimizerShard::Service {
 public:
  // data_planes: the planes offered beside gRPC (not owned; may be empty).
  // setup_timeout bounds the wait for an Attach stream's first message.
  OptimizerService(ShardStore* store, int64_t max_message_bytes,
                   std::vector<DataPlaneServer*> data_planes = {},
                   absl::Duration setup_timeout = absl::Seconds(30))
      : store_(store),
        max_message_bytes_(max_message_bytes),
        data_planes_(std::move(data_planes)),
        setup_timeout_(setup_timeout) {
    ServeStepOnRawBytes();
  }

  // Who may call, for which jobs (shard_access.h); not owned. Without one every call is let in
  // (in-process tests and benchmarks). Set it before the service serves: it is read without a
  // lock. A refused call changes nothing.
  void SetAccess(const ShardAccess* access) { access_ = access; }

  grpc::Status CreateJob(grpc::ServerContext* context, const v1::CreateJobRequest* request,
                         v1::CreateJobResponse* response) override;
  grpc::Status LoadState(grpc::ServerContext* context,
                         grpc::ServerReader<v1::LoadStateRequest>* reader,
                         v1::LoadStateResponse* response) override;
  // OptimizerShard.Step, served on raw bytes (step_wire.h): the constructor installs it in place
  // of the generated handler, so a gradient chunk is read where gRPC received it and a wave of
  // parameters is sent from the buffer Adam wrote it into.
  using RawStepStream = grpc::ServerReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>;
  grpc::Status RawStep(grpc::ServerContext* context, RawStepStream* stream);
  grpc::Status ReadState(grpc::ServerContext* context, const v1::ReadStateRequest* request,
                         grpc::ServerWriter<v1::StateChunk>* writer) override;
  grpc::Status DropJob(grpc::ServerContext* context, const v1::DropJobRequest* request,
                       v1::DropJobResponse* response) override;
  grpc::Status DescribeShard(grpc::ServerContext* context, const v1::DescribeShardRequest* request,
                             v1::DescribeShardResponse* response) override;
  grpc::Status Attach(grpc::ServerContext* context, AttachStream* stream) override;

 private:
  void ServeStepOnRawBytes();
  // ShardAccess::CheckJob / CheckCaller, or OK without an access policy.
  grpc::Status CheckJob(const grpc::ServerContextBase& context, const std::string& job_id) const;
  grpc::Status CheckCaller(const grpc::ServerContextBase& context,
                           ShardAccess::Caller* caller) const;

  ShardStore* const store_;
  const int64_t max_message_bytes_;
  const std::vector<DataPlaneServer*> data_planes_;
  const absl::Duration setup_timeout_;
  const ShardAccess* access_ = nullptr;
  // The buffers parameter waves leave from (GrpcParamSink): two per stream committing, and those
  // gRPC still sends; 16 kept is 64 MiB at the default wave, enough for a few ranks at once.
  SliceBufferPool wave_buffers_{16};
};

// Options of a running server, shared by the binary, the tests and the benchmarks.
struct ServerOptions {
  std::string listen_address = "127.0.0.1:50051";  // port 0 picks a free one
  int64_t max_message_bytes = int64_t{64} << 20;
  bool enable_shm = true;  // offer the shared-memory data plane to trainers on this host
  bool enable_ucx = true;  // offer the UCX data plane (where the build has UCX)
  // UCX network devices (UcxOptions::net_devices): "" routes to each trainer, "all" or a list.
  std::string ucx_net_devices;
  // The listening port's credentials (TLS); insecure when null.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // Who may call (OptimizerService::SetAccess); not owned, outlives the server. Everyone when
  // null.
  const ShardAccess* access = nullptr;
  // How long an Attach stream's set-up may take on the shard's side (its first message, the shm
  // proof): a caller that opens one and never answers gives up its handler thread.
  absl::Duration attach_setup_timeout = absl::Seconds(30);
};

// A shard store served over gRPC with health checking and reflection.
class OptimizerServer {
 public:
  static absl::StatusOr<std::unique_ptr<OptimizerServer>> Start(const ServerOptions& options,
                                                                ShardStore* store);
  ~OptimizerServer();
  int port() const { return port_; }
  void Wait() { server_->Wait(); }
  void Shutdown();

 private:
  OptimizerServer() = default;
  std::vector<std::unique_ptr<DataPlaneServer>> data_planes_;
  std::unique_ptr<OptimizerService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_OPTIMIZER_SERVICE_H_
