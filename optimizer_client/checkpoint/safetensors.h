// The safetensors format (https://github.com/huggingface/safetensors), which Hugging Face and
// PyTorch tools read and write:
//
//   u64 little endian N | N bytes of JSON header | data section
//
// The header maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]} (byte offsets
// into the data section) plus an optional "__metadata__" string->string map. The reader trusts
// nothing: it validates the whole header before handing out a pointer into the mapped file.
#ifndef OFFLOAD_OPTIMIZER_CLIENT_CHECKPOINT_SAFETENSORS_H_
#define OFFLOAD_OPTIMIZER_CLIENT_CHECKPOINT_SAFETENSORS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "optimizer_client/checkpoint/atomic_file.h"

namespace offload {

// The safetensors dtype strings "F32", "F16", "BF16", "I32", "I64", "U16", "U8".
enum class TensorDType { kF32, kF16, kBF16, kI32, kI64, kU16, kU8 };

int TensorDTypeSize(TensorDType d);
absl::string_view TensorDTypeName(TensorDType d);

struct SafetensorsEntry {
  std::string name;
  TensorDType dtype;
  std::vector<int64_t> shape;
  int64_t begin = 0;  // byte offsets in the data section
  int64_t end = 0;
};

class SafetensorsReader {
 public:
  // Maps the file read-only and validates it: header length inside the file (and at most
  // 100 MB), header a JSON object, every entry a known dtype, a non-negative integer shape and
  // data_offsets with end - begin == numel * dtype size, the entries tiling the data section
  // without overlaps or holes (as the format requires), "__metadata__" a string->string map.
  // Errors name the file and the entry.
  static absl::StatusOr<std::unique_ptr<SafetensorsReader>> Open(const std::string& path);

  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;
  ~SafetensorsReader();

  const std::string& path() const { return path_; }
  // Ordered by data offset.
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const SafetensorsEntry* Find(absl::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The entry's bytes in the mapping. Only the data section's start is aligned (to 8, in files
  // we write), so a tensor may sit at any address: read through memcpy unless its alignment
  // is known.
  const void* Data(const SafetensorsEntry& e) const;
  // Where the data section starts in the file (8 + the header's length): entry e's bytes are at
  // file offsets [data_offset() + e.begin, data_offset() + e.end), for a reader that streams the
  // file with read() instead of touching the mapping.
  int64_t data_offset() const { return data_ - map_; }
  int64_t file_size() const { return map_size_; }

  // Copies tensor `name` into out as fp32 (from F32, F16 or BF16) after checking it exists and
  // its shape equals `shape`.
  absl::Status ReadAsFloat(absl::string_view name, absl::Span<const int64_t> shape,
                           float* out) const;

 private:
  SafetensorsReader() = default;

  std::string path_;
  const uint8_t* map_ = nullptr;
  int64_t map_size_ = 0;
  const uint8_t* data_ = nullptr;  // start of the data section
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> position in entries_
  std::map<std::string, std::string> metadata_;
};

struct SafetensorsTensor {
  std::string name;
  TensorDType dtype;
  std::vector<int64_t> shape;
  // Either the bytes...
  const void* data = nullptr;
  // ...or a producer called with consecutive byte ranges (<= 16 MiB each) to fill, so large
  // state streams to disk without a second full copy in memory.
  std::function<absl::Status(int64_t byte_offset, int64_t nbytes, void* out)> fill;
};

// Writes atomically (temp file in the same directory, fsync, rename, fsync the directory): a
// crash leaves either the old file or the new one. Data is laid out in the given order; the
// header is padded with spaces to a multiple of 8 bytes so the data section starts 8-aligned.
// With `checksum`, the file's size and CRC-32, computed as it streams out (never read back),
// are stored there once it is committed.
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsTensor>& tensors,
                              const std::map<std::string, std::string>& metadata,
                              FileChecksum* checksum = nullptr);

}  // namespace offload

#endif  // OFFLOAD_OPTIMIZER_CLIENT_CHECKPOINT_SAFETENSORS_H_
