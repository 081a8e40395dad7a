#include "cpu_optimizer_server/tools/bench_planes.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "cpu_optimizer_server/shm/shm_transport.h"
#ifdef OFFLOAD_HAVE_UCX
#include "cpu_optimizer_server/ucx/ucx_transport.h"
#endif

namespace offload {

absl::StatusOr<std::vector<BenchPlane>> ParseBenchPlanes(absl::string_view list, bool remote,
                                                         const char* program) {
  std::vector<BenchPlane> planes;
  for (absl::string_view name : absl::StrSplit(list, ',')) {
    if (name == "grpc") {
      planes.push_back({"grpc", "grpc", "", false, /*grad_area=*/true});
    } else if (name == "grpc-copy") {
      planes.push_back({"grpc-copy", "grpc", "", false});
    } else if (name == "shm") {
      planes.push_back({"shm", "shm", "", true, /*grad_area=*/true, /*params_in_place=*/true});
    } else if (name == "shm-copy") {
      planes.push_back({"shm-copy", "shm", "", true});
    } else if (name == "ucx" || name == "ucx-tcp") {
#ifdef OFFLOAD_HAVE_UCX
      if (name == "ucx") {
        // Across a network path UCX has only the network: a TCP plane there.
        planes.push_back({"ucx", "ucx", "", !remote});
      } else {
        planes.push_back({"ucx-tcp", "ucx", "tcp", false});
      }
#else
      std::fprintf(stderr, "%s: %s: this build has no UCX, skipped\n", program,
                   std::string(name).c_str());
#endif
    } else if (!name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown plane ", name));
    }
  }
  return planes;
}

ScopedPlaneEnv::ScopedPlaneEnv(const BenchPlane& plane) {
  if (plane.ucx_tls.empty()) return;
  const char* old = std::getenv("UCX_TLS");
  had_ = old != nullptr;
  if (had_) saved_ = old;
  setenv("UCX_TLS", plane.ucx_tls.c_str(), 1);
  set_ = true;
}

ScopedPlaneEnv::~ScopedPlaneEnv() {
  if (!set_) return;
  if (had_) {
    setenv("UCX_TLS", saved_.c_str(), 1);
  } else {
    unsetenv("UCX_TLS");
  }
}

absl::StatusOr<std::unique_ptr<StepTransport>> OpenBenchPlane(const BenchPlane& plane,
                                                              ShardClient* client,
                                                              int64_t chunk_bytes) {
  if (plane.kind == "grpc") return std::unique_ptr<StepTransport>();
  if (plane.kind == "shm") {
    OFFLOAD_RETURN_IF_ERROR(ProbeShm(client));
    return CreateShmTransport(client);
  }
#ifdef OFFLOAD_HAVE_UCX
  if (plane.kind == "ucx") {
    OFFLOAD_RETURN_IF_ERROR(ProbeUcx(client));
    UcxOptions ucx;
    ucx.chunk_bytes = chunk_bytes;
    return CreateUcxTransport(client, ucx);
  }
#endif
  return absl::UnimplementedError(absl::StrCat("no plane ", plane.kind, " in this build"));
}

}  // namespace offload
