// Conversions between the wire API (offload.v1) and the store's types, shared by the service and
// the client.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_WIRE_CONVERT_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_WIRE_CONVERT_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cpu_optimizer_server/shard_store.h"
#include "grpcpp/support/status.h"
#include "offload/v1/optimizer.pb.h"

namespace offload {

absl::StatusOr<DType> DTypeFromProto(v1::DType dtype, const char* field);
v1::DType DTypeToProto(DType dtype);
absl::StatusOr<StateTensor> StateTensorFromProto(v1::StateTensor tensor, const char* field);
absl::StatusOr<JobConfig> JobConfigFromProto(const v1::CreateJobRequest& request);
v1::AdamConfig AdamConfigToProto(const AdamHyperParams& adam);

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_WIRE_CONVERT_H_
