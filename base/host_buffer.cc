#include "base/host_buffer.h"

#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace offload {

absl::StatusOr<HostBuffer> HostBuffer::Allocate(int64_t bytes) {
  HostBuffer buffer;
  if (bytes <= 0) return buffer;
  const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t rounded = (bytes + page - 1) / page * page;
  void* p = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat(__FILE__, ":", __LINE__, ": mmap of ", rounded,
                                                     " bytes failed: ", std::strerror(errno)));
  }
  madvise(p, rounded, MADV_HUGEPAGE);  // a hint; fine if THP is off
  buffer.data_ = p;
  buffer.bytes_ = rounded;
  return buffer;
}

HostBuffer& HostBuffer::operator=(HostBuffer&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) munmap(data_, bytes_);
    data_ = o.data_;
    bytes_ = o.bytes_;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

HostBuffer::~HostBuffer() {
  if (data_ != nullptr) munmap(data_, bytes_);
}

void KeepFreedMemoryForReuse() {
  // One arena: gRPC's threads allocate and free the chunk buffers in turn, and per-thread
  // arenas map and unmap whole heaps as their chunks come and go (measured: thousands of page
  // faults per 16M-parameter step with them, none without).
  mallopt(M_ARENA_MAX, 1);
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // the largest glibc accepts
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_TOP_PAD, 64 << 20);
}

}  // namespace offload
