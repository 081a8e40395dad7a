#include "cpu_optimizer_server/disk/state_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

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
                                                             int64_t length, bool sparse,
                                                             DType moments) {
  if (length <= 0) return absl::InvalidArgumentError("a state file needs a length > 0");
  if (moments == DType::kFp16) return absl::InvalidArgumentError("moments are fp32 or bf16");
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
  const int64_t bytes = StateFileBytes(length, moments);
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
  return std::unique_ptr<StateFile>(new StateFile(path, length, moments, direct_fd, buffered_fd));
}

StateFile::~StateFile() {
  ::close(direct_fd_);
  ::close(buffered_fd_);
  ::unlink(path_.c_str());
}

absl::Status StateFile::Read(int tensor, int64_t begin, int64_t n, float* out) const {
  if (ElementBytes(tensor) == 4) return ReadBytes(tensor, begin, n, out);
  // bf16: into the upper half of `out`'s bytes, then widened from the front (element i's fp32
  // lands at bytes [4i, 4i + 4), never over the 16-bit elements it has yet to read).
  char* const bytes = reinterpret_cast<char*>(out);
  OFFLOAD_RETURN_IF_ERROR(ReadBytes(tensor, begin, n, bytes + 2 * n));
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, bytes + 2 * n + 2 * i, 2);
    out[i] = Bf16ToFloat(h);
  }
  return absl::OkStatus();
}

absl::Status StateFile::Write(int tensor, int64_t begin, int64_t n, const float* in) {
  if (ElementBytes(tensor) == 4) return WriteBytes(tensor, begin, n, in);
  constexpr int64_t kPiece = int64_t{1} << 16;
  std::vector<uint16_t> half(std::min(n, kPiece));
  for (int64_t done = 0; done < n; done += kPiece) {
    const int64_t k = std::min(kPiece, n - done);
    ConvertFromFloat(in + done, k, DType::kBf16, half.data());
    OFFLOAD_RETURN_IF_ERROR(WriteBytes(tensor, begin + done, k, half.data()));
  }
  return absl::OkStatus();
}

absl::Status StateFile::ReadBytes(int tensor, int64_t begin, int64_t n, void* out) const {
  auto* dst = static_cast<char*>(out);
  const int size = ElementBytes(tensor);
  int64_t offset = TensorOffset(tensor) + begin * size;
  for (int64_t left = n * size; left > 0;) {
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

absl::Status StateFile::WriteBytes(int tensor, int64_t begin, int64_t n, const void* in) {
  const auto* src = static_cast<const char*>(in);
  const int size = ElementBytes(tensor);
  int64_t offset = TensorOffset(tensor) + begin * size;
  for (int64_t left = n * size; left > 0;) {
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
