// The UCX data plane (ARCHITECTURE.md section 4): one range's step exchange as UCX active messages,
// with rendezvous for large chunks so RDMA-capable transports move them zero-copy; over TCP or
// shared memory where there is no RDMA NIC. Which transports UCX uses is its own business, set with
// the usual UCX_TLS environment variable (e.g. UCX_TLS=tcp, UCX_TLS=sm,self). The network devices
// are restricted to the interface that routes to the shard unless UCX_NET_DEVICES is set
// (net_route.h).
//
// Set-up over the gRPC Attach stream of one (job, range): the trainer sends its worker address,
// the shard answers with its own and a session id, both sides create endpoints, and the shard
// says ready. Buffers are registered once per attachment and reused across steps. An AttachOpen
// with an empty job_id is a probe (endpoints and one round trip, no range).
//
// Death of a peer: endpoints use peer error handling, and the Attach stream is watched as for
// shared memory; a wait gives up with UNAVAILABLE naming the shard.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_UCX_UCX_TRANSPORT_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_UCX_UCX_TRANSPORT_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cpu_optimizer_server/grpc/shard_client.h"
#include "cpu_optimizer_server/transport/step_transport.h"
#include "cpu_optimizer_server/ucx/ucx_options.h"

namespace offload {

// The trainer's half (the shard's is ucx_server.h). `control` (not owned) must outlive the
// transport.
absl::StatusOr<std::unique_ptr<StepTransport>> CreateUcxTransport(ShardClient* control,
                                                                  const UcxOptions& options = {});

// A probe attachment: OK when a UCX endpoint to the shard works.
absl::Status ProbeUcx(ShardClient* control);

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_UCX_UCX_TRANSPORT_H_
