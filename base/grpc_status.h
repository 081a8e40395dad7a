// absl::Status <-> grpc::Status, code and message unchanged, for every gRPC server and client.
#ifndef OFFLOAD_BASE_GRPC_STATUS_H_
#define OFFLOAD_BASE_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace offload {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace offload

#endif  // OFFLOAD_BASE_GRPC_STATUS_H_
