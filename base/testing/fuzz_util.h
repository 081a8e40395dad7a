// What the libFuzzer targets share (docs/RELIABILITY.md): failing loudly on a broken promise,
// handing an input to a reader that only opens files by path, and comparing messages as bytes.
#ifndef OFFLOAD_BASE_TESTING_FUZZ_UTIL_H_
#define OFFLOAD_BASE_TESTING_FUZZ_UTIL_H_

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/string_view.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/message_lite.h"

namespace offload {

// Prints "<target>: <what>" (and the detail, when there is one) and aborts: libFuzzer counts the
// abort as a crash and keeps the input that caused it.
[[noreturn]] inline void FuzzFail(absl::string_view target, absl::string_view what,
                                  absl::string_view detail = {}) {
  std::fprintf(stderr, "%.*s: %.*s\n", static_cast<int>(target.size()), target.data(),
               static_cast<int>(what.size()), what.data());
  if (!detail.empty()) {
    std::fprintf(stderr, "%.*s\n", static_cast<int>(detail.size()), detail.data());
  }
  std::abort();
}

// One memfd, rewritten with every input and opened by its /proc/self/fd path: no disk, nothing to
// clean up, and the reader sees exactly the input's bytes as a file.
class FuzzInputFile {
 public:
  explicit FuzzInputFile(const char* name) : fd_(memfd_create(name, 0)) {
    if (fd_ < 0) FuzzFail(name, "memfd_create failed");
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  // Replaces the file's contents with the input; returns the path to open.
  const std::string& Write(const uint8_t* data, size_t size) {
    if (ftruncate(fd_, 0) != 0 ||
        (size > 0 && pwrite(fd_, data, size, 0) != static_cast<ssize_t>(size))) {
      FuzzFail(path_, "writing the memfd failed");
    }
    return path_;
  }

 private:
  int fd_;
  std::string path_;
};

// A message's bytes, serialized deterministically (map order fixed), so two messages with the
// same fields give the same bytes: what a print-and-parse round trip is compared by.
inline std::string DeterministicBytes(const google::protobuf::MessageLite& m) {
  std::string out;
  google::protobuf::io::StringOutputStream stream(&out);
  google::protobuf::io::CodedOutputStream coded(&stream);
  coded.SetSerializationDeterministic(true);
  m.SerializeToCodedStream(&coded);
  return out;
}

}  // namespace offload

#endif  // OFFLOAD_BASE_TESTING_FUZZ_UTIL_H_
