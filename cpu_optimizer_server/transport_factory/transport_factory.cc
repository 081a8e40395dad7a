#include "cpu_optimizer_server/transport_factory/transport_factory.h"

#include "absl/strings/str_cat.h"
#include "cpu_optimizer_server/shm/shm_transport.h"
#ifdef OFFLOAD_HAVE_UCX
#include "base/status_macros.h"
#include "cpu_optimizer_server/ucx/ucx_transport.h"
#endif

namespace offload {
namespace {

absl::StatusOr<StepTransport*> Keep(absl::StatusOr<std::unique_ptr<StepTransport>> transport,
                                    std::unique_ptr<StepTransport>* owned) {
  if (!transport.ok()) return transport.status();
  *owned = std::move(*transport);
  return owned->get();
}

bool Offers(const v1::DescribeShardResponse& shard, v1::DataPlane plane) {
  for (int p : shard.data_planes()) {
    if (p == plane) return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<TransportChoice> ParseTransportChoice(absl::string_view name) {
  if (name == "auto") return TransportChoice::kAuto;
  if (name == "grpc") return TransportChoice::kGrpc;
  if (name == "shm") return TransportChoice::kShm;
  if (name == "ucx") return TransportChoice::kUcx;
  return absl::InvalidArgumentError(
      absl::StrCat("transport \"", name, "\" is not one of auto, grpc, shm, ucx"));
}

absl::StatusOr<StepTransport*> SelectStepTransport(ShardClient* control, TransportChoice choice,
                                                   std::unique_ptr<StepTransport>* owned) {
  const std::string& address = control->options().address;
  switch (choice) {
    case TransportChoice::kGrpc:
      return control;
    case TransportChoice::kShm:
      if (absl::Status s = ProbeShm(control); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("shared memory to the shard at ", address,
                                                   " is not possible: ", s.message()));
      }
      return Keep(CreateShmTransport(control), owned);
    case TransportChoice::kUcx:
#ifdef OFFLOAD_HAVE_UCX
      if (absl::Status s = ProbeUcx(control); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("UCX to the shard at ", address,
                                                   " does not work: ", s.message()));
      }
      return Keep(CreateUcxTransport(control), owned);
#else
      return absl::UnimplementedError("this build has no UCX (install libucx-dev and rebuild)");
#endif
    case TransportChoice::kAuto:
      break;
  }
  OFFLOAD_ASSIGN_OR_RETURN(v1::DescribeShardResponse shard, control->DescribeShard());
  if (Offers(shard, v1::DATA_PLANE_SHM) && ProbeShm(control).ok()) {
    return Keep(CreateShmTransport(control), owned);
  }
#ifdef OFFLOAD_HAVE_UCX
  if (Offers(shard, v1::DATA_PLANE_UCX) && ProbeUcx(control).ok()) {
    return Keep(CreateUcxTransport(control), owned);
  }
#endif
  return control;
}

}  // namespace offload
