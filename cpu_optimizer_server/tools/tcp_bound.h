// The bound a TCP-based data plane is measured against (ARCHITECTURE.md section 9): the same bytes
// over a plain loopback TCP socket pair, timed in the same run as the plane itself.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_TOOLS_TCP_BOUND_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_TOOLS_TCP_BOUND_H_

#include <cstdint>
#include <string>

namespace offload {

// Moves `bytes` from a to b, then `bytes` from b to a, over one loopback TCP connection with a
// writer and a reader thread, in 4 MiB calls; seconds, or a negative value on a socket error.
double TcpBothWaysSeconds(int64_t bytes);

// The same bound across a real network path: `bytes` to the TCP bound peer at `address`
// ("host:port", served by ServeTcpBound in another namespace or on another host), then `bytes`
// back from it, over one connection in 4 MiB calls; seconds, or a negative value on an error.
double TcpBothWaysSecondsTo(const std::string& address, int64_t bytes);

// Serves TcpBothWaysSecondsTo on `port` of every address until the process ends: per
// connection, an 8-byte little-endian count, that many bytes in, then as many back. Returns only
// when it cannot listen (the error on stderr).
int ServeTcpBound(int port);

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_TOOLS_TCP_BOUND_H_
