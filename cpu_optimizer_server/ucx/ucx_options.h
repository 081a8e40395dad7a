// What both halves of the UCX data plane (ucx_transport.h, ucx_server.h) are configured with.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_UCX_UCX_OPTIONS_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_UCX_UCX_OPTIONS_H_

#include <cstdint>
#include <string>

#include "absl/time/time.h"

namespace offload {

struct UcxOptions {
  int64_t chunk_bytes = int64_t{4} << 20;  // gradient and parameter chunk (one active message)
  absl::Duration poll_interval = absl::Milliseconds(100);
  // UCX's NET_DEVICES for the worker(s): "" or "auto" offers only the interface that routes to the
  // peer, plus the RDMA ports (net_route.h), unless UCX_NET_DEVICES is set; "all" or a list
  // ("eth0,mlx5_0:1") is used as given.
  std::string net_devices;
};

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_UCX_UCX_OPTIONS_H_
