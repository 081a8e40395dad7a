#include "cpu_optimizer_server/tools/tcp_bound.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

namespace offload {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
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
  constexpr int64_t kCall = 4 << 20;
  std::vector<char> send_buf(kCall, 1), recv_buf(kCall);
  bool ok = true;
  auto pump = [&](int from, int to) {
    std::thread reader([&] {
      for (int64_t got = 0; got < bytes;) {
        const ssize_t k = recv(to, recv_buf.data(), kCall, 0);
        if (k <= 0) {
          ok = false;
          return;
        }
        got += k;
      }
    });
    for (int64_t sent = 0; sent < bytes;) {
      const ssize_t k = send(from, send_buf.data(), std::min(kCall, bytes - sent), 0);
      if (k <= 0) {
        ok = false;
        break;
      }
      sent += k;
    }
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

}  // namespace offload
