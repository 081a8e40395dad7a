#include "services/launcher/loopback_port.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace offload {
namespace {

// A socket listening on 127.0.0.1:port, or -1 (errno says why).
int Listen(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd, 1) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

TEST(LoopbackPortTest, EphemeralRangeIsARange) {
  const auto [low, high] = EphemeralPortRange();
  EXPECT_GT(low, 0);
  EXPECT_LE(low, high);
  EXPECT_LE(high, 65535);
}

TEST(LoopbackPortTest, APortBelowTheEphemeralRangeThatAChildCanListenOn) {
  const int below = EphemeralPortRange().first;
  for (int i = 0; i < 20; ++i) {
    absl::StatusOr<int> port = FreeLoopbackPort();
    ASSERT_TRUE(port.ok()) << port.status();
    // Below the range wherever it leaves room, so that no connection opened meanwhile takes it.
    if (below - 10000 >= 1024) EXPECT_LT(*port, below);
    const int fd = Listen(*port);
    EXPECT_GE(fd, 0) << *port;
    if (fd >= 0) close(fd);
  }
}

TEST(LoopbackPortTest, APortTakenIsNotOffered) {
  // Hold every port FreeLoopbackPort offers: none is offered twice while it is held.
  std::vector<int> held;
  std::set<int> offered;
  for (int i = 0; i < 50; ++i) {
    absl::StatusOr<int> port = FreeLoopbackPort();
    ASSERT_TRUE(port.ok()) << port.status();
    EXPECT_TRUE(offered.insert(*port).second) << *port << " offered while held";
    const int fd = Listen(*port);
    ASSERT_GE(fd, 0) << *port;
    held.push_back(fd);
  }
  for (int fd : held) close(fd);
}

}  // namespace
}  // namespace offload
