// The shard's half of the shared-memory data plane (shm_transport.h describes the plane): serves
// each Attach stream that asks for shared memory over a segment of its own.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_SHM_SHM_SERVER_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_SHM_SHM_SERVER_H_

#include <memory>

#include "cpu_optimizer_server/shard/shard_store.h"
#include "cpu_optimizer_server/shm/shm_segment.h"
#include "cpu_optimizer_server/transport/data_plane.h"

namespace offload {

std::unique_ptr<DataPlaneServer> CreateShmServer(ShardStore* store, const ShmOptions& options = {});

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_SHM_SHM_SERVER_H_
