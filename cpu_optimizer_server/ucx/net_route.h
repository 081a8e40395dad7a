// Which network devices a UCX worker may use (ARCHITECTURE.md section 4, "UCX devices"). By
// default UCX opens every interface that is up (UCX_NET_DEVICES=all) and puts all of their
// addresses in the worker address it hands to the peer: container bridges (docker0, podman0, cni0)
// included, which the peer may pick, cannot reach, or lose mid-run. Each end instead restricts its
// worker to the interface the kernel routes to the other end through, plus the RDMA ports (so RDMA
// transports stay), unless UCX_NET_DEVICES or the server's --ucx_net_devices says otherwise.
//
// No UCX here: only the kernel's routing (a connected UDP socket, no packet sent) and getifaddrs.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_UCX_NET_ROUTE_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_UCX_NET_ROUTE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace offload {
namespace ucx {

// The host of a gRPC target ("host:port", "[v6]:port", "dns:///host:port", "ipv4:a.b.c.d:port")
// or of a grpc::ServerContext::peer() ("ipv4:a.b.c.d:port", "ipv6:[..]:port"). A unix socket
// ("unix:...", "unix-abstract:...") is this host: "127.0.0.1".
absl::StatusOr<std::string> HostOfAddress(absl::string_view address);

// The name of the interface the kernel would send packets to `host` (a name or a numeric address)
// through, e.g. "lo" for 127.0.0.1. NOT_FOUND when it cannot be resolved, UNAVAILABLE when there is
// no route to it (the message says which).
absl::StatusOr<std::string> RouteInterface(absl::string_view host);

// The RDMA ports UCX names as devices ("mlx5_0:1"), from `sysfs_dir` (/sys/class/infiniband).
std::vector<std::string> RdmaPorts(const std::string& sysfs_dir = "/sys/class/infiniband");

// What a worker talking to the peer at `peer_address` (HostOfAddress's forms) sets UCX's
// NET_DEVICES to. `configured`: "" or "auto" routes (the interface to the peer, then RDMA ports:
// "eth0,mlx5_0:1"); anything else ("all", "eth0,ib0") is returned as given. With "auto" and
// UCX_NET_DEVICES in the environment the result is "": leave UCX to read its own variable.
absl::StatusOr<std::string> NetDevicesFor(absl::string_view configured,
                                          absl::string_view peer_address);

}  // namespace ucx
}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_UCX_NET_ROUTE_H_
