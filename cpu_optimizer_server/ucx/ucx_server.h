// The shard's half of the UCX data plane (ucx_transport.h describes the plane): one UCX context
// and worker for the server, with its progress thread, serving each Attach stream that asks for
// UCX.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_UCX_UCX_SERVER_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_UCX_UCX_SERVER_H_

#include <memory>

#include "absl/status/statusor.h"
#include "cpu_optimizer_server/shard/shard_store.h"
#include "cpu_optimizer_server/transport/data_plane.h"
#include "cpu_optimizer_server/ucx/ucx_options.h"

namespace offload {

absl::StatusOr<std::unique_ptr<DataPlaneServer>> CreateUcxServer(ShardStore* store,
                                                                 const UcxOptions& options = {});

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_UCX_UCX_SERVER_H_
