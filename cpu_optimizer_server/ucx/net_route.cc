// The route lookups of net_route.h: a connected UDP socket tells the source address the kernel
// picks for a destination (connect() on a datagram socket sends nothing), and getifaddrs names the
// interface that holds it.
#include "cpu_optimizer_server/ucx/net_route.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"

namespace offload {
namespace ucx {

namespace {

std::string Numeric(const sockaddr* addr, socklen_t length) {
  char host[NI_MAXHOST] = {0};
  if (getnameinfo(addr, length, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0) return "?";
  return host;
}

bool SameAddress(const sockaddr* a, const sockaddr* b) {
  if (a->sa_family != b->sa_family) return false;
  if (a->sa_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in*>(b)->sin_addr.s_addr;
  }
  if (a->sa_family == AF_INET6) {
    return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr,
                       &reinterpret_cast<const sockaddr_in6*>(b)->sin6_addr, sizeof(in6_addr)) == 0;
  }
  return false;
}

// The interface holding `local`.
absl::StatusOr<std::string> InterfaceOf(const sockaddr* local) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    return absl::InternalError(absl::StrCat("getifaddrs: ", std::strerror(errno)));
  }
  std::string name;
  for (const ifaddrs* ifa = list; ifa != nullptr; ifa = ifa->ifa_next) {
    if (ifa->ifa_addr != nullptr && SameAddress(ifa->ifa_addr, local)) {
      name = ifa->ifa_name;
      break;
    }
  }
  freeifaddrs(list);
  if (name.empty()) return absl::NotFoundError("no interface holds it");
  return name;
}

}  // namespace

absl::StatusOr<std::string> HostOfAddress(absl::string_view address) {
  std::string a(absl::StripAsciiWhitespace(address));
  if (absl::StartsWith(a, "unix:") || absl::StartsWith(a, "unix-abstract:")) return "127.0.0.1";
  // grpc's peer() percent-encodes an IPv6 address's brackets.
  a = absl::StrReplaceAll(a, {{"%5B", "["}, {"%5D", "]"}, {"%5b", "["}, {"%5d", "]"}});
  absl::string_view rest = a;
  if (absl::ConsumePrefix(&rest, "dns:")) {
    if (absl::ConsumePrefix(&rest, "//")) {  // dns://authority/host:port
      const size_t slash = rest.find('/');
      rest = slash == absl::string_view::npos ? absl::string_view() : rest.substr(slash + 1);
    }
  } else if (absl::ConsumePrefix(&rest, "ipv4:") || absl::ConsumePrefix(&rest, "ipv6:")) {
    rest = rest.substr(0, rest.find(','));  // the first of a list
  }
  std::string host;
  if (absl::ConsumePrefix(&rest, "[")) {
    const size_t close = rest.find(']');
    if (close != absl::string_view::npos) host = std::string(rest.substr(0, close));
  } else if (std::count(rest.begin(), rest.end(), ':') == 1) {
    host = std::string(rest.substr(0, rest.find(':')));
  } else {
    host = std::string(rest);  // no port, or a bare IPv6 address
  }
  if (host.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("no host in address '", address, "'"));
  }
  return host;
}

absl::StatusOr<std::string> RouteInterface(absl::string_view host) {
  const std::string name(host);
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  // Any port: connect() on a datagram socket only looks the route up.
  if (int e = getaddrinfo(name.c_str(), "9", &hints, &found); e != 0) {
    return absl::NotFoundError(absl::StrCat("cannot resolve '", name, "': ", gai_strerror(e)));
  }
  absl::Status last = absl::UnavailableError(absl::StrCat("no address for '", name, "'"));
  for (const addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    const std::string peer = Numeric(ai->ai_addr, ai->ai_addrlen);
    const int fd = socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      last = absl::UnavailableError(
          absl::StrCat("socket for ", peer, " (", name, "): ", std::strerror(errno)));
      continue;
    }
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      last = absl::UnavailableError(
          absl::StrCat("no route to ", name, " (", peer, "): ", std::strerror(errno)));
      close(fd);
      continue;
    }
    const bool named = getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0;
    const int saved = errno;
    close(fd);
    if (!named) {
      last = absl::UnavailableError(absl::StrCat("getsockname: ", std::strerror(saved)));
      continue;
    }
    absl::StatusOr<std::string> iface = InterfaceOf(reinterpret_cast<const sockaddr*>(&local));
    if (iface.ok()) {
      freeaddrinfo(found);
      return iface;
    }
    last = absl::UnavailableError(
        absl::StrCat("the route to ", name, " (", peer, ") leaves from ",
                     Numeric(reinterpret_cast<const sockaddr*>(&local), length), ": ",
                     iface.status().message()));
  }
  freeaddrinfo(found);
  return last;
}

std::vector<std::string> RdmaPorts(const std::string& sysfs_dir) {
  std::vector<std::string> ports;
  DIR* devices = opendir(sysfs_dir.c_str());
  if (devices == nullptr) return ports;
  while (const dirent* dev = readdir(devices)) {
    if (dev->d_name[0] == '.') continue;
    const std::string dir = absl::StrCat(sysfs_dir, "/", dev->d_name, "/ports");
    DIR* numbers = opendir(dir.c_str());
    if (numbers == nullptr) continue;
    while (const dirent* port = readdir(numbers)) {
      if (port->d_name[0] == '.') continue;
      ports.push_back(absl::StrCat(dev->d_name, ":", port->d_name));
    }
    closedir(numbers);
  }
  closedir(devices);
  std::sort(ports.begin(), ports.end());
  return ports;
}

absl::StatusOr<std::string> NetDevicesFor(absl::string_view configured,
                                          absl::string_view peer_address) {
  if (!configured.empty() && configured != "auto") return std::string(configured);
  if (std::getenv("UCX_NET_DEVICES") != nullptr) return std::string();
  absl::StatusOr<std::string> host = HostOfAddress(peer_address);
  if (!host.ok()) return host.status();
  absl::StatusOr<std::string> iface = RouteInterface(*host);
  if (!iface.ok()) return iface.status();
  std::vector<std::string> devices = {*iface};
  for (std::string& port : RdmaPorts()) devices.push_back(std::move(port));
  return absl::StrJoin(devices, ",");
}

}  // namespace ucx
}  // namespace offload
