#include "optimizer_client/checkpoint/atomic_file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace offload {

std::string DirName(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

uint32_t Crc32Update(uint32_t crc, const void* data, int64_t n) {
  const Bytef* p = static_cast<const Bytef*>(data);
  while (n > 0) {
    const uInt len = static_cast<uInt>(std::min<int64_t>(n, 1 << 30));
    crc = static_cast<uint32_t>(::crc32(crc, p, len));
    p += len;
    n -= len;
  }
  return crc;
}

absl::Status FsyncPath(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", path, " to fsync"));
  absl::Status status;
  if (fsync(fd) != 0) status = absl::ErrnoToStatus(errno, absl::StrCat("fsync of ", path));
  close(fd);
  return status;
}

absl::StatusOr<std::unique_ptr<AtomicFileWriter>> AtomicFileWriter::Open(const std::string& path) {
  if (path.empty() || path.back() == '/') {
    return absl::InvalidArgumentError(absl::StrCat("not a file path: '", path, "'"));
  }
  // mkstemp picks a unique name, so two writers of the same target never share a temp file.
  std::string temp = absl::StrCat(path, ".tmp.XXXXXX");
  std::vector<char> name(temp.begin(), temp.end());
  name.push_back('\0');
  const int fd = mkostemp(name.data(), O_CLOEXEC);
  if (fd < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot create a temp file for ", path));
  }
  // mkstemp creates 0600; checkpoints are meant to be read by other tools and users. (Reading
  // the umask would need umask(), which races with other threads creating files.)
  fchmod(fd, 0644);
  return std::unique_ptr<AtomicFileWriter>(new AtomicFileWriter(path, name.data(), fd));
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) close(fd_);
  if (!committed_) unlink(temp_path_.c_str());
}

absl::Status AtomicFileWriter::Append(const void* data, int64_t nbytes) {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, " is already closed"));
  const char* p = static_cast<const char*>(data);
  crc_ = Crc32Update(crc_, p, nbytes);  // the bytes as given, before the disk has them
  while (nbytes > 0) {
    // write() may stop short (and caps one call near 2 GiB), so loop.
    const ssize_t n = write(fd_, p, static_cast<size_t>(std::min<int64_t>(nbytes, 1 << 30)));
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::ErrnoToStatus(errno,
                                 absl::StrCat("write to ", temp_path_, " at byte ", written_));
    }
    p += n;
    nbytes -= n;
    written_ += n;
  }
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::Commit() {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, " is already closed"));
  const int fd = fd_;
  fd_ = -1;
  if (fsync(fd) != 0) {
    const int err = errno;
    close(fd);
    return absl::ErrnoToStatus(err, absl::StrCat("fsync of ", temp_path_));
  }
  if (close(fd) != 0) return absl::ErrnoToStatus(errno, absl::StrCat("close of ", temp_path_));
  if (rename(temp_path_.c_str(), path_.c_str()) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("cannot rename ", temp_path_, " to ", path_));
  }
  committed_ = true;
  return FsyncPath(DirName(path_));
}

absl::Status WriteFileAtomic(const std::string& path, absl::string_view contents) {
  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> w, AtomicFileWriter::Open(path));
  OFFLOAD_RETURN_IF_ERROR(w->Append(contents));
  return w->Commit();
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::ErrnoToStatus(errno, absl::StrCat("cannot open ", path));
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      close(fd);
      return absl::ErrnoToStatus(err, absl::StrCat("cannot read ", path));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return out;
}

}  // namespace offload
