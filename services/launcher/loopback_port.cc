#include "services/launcher/loopback_port.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <random>

#include "absl/status/status.h"

namespace offload {
namespace {

// Binds 127.0.0.1:port (0: the kernel's pick) and releases it; the port bound, or 0.
int TryBind(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof(addr);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  close(fd);
  return ok ? ntohs(addr.sin_port) : 0;
}

}  // namespace

std::pair<int, int> EphemeralPortRange() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0, high = 0;
  if (in >> low >> high && 0 < low && low <= high && high <= 65535) return {low, high};
  return {32768, 60999};
}

absl::StatusOr<int> FreeLoopbackPort() {
  constexpr int kFirst = 10000;  // above the well-known and most registered services' ports
  constexpr int kTries = 64;
  const int below = EphemeralPortRange().first;
  if (below - kFirst >= 1024) {
    std::mt19937 random(std::random_device{}());
    std::uniform_int_distribution<int> pick(kFirst, below - 1);
    for (int i = 0; i < kTries; ++i) {
      if (const int port = TryBind(pick(random)); port != 0) return port;
    }
  }
  if (const int port = TryBind(0); port != 0) return port;
  return absl::InternalError("cannot find a free loopback port");
}

}  // namespace offload
