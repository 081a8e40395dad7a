// Conversions between the wire API (offload.v1) and the shard store's types (the dtype's own are
// in base/dtype_proto.h).
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_WIRE_CONVERT_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_WIRE_CONVERT_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/dtype_proto.h"
#include "cpu_optimizer_server/shard/shard_store.h"
#include "offload/v1/optimizer.pb.h"

namespace offload {

absl::StatusOr<StateTensor> StateTensorFromProto(v1::StateTensor tensor, const char* field);
absl::StatusOr<JobConfig> JobConfigFromProto(const v1::CreateJobRequest& request);
v1::AdamConfig AdamConfigToProto(const AdamHyperParams& adam);

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_WIRE_CONVERT_H_
