// Which data plane a trainer uses to a shard (ARCHITECTURE.md section 4). `auto` takes shared
// memory when the shard proves to share this host's shared memory, else UCX when both sides have
// it, else gRPC, which works anywhere. An explicit choice is used as given, or fails with the
// reason.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_TRANSPORT_FACTORY_TRANSPORT_FACTORY_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_TRANSPORT_FACTORY_TRANSPORT_FACTORY_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cpu_optimizer_server/grpc/shard_client.h"
#include "cpu_optimizer_server/transport/step_transport.h"

namespace offload {

enum class TransportChoice { kAuto, kGrpc, kShm, kUcx };

// "auto", "grpc", "shm" or "ucx".
absl::StatusOr<TransportChoice> ParseTransportChoice(absl::string_view name);

// The data plane to the shard behind `control`. gRPC's is `control` itself; the others are
// returned in `owned`, which must outlive their use, as must `control`.
absl::StatusOr<StepTransport*> SelectStepTransport(ShardClient* control, TransportChoice choice,
                                                   std::unique_ptr<StepTransport>* owned);

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_TRANSPORT_FACTORY_TRANSPORT_FACTORY_H_
