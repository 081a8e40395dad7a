// A free TCP port on 127.0.0.1 for a child to listen on, chosen by the launcher before the child
// starts (its /metrics address goes into Prometheus's targets file ahead of the child).
#ifndef OFFLOAD_SERVICES_LAUNCHER_LOOPBACK_PORT_H_
#define OFFLOAD_SERVICES_LAUNCHER_LOOPBACK_PORT_H_

#include <utility>

#include "absl/status/statusor.h"

namespace offload {

// The kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range), from which every
// bind(0) and outgoing connect() on the machine draws; {32768, 60999} where it cannot be read.
std::pair<int, int> EphemeralPortRange();

// A port that was free on 127.0.0.1 when asked, below the ephemeral range where there is room
// (from 10000 up): the port is released before the child binds it, and in between only a process
// asking for that very number can take it, where a port of the ephemeral range goes to the next
// connection anyone on the machine opens. Falls back to a port the kernel picks (bind(0)).
absl::StatusOr<int> FreeLoopbackPort();

}  // namespace offload

#endif  // OFFLOAD_SERVICES_LAUNCHER_LOOPBACK_PORT_H_
