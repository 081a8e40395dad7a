#include "services/launcher/signal_fd.h"

#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "absl/time/clock.h"

namespace offload {

absl::StatusOr<SignalFd> SignalFd::Create(std::initializer_list<int> signals) {
  sigset_t set;
  sigemptyset(&set);
  for (int signo : signals) sigaddset(&set, signo);
  if (int error = pthread_sigmask(SIG_BLOCK, &set, nullptr); error != 0) {
    return absl::ErrnoToStatus(error, "pthread_sigmask");
  }
  int fd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
  if (fd < 0) return absl::ErrnoToStatus(errno, "signalfd");
  return SignalFd(fd);
}

SignalFd::SignalFd(SignalFd&& other) : fd_(std::exchange(other.fd_, -1)) {}

SignalFd::~SignalFd() {
  if (fd_ >= 0) close(fd_);
}

int SignalFd::Wait(absl::Time deadline) {
  for (;;) {
    signalfd_siginfo info;
    ssize_t n = read(fd_, &info, sizeof(info));
    if (n == static_cast<ssize_t>(sizeof(info))) return static_cast<int>(info.ssi_signo);
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return 0;
    pollfd p = {fd_, POLLIN, 0};
    const int ms = left == absl::InfiniteDuration()
                       ? -1
                       : static_cast<int>(absl::ToInt64Milliseconds(
                             absl::Ceil(std::min(left, absl::Hours(1)), absl::Milliseconds(1))));
    poll(&p, 1, ms);
  }
}

}  // namespace offload
