// SignalFd: the launcher's signals as readable events, so acting on them (waiting, killing,
// printing) happens in ordinary code rather than inside a signal handler.
#ifndef OFFLOAD_SERVICES_LAUNCHER_SIGNAL_FD_H_
#define OFFLOAD_SERVICES_LAUNCHER_SIGNAL_FD_H_

#include <initializer_list>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace offload {

class SignalFd {
 public:
  // Blocks `signals` in the calling thread and opens a signalfd for them. Call it before any
  // other thread starts: threads inherit the mask, and a thread with the signals unblocked would
  // take them with their default action instead. Blocked signals are queued even where the
  // disposition is SIG_IGN (as for a job started in the background by a shell), so they arrive.
  static absl::StatusOr<SignalFd> Create(std::initializer_list<int> signals);

  SignalFd(SignalFd&& other);
  SignalFd& operator=(SignalFd&&) = delete;
  ~SignalFd();

  // Readable while a signal is pending.
  int fd() const { return fd_; }

  // The next pending signal's number, waiting for one until `deadline`; 0 if none came.
  int Wait(absl::Time deadline);

 private:
  explicit SignalFd(int fd) : fd_(fd) {}
  int fd_;
};

}  // namespace offload

#endif  // OFFLOAD_SERVICES_LAUNCHER_SIGNAL_FD_H_
