// The network devices a UCX worker offers (net_route.h): the host of an address, the interface
// the kernel routes to it through, a clear error where there is no route (a fresh network
// namespace), what UCX_NET_DEVICES and a configured list change, and, with UCX, that a worker
// restricted this way no longer puts this host's other interfaces in its address.
#include "cpu_optimizer_server/ucx/net_route.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sched.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#ifdef OFFLOAD_HAVE_UCX
#include "cpu_optimizer_server/ucx/ucx_common.h"
#endif

namespace offload {
namespace ucx {
namespace {

// Unsets UCX_NET_DEVICES for a test, restoring it after.
class NoUcxNetDevicesEnv {
 public:
  NoUcxNetDevicesEnv() {
    if (const char* v = std::getenv("UCX_NET_DEVICES"); v != nullptr) saved_ = v;
    unsetenv("UCX_NET_DEVICES");
  }
  ~NoUcxNetDevicesEnv() {
    if (saved_) {
      setenv("UCX_NET_DEVICES", saved_->c_str(), 1);
    } else {
      unsetenv("UCX_NET_DEVICES");
    }
  }

 private:
  std::optional<std::string> saved_;
};

TEST(NetRouteTest, HostOfAddress) {
  EXPECT_EQ(*HostOfAddress("127.0.0.1:50051"), "127.0.0.1");
  EXPECT_EQ(*HostOfAddress("shard-0.pool:50051"), "shard-0.pool");
  EXPECT_EQ(*HostOfAddress("dns:///shard-0.pool:50051"), "shard-0.pool");
  EXPECT_EQ(*HostOfAddress("dns://8.8.8.8/shard-0:1"), "shard-0");
  EXPECT_EQ(*HostOfAddress("[::1]:50051"), "::1");
  EXPECT_EQ(*HostOfAddress("ipv4:10.0.0.7:43210"), "10.0.0.7");      // a server's peer()
  EXPECT_EQ(*HostOfAddress("ipv6:[fd00::2]:43210"), "fd00::2");      // a server's peer()
  EXPECT_EQ(*HostOfAddress("ipv6:%5Bfd00::2%5D:43210"), "fd00::2");  // percent-encoded
  EXPECT_EQ(*HostOfAddress("unix:/run/offload.sock"), "127.0.0.1");  // this host
  EXPECT_EQ(*HostOfAddress("shard-0"), "shard-0");
  EXPECT_FALSE(HostOfAddress(":50051").ok());
  EXPECT_FALSE(HostOfAddress("").ok());
}

TEST(NetRouteTest, LoopbackRoutesThroughLo) {
  absl::StatusOr<std::string> iface = RouteInterface("127.0.0.1");
  ASSERT_TRUE(iface.ok()) << iface.status();
  EXPECT_EQ(*iface, "lo");
  iface = RouteInterface("localhost");
  ASSERT_TRUE(iface.ok()) << iface.status();
  EXPECT_EQ(*iface, "lo");
}

// This host's own non-loopback address routes through the loopback device, but leaves from the
// interface that holds it: that one is named (the address UCX will listen on there).
TEST(NetRouteTest, OwnAddressNamesItsInterface) {
  ifaddrs* list = nullptr;
  ASSERT_EQ(getifaddrs(&list), 0);
  std::string name, address;
  for (const ifaddrs* ifa = list; ifa != nullptr; ifa = ifa->ifa_next) {
    if (ifa->ifa_addr == nullptr || ifa->ifa_addr->sa_family != AF_INET) continue;
    if ((ifa->ifa_flags & IFF_LOOPBACK) != 0 || (ifa->ifa_flags & IFF_UP) == 0) continue;
    char text[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(ifa->ifa_addr)->sin_addr, text,
              sizeof(text));
    name = ifa->ifa_name;
    address = text;
    break;
  }
  freeifaddrs(list);
  if (name.empty()) GTEST_SKIP() << "no IPv4 interface besides loopback";
  absl::StatusOr<std::string> iface = RouteInterface(address);
  ASSERT_TRUE(iface.ok()) << iface.status();
  EXPECT_EQ(*iface, name) << address;
}

TEST(NetRouteTest, UnresolvableHostIsNotFound) {
  absl::StatusOr<std::string> iface = RouteInterface("no-such-host.invalid");
  EXPECT_EQ(iface.status().code(), absl::StatusCode::kNotFound) << iface.status();
  EXPECT_NE(iface.status().message().find("no-such-host.invalid"), std::string::npos);
}

// In a network namespace of its own (this thread only) nothing is routed, not even loopback
// until it is brought up: the error names the host and the kernel's reason.
TEST(NetRouteTest, NoRouteIsAClearError) {
  absl::StatusOr<std::string> iface;
  std::string skipped;
  std::thread([&] {
    if (unshare(CLONE_NEWNET) != 0) {
      skipped = std::string("unshare(CLONE_NEWNET): ") + std::strerror(errno);
      return;
    }
    iface = RouteInterface("10.213.0.9");
  }).join();
  if (!skipped.empty()) GTEST_SKIP() << skipped << " (needs root or user namespaces)";
  ASSERT_FALSE(iface.ok());
  EXPECT_EQ(iface.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(iface.status().message().find("no route to 10.213.0.9"), std::string::npos)
      << iface.status();
  EXPECT_NE(iface.status().message().find("Network is unreachable"), std::string::npos)
      << iface.status();
}

TEST(NetRouteTest, NetDevicesForRoutesUnlessTold) {
  NoUcxNetDevicesEnv env;
  absl::StatusOr<std::string> devices = NetDevicesFor("", "127.0.0.1:50051");
  ASSERT_TRUE(devices.ok()) << devices.status();
  std::string expected = "lo";
  for (const std::string& port : RdmaPorts()) expected += "," + port;
  EXPECT_EQ(*devices, expected);
  EXPECT_EQ(*NetDevicesFor("auto", "ipv4:127.0.0.1:4000"), expected);
  // A configured list or "all" is used as given, whatever the route.
  EXPECT_EQ(*NetDevicesFor("all", "127.0.0.1:1"), "all");
  EXPECT_EQ(*NetDevicesFor("eth0,mlx5_0:1", "127.0.0.1:1"), "eth0,mlx5_0:1");
  // UCX_NET_DEVICES in the environment: UCX reads it, nothing is set.
  setenv("UCX_NET_DEVICES", "eth7", 1);
  EXPECT_EQ(*NetDevicesFor("auto", "127.0.0.1:1"), "");
  EXPECT_EQ(*NetDevicesFor("eth0", "127.0.0.1:1"), "eth0");
}

TEST(NetRouteTest, RdmaPortsOfAMissingDirectoryAreNone) {
  EXPECT_TRUE(RdmaPorts("/nonexistent/sys/class/infiniband").empty());
}

#ifdef OFFLOAD_HAVE_UCX
// The IPv4 addresses of this host's running interfaces other than loopback.
std::vector<in_addr> OtherAddresses() {
  std::vector<in_addr> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (const ifaddrs* ifa = list; ifa != nullptr; ifa = ifa->ifa_next) {
    if (ifa->ifa_addr == nullptr || ifa->ifa_addr->sa_family != AF_INET) continue;
    if ((ifa->ifa_flags & IFF_LOOPBACK) != 0) continue;
    if ((ifa->ifa_flags & (IFF_UP | IFF_RUNNING)) != (IFF_UP | IFF_RUNNING)) continue;
    out.push_back(reinterpret_cast<const sockaddr_in*>(ifa->ifa_addr)->sin_addr);
  }
  freeifaddrs(list);
  return out;
}

bool Holds(const std::string& worker_address, const in_addr& ip) {
  return worker_address.find(std::string(reinterpret_cast<const char*>(&ip), sizeof(ip))) !=
         std::string::npos;
}

// UCX over TCP puts each device's IP in the worker address. With every device (UCX's default,
// what the planes did before) a worker talking to a loopback peer still advertises this host's
// other interfaces; restricted to the routed one, none of them.
TEST(NetRouteTest, RoutedWorkerAdvertisesOnlyTheRoutedInterface) {
  NoUcxNetDevicesEnv env;
  const std::vector<in_addr> others = OtherAddresses();
  if (others.empty()) GTEST_SKIP() << "no running IPv4 interface besides loopback";
  setenv("UCX_TLS", "tcp", 1);
  absl::StatusOr<std::string> devices = NetDevicesFor("auto", "127.0.0.1:50051");
  ASSERT_TRUE(devices.ok()) << devices.status();
  absl::StatusOr<std::unique_ptr<Worker>> routed = Worker::Create(*devices);
  absl::StatusOr<std::unique_ptr<Worker>> all = Worker::Create("all");
  unsetenv("UCX_TLS");
  ASSERT_TRUE(routed.ok()) << routed.status();
  ASSERT_TRUE(all.ok()) << all.status();
  bool all_holds_one = false;
  for (const in_addr& ip : others) {
    EXPECT_FALSE(Holds((*routed)->address(), ip)) << inet_ntoa(ip) << " offered to a loopback peer";
    all_holds_one = all_holds_one || Holds((*all)->address(), ip);
  }
  EXPECT_TRUE(all_holds_one) << "UCX_NET_DEVICES=all should offer this host's other interfaces";
}
#endif

}  // namespace
}  // namespace ucx
}  // namespace offload
