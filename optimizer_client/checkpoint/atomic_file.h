// Crash-safe file replacement: write to a temp file in the same directory, fsync it, rename it
// over the target and fsync the directory. After a crash at any point the path holds either the
// old contents or the new ones, never a torn mix (rename within one filesystem is atomic, and
// the directory fsync makes the rename itself durable).
#ifndef OFFLOAD_OPTIMIZER_CLIENT_CHECKPOINT_ATOMIC_FILE_H_
#define OFFLOAD_OPTIMIZER_CLIENT_CHECKPOINT_ATOMIC_FILE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace offload {

class AtomicFileWriter {
 public:
  // Creates a temp file next to `path` (its directory must exist).
  static absl::StatusOr<std::unique_ptr<AtomicFileWriter>> Open(const std::string& path);

  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  // Removes the temp file unless Commit succeeded, so a failed write leaves no debris.
  ~AtomicFileWriter();

  absl::Status Append(const void* data, int64_t nbytes);
  absl::Status Append(absl::string_view bytes) { return Append(bytes.data(), bytes.size()); }
  int64_t bytes_written() const { return written_; }
  // The CRC-32 (zlib's crc32()) of every byte appended so far, computed as they stream out.
  uint32_t crc32() const { return crc_; }

  // fsync, close, rename over the target, fsync the directory. Call at most once.
  absl::Status Commit();

 private:
  AtomicFileWriter(std::string path, std::string temp_path, int fd)
      : path_(std::move(path)), temp_path_(std::move(temp_path)), fd_(fd) {}

  std::string path_;
  std::string temp_path_;
  int fd_ = -1;
  int64_t written_ = 0;
  uint32_t crc_ = 0;  // zlib's crc32() of nothing is 0
  bool committed_ = false;
};

// A file's size and CRC-32 as written (what the checkpoint manifest records of each file).
struct FileChecksum {
  int64_t bytes = 0;
  uint32_t crc32 = 0;
};

// zlib's crc32() continued over n bytes, for any n (zlib takes at most 4 GiB - 1 per call).
uint32_t Crc32Update(uint32_t crc, const void* data, int64_t n);

// The whole file in one call.
absl::Status WriteFileAtomic(const std::string& path, absl::string_view contents);

// fsync of a file or a directory by path (a directory's fsync makes renames and creations of
// its entries durable).
absl::Status FsyncPath(const std::string& path);

// The whole of a small file (a manifest, a `latest` pointer); NotFound when it is missing.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path);

// The directory part of `path` ("." when it has none).
std::string DirName(const std::string& path);

}  // namespace offload

#endif  // OFFLOAD_OPTIMIZER_CLIENT_CHECKPOINT_ATOMIC_FILE_H_
