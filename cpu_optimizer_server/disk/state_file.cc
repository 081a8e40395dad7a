#include "cpu_optimizer_server/disk/state_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace offload {

const char* StateTensorName(int tensor) {
  switch (tensor) {
    case 0:
      return "master weights";
    case 1:
      return "exp_avg";
    case 2:
      return "exp_avg_sq";
  }
  return "?";
}

absl::StatusOr<std::unique_ptr<StateFile>> StateFile::Create(const std::string& path,
                                                             int64_t length, bool sparse) {
  if (length <= 0) return absl::InvalidArgumentError("a state file needs a length > 0");
  int direct_fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
  // A file system without O_DIRECT (tmpfs before Linux 6.6) still works, through its cache.
  if (direct_fd < 0 && errno == EINVAL) {
    direct_fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  }
  if (direct_fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create ", path, ": ", std::strerror(errno)));
  }
  auto fail = [&](const std::string& what, int err) {
    ::close(direct_fd);
    ::unlink(path.c_str());
    const std::string message = absl::StrCat(what, " ", path, ": ", std::strerror(err));
    return err == ENOSPC ? absl::ResourceExhaustedError(message) : absl::InternalError(message);
  };
  const int64_t bytes = StateFileBytes(length);
  if (sparse) {
    if (::ftruncate(direct_fd, bytes) != 0) return fail("cannot size", errno);
  } else if (::fallocate(direct_fd, 0, 0, bytes) != 0) {
    const int err = errno;
    if (err == ENOSPC) {
      return fail(absl::StrCat("no room for the ", bytes, " bytes of optimizer state in"), err);
    }
    // A file system without fallocate: sized, and blocks come as the first pass writes them.
    if (err != EOPNOTSUPP || ::ftruncate(direct_fd, bytes) != 0) {
      return fail("cannot allocate", err);
    }
  }
  const int buffered_fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (buffered_fd < 0) return fail("cannot reopen", errno);
  return std::unique_ptr<StateFile>(new StateFile(path, length, direct_fd, buffered_fd));
}

StateFile::~StateFile() {
  ::close(direct_fd_);
  ::close(buffered_fd_);
  ::unlink(path_.c_str());
}

absl::Status StateFile::Read(int tensor, int64_t begin, int64_t n, float* out) const {
  auto* dst = reinterpret_cast<char*>(out);
  int64_t offset = TensorOffset(tensor) + begin * 4;
  for (int64_t left = n * 4; left > 0;) {
    const ssize_t got = ::pread(buffered_fd_, dst, static_cast<size_t>(left), offset);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      return absl::DataLossError(absl::StrCat(
          "reading ", StateTensorName(tensor), " elements [", begin, ", ", begin + n, ") of ",
          path_, ": ", got == 0 ? "the file ends early" : std::strerror(errno)));
    }
    dst += got;
    offset += got;
    left -= got;
  }
  return absl::OkStatus();
}

absl::Status StateFile::Write(int tensor, int64_t begin, int64_t n, const float* in) {
  const auto* src = reinterpret_cast<const char*>(in);
  int64_t offset = TensorOffset(tensor) + begin * 4;
  for (int64_t left = n * 4; left > 0;) {
    const ssize_t put = ::pwrite(buffered_fd_, src, static_cast<size_t>(left), offset);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) {
      const int err = put == 0 ? EIO : errno;
      const std::string message =
          absl::StrCat("writing ", StateTensorName(tensor), " elements [", begin, ", ", begin + n,
                       ") of ", path_, ": ", std::strerror(err));
      return err == ENOSPC ? absl::ResourceExhaustedError(message) : absl::DataLossError(message);
    }
    src += put;
    offset += put;
    left -= put;
  }
  return absl::OkStatus();
}

absl::Status StateFile::Sync() {
  if (::fdatasync(buffered_fd_) != 0) {
    const int err = errno;
    const std::string message = absl::StrCat("flushing ", path_, ": ", std::strerror(err));
    return err == ENOSPC ? absl::ResourceExhaustedError(message) : absl::DataLossError(message);
  }
  return absl::OkStatus();
}

}  // namespace offload
