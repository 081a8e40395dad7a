// The bound a TCP-based data plane is measured against (ARCHITECTURE.md section 9): the same bytes
// over a plain loopback TCP socket pair, timed in the same run as the plane itself.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_TOOLS_TCP_BOUND_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_TOOLS_TCP_BOUND_H_

#include <cstdint>

namespace offload {

// Moves `bytes` from a to b, then `bytes` from b to a, over one loopback TCP connection with a
// writer and a reader thread, in 4 MiB calls; seconds, or a negative value on a socket error.
double TcpBothWaysSeconds(int64_t bytes);

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_TOOLS_TCP_BOUND_H_
