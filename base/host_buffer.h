// Page-aligned host memory from mmap. Pages stay untouched until first written, so the thread
// that owns a tile decides on which NUMA node its pages land (first touch).
#ifndef OFFLOAD_BASE_HOST_BUFFER_H_
#define OFFLOAD_BASE_HOST_BUFFER_H_

#include <cstdint>

#include "absl/status/statusor.h"

namespace offload {

class HostBuffer {
 public:
  HostBuffer() = default;
  // Maps `bytes` (rounded up to whole pages); asks for transparent huge pages, which cut TLB
  // misses on the streaming passes.
  static absl::StatusOr<HostBuffer> Allocate(int64_t bytes);

  HostBuffer(HostBuffer&& o) noexcept : data_(o.data_), bytes_(o.bytes_) {
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  HostBuffer& operator=(HostBuffer&& o) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer();

  void* data() const { return data_; }
  int64_t size() const { return bytes_; }

 private:
  void* data_ = nullptr;
  int64_t bytes_ = 0;
};

// Makes malloc keep and reuse freed multi-megabyte blocks. Every message of the step protocol
// carries megabytes; by default glibc serves such blocks with a fresh mmap and unmaps them on
// free, so each chunk pays a page fault per 4 KiB and the kernel zeroing the page, which costs
// more than moving the bytes. Call once at the start of a binary that serves or sends steps.
void KeepFreedMemoryForReuse();

}  // namespace offload

#endif  // OFFLOAD_BASE_HOST_BUFFER_H_
