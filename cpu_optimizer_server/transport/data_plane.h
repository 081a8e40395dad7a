// The shard side of a data plane beside gRPC (ARCHITECTURE.md section 4). OptimizerService::Attach
// hands each Attach stream to the DataPlaneServer of the plane it asks for; the server sets the
// plane up over that stream, then serves the range's steps (StepSession, the same rules as the gRPC
// Step method) until the stream ends, which is how either side learns of the other's death.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_TRANSPORT_DATA_PLANE_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_TRANSPORT_DATA_PLANE_H_

#include "cpu_optimizer_server/shard/shard_store.h"
#include "grpcpp/grpcpp.h"
#include "offload/v1/optimizer.grpc.pb.h"

namespace offload {

using AttachStream = grpc::ServerReaderWriter<v1::AttachResponse, v1::AttachRequest>;

class DataPlaneServer {
 public:
  virtual ~DataPlaneServer() = default;
  virtual v1::DataPlane plane() const = 0;
  // Runs on the gRPC handler thread with the stream's first message, and returns when the
  // attachment ends: the trainer closed or lost the stream, the server is shutting down
  // (context->IsCancelled()), or the set-up failed (the status says why).
  virtual grpc::Status Serve(const v1::AttachOpen& open, grpc::ServerContext* context,
                             AttachStream* stream) = 0;
};

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_TRANSPORT_DATA_PLANE_H_
