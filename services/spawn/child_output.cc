#include "services/spawn/child_output.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace offload {
namespace {

// A child that never prints a newline must not make the launcher buffer without bound.
constexpr size_t kMaxLine = 64 << 10;

int PollTimeoutMs(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return -1;
  const absl::Duration left =
      std::clamp(deadline - absl::Now(), absl::ZeroDuration(), absl::Hours(1));
  return static_cast<int>(absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))));
}

}  // namespace

LineReader::~LineReader() {
  if (fd_ >= 0) close(fd_);
}

LineReader::Result LineReader::ReadLine(absl::Time deadline, int wake_fd, std::string* line) {
  for (;;) {
    const size_t newline = buffer_.find('\n');
    if (newline != std::string::npos || buffer_.size() >= kMaxLine || (end_ && !buffer_.empty())) {
      const size_t take = newline != std::string::npos ? newline : buffer_.size();
      line->assign(buffer_, 0, take);
      buffer_.erase(0, newline != std::string::npos ? newline + 1 : take);
      return Result::kLine;
    }
    if (end_) return Result::kEnd;

    pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_fd, POLLIN, 0}};
    const int r = poll(fds, wake_fd >= 0 ? 2 : 1, PollTimeoutMs(deadline));
    if (r < 0 && errno != EINTR) {
      end_ = true;
      continue;
    }
    if (wake_fd >= 0 && (fds[1].revents & POLLIN)) return Result::kWoken;
    if (r > 0 && fds[0].revents != 0) {
      char chunk[4096];
      ssize_t n = read(fd_, chunk, sizeof(chunk));
      if (n > 0) {
        buffer_.append(chunk, static_cast<size_t>(n));
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        end_ = true;
      }
      continue;
    }
    if (absl::Now() >= deadline) return Result::kTimeout;
  }
}

void WriteStderrLine(absl::string_view line) {
  static std::mutex* const mu = new std::mutex;
  std::string out = absl::StrCat(line, "\n");
  std::lock_guard<std::mutex> lock(*mu);
  absl::string_view rest = out;
  while (!rest.empty()) {
    ssize_t n = write(STDERR_FILENO, rest.data(), rest.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // stderr is gone; the job itself must not fail for it
    rest.remove_prefix(static_cast<size_t>(n));
  }
}

std::thread ForwardLines(std::unique_ptr<LineReader> reader, std::string prefix) {
  return std::thread([reader = std::move(reader), prefix = std::move(prefix)] {
    std::string line;
    while (reader->ReadLine(absl::InfiniteFuture(), -1, &line) == LineReader::Result::kLine) {
      WriteStderrLine(absl::StrCat(prefix, line));
    }
  });
}

}  // namespace offload
