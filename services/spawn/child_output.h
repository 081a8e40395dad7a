// The captured output of a child: read line by line (to find a server's port announcement) and
// then copied to the launcher's stderr with a prefix that says whose it is.
#ifndef OFFLOAD_SERVICES_SPAWN_CHILD_OUTPUT_H_
#define OFFLOAD_SERVICES_SPAWN_CHILD_OUTPUT_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace offload {

class LineReader {
 public:
  enum class Result { kLine, kEnd, kTimeout, kWoken };

  // Takes ownership of `fd`.
  explicit LineReader(int fd) : fd_(fd) {}
  ~LineReader();
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;

  // The next line, without its newline. A last line without one still comes out before kEnd.
  // Gives up at `deadline`, or with kWoken as soon as `wake_fd` (if >= 0) is readable, which it
  // leaves unread: the caller wants to hear about its events while it waits for output.
  Result ReadLine(absl::Time deadline, int wake_fd, std::string* line);

 private:
  int fd_;
  std::string buffer_;
  bool end_ = false;
};

// Writes `line` and a newline to stderr in one write, so lines from several threads never mix.
void WriteStderrLine(absl::string_view line);

// Copies every remaining line from `reader` to stderr, each after `prefix`, until the output ends
// (every process holding the pipe's write end has gone).
std::thread ForwardLines(std::unique_ptr<LineReader> reader, std::string prefix);

}  // namespace offload

#endif  // OFFLOAD_SERVICES_SPAWN_CHILD_OUTPUT_H_
