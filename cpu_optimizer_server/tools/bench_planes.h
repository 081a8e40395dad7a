// The data planes the benches measure (bench_transport, bench_server), named on their command
// lines: what each is, the environment it runs under, and its transport on a client.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_TOOLS_BENCH_PLANES_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_TOOLS_BENCH_PLANES_H_

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cpu_optimizer_server/grpc/shard_client.h"
#include "cpu_optimizer_server/transport/step_transport.h"

namespace offload {

struct BenchPlane {
  std::string name;        // as printed: grpc, grpc-copy, shm, shm-copy, ucx, ucx-tcp
  std::string kind;        // grpc, shm or ucx
  std::string ucx_tls;     // set for the server and the trainer; "" leaves UCX_TLS alone
  bool memory_medium;      // the bytes move through memory (bound: memcpy, or the kernel), not TCP
  bool grad_area = false;  // gradients written into StepStream::GradientArea (shm, grpc)
  bool params_in_place = false;  // parameters taken where they land: CommitInPlace (shm)
};

// The planes of a comma-separated list: grpc, grpc-copy, shm, shm-copy, ucx (UCX picks its
// transports; its bound is memory on one host, TCP across a network path (`remote`)) and ucx-tcp
// (UCX_TLS=tcp). Where the build has no UCX its planes are left out with a note on stderr naming
// `program`; an unknown name is INVALID_ARGUMENT.
absl::StatusOr<std::vector<BenchPlane>> ParseBenchPlanes(absl::string_view list, bool remote,
                                                         const char* program);

// Sets UCX_TLS to the plane's for its lifetime (both ends of an in-process bench read it when
// their UCX contexts are made), then puts back what was there.
class ScopedPlaneEnv {
 public:
  explicit ScopedPlaneEnv(const BenchPlane& plane);
  ~ScopedPlaneEnv();

 private:
  bool set_ = false;
  bool had_ = false;
  std::string saved_;
};

// The plane's transport over `client`: null for grpc (the client is the transport), else a shm or
// UCX transport after a probe attachment worked. chunk_bytes: UCX's chunk.
absl::StatusOr<std::unique_ptr<StepTransport>> OpenBenchPlane(const BenchPlane& plane,
                                                              ShardClient* client,
                                                              int64_t chunk_bytes);

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_TOOLS_BENCH_PLANES_H_
