#include "cpu_optimizer_server/tools/tcp_bound.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace offload {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

constexpr int64_t kCall = 4 << 20;  // bytes per send and recv call

bool SendAll(int fd, const char* data, int64_t bytes) {
  for (int64_t sent = 0; sent < bytes;) {
    const ssize_t k = send(fd, data + sent, std::min(kCall, bytes - sent), MSG_NOSIGNAL);
    if (k <= 0) return false;
    sent += k;
  }
  return true;
}

bool ReceiveAll(int fd, char* data, int64_t bytes) {
  for (int64_t got = 0; got < bytes;) {
    const ssize_t k = recv(fd, data + got, std::min(kCall, bytes - got), 0);
    if (k <= 0) return false;
    got += k;
  }
  return true;
}

// `bytes` from one 4 MiB buffer over and over, and the same count into another, in kCall pieces.
bool SendRepeated(int fd, const std::vector<char>& buffer, int64_t bytes) {
  bool ok = true;
  for (int64_t sent = 0; ok && sent < bytes; sent += kCall) {
    ok = SendAll(fd, buffer.data(), std::min(kCall, bytes - sent));
  }
  return ok;
}

bool ReceiveRepeated(int fd, std::vector<char>* buffer, int64_t bytes) {
  bool ok = true;
  for (int64_t got = 0; ok && got < bytes; got += kCall) {
    ok = ReceiveAll(fd, buffer->data(), std::min(kCall, bytes - got));
  }
  return ok;
}

}  // namespace

double TcpBothWaysSeconds(int64_t bytes) {
  int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(listener);
    return -1;
  }
  int a = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(a, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(listener);
    close(a);
    return -1;
  }
  int b = accept(listener, nullptr, nullptr);
  close(listener);
  std::vector<char> send_buf(kCall, 1), recv_buf(kCall);
  std::atomic<bool> ok{true};
  auto pump = [&](int from, int to) {
    std::thread reader([&] {
      if (!ReceiveRepeated(to, &recv_buf, bytes)) ok = false;
    });
    if (!SendRepeated(from, send_buf, bytes)) ok = false;
    reader.join();
  };
  const auto t0 = Clock::now();
  pump(a, b);
  pump(b, a);
  const double s = Seconds(t0, Clock::now());
  close(a);
  close(b);
  return ok ? s : -1;
}

double TcpBothWaysSecondsTo(const std::string& address, int64_t bytes) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return -1;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(address.substr(0, colon).c_str(), address.substr(colon + 1).c_str(), &hints,
                  &found) != 0) {
    return -1;
  }
  const int fd = socket(found->ai_family, SOCK_STREAM, 0);
  const bool connected = fd >= 0 && connect(fd, found->ai_addr, found->ai_addrlen) == 0;
  freeaddrinfo(found);
  if (!connected) {
    if (fd >= 0) close(fd);
    return -1;
  }
  std::vector<char> buffer(kCall, 1);
  const auto t0 = Clock::now();
  const uint64_t count = static_cast<uint64_t>(bytes);
  bool ok = SendAll(fd, reinterpret_cast<const char*>(&count), sizeof(count));
  // From one 4 MiB buffer over and over, as the loopback bound does.
  ok = ok && SendRepeated(fd, buffer, bytes) && ReceiveRepeated(fd, &buffer, bytes);
  const double s = Seconds(t0, Clock::now());
  close(fd);
  return ok ? s : -1;
}

int ServeTcpBound(int port) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listener, 4) != 0) {
    std::perror("tcp bound peer: listen");
    close(listener);
    return 1;
  }
  std::vector<char> buffer(kCall);
  for (;;) {
    const int fd = accept(listener, nullptr, nullptr);
    if (fd < 0) continue;
    uint64_t count = 0;
    bool ok = ReceiveAll(fd, reinterpret_cast<char*>(&count), sizeof(count));
    const int64_t bytes = static_cast<int64_t>(count);
    ok = ok && ReceiveRepeated(fd, &buffer, bytes) && SendRepeated(fd, buffer, bytes);
    close(fd);
  }
}

}  // namespace offload
