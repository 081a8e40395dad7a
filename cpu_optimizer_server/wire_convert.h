// Conversions between the wire API (offload.v1) and the store's types, shared by the service and
// the client.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_WIRE_CONVERT_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_WIRE_CONVERT_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cpu_optimizer_server/shard_store.h"
#include "offload/v1/optimizer.pb.h"
#include "services/common/grpc_status.h"

namespace offload {

absl::StatusOr<DType> DTypeFromProto(v1::DType dtype, const char* field);
v1::DType DTypeToProto(DType dtype);
absl::StatusOr<StateTensor> StateTensorFromProto(v1::StateTensor tensor, const char* field);
absl::StatusOr<JobConfig> JobConfigFromProto(const v1::CreateJobRequest& request);
v1::AdamConfig AdamConfigToProto(const AdamHyperParams& adam);

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_WIRE_CONVERT_H_
