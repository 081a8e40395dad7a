#include "cpu_optimizer_server/shm/shm_segment.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <new>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace offload {
namespace {

constexpr uint64_t kHeaderBytes = kShmHeaderBytes;
constexpr uint64_t kAlign = 4096;

uint64_t AlignUp(uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

std::string ErrnoText(int err) { return std::strerror(err); }

}  // namespace

absl::StatusOr<ShmSegment> ShmSegment::Create(const ShmLayout& layout) {
  if (layout.range_length < 0 || layout.range_length > (int64_t{1} << 51) ||
      layout.chunk_slots < 0 || layout.chunk_slots > kShmMaxChunkSlots ||
      layout.chunk_slot_bytes < 0 || layout.chunk_slot_bytes > (int64_t{1} << 32) ||
      layout.chunk_slot_bytes % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad shm layout: range_length ", layout.range_length, ", ", layout.chunk_slots,
                     " chunk slots of ", layout.chunk_slot_bytes, " bytes (at most ",
                     kShmMaxChunkSlots, " slots of a multiple of 8 bytes up to 4 GiB)"));
  }
  const uint64_t area = AlignUp(static_cast<uint64_t>(layout.range_length) * 2);
  const uint64_t grad_offset = kHeaderBytes;
  const uint64_t param_offset = grad_offset + area;
  const uint64_t slots_offset = param_offset + area;
  const uint64_t bytes =
      AlignUp(slots_offset + static_cast<uint64_t>(layout.chunk_slots) * layout.chunk_slot_bytes);

  absl::BitGen gen;
  ShmSegment segment;
  int fd = -1;
  // A random name, so nobody can guess it ahead (O_EXCL also refuses a planted one).
  for (int attempt = 0; fd < 0; ++attempt) {
    segment.name_ = absl::StrCat("/offload-", getpid(), "-",
                                 absl::Hex(absl::Uniform<uint64_t>(gen), absl::kZeroPad16));
    fd = shm_open(segment.name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 && (errno != EEXIST || attempt == 8)) {
      return absl::UnavailableError(
          absl::StrCat("shm_open(", segment.name_, ") failed: ", ErrnoText(errno)));
    }
  }
  segment.linked_ = true;  // from here on, the destructor removes the name on failure
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    close(fd);
    return absl::ResourceExhaustedError(absl::StrCat("ftruncate of shm segment ", segment.name_,
                                                     " to ", bytes, " bytes: ", ErrnoText(err)));
  }
  if (int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); err != 0) {
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot commit ", bytes, " bytes of /dev/shm for segment ", segment.name_,
                     " (", ErrnoText(err), "): give /dev/shm more room or use the gRPC plane"));
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_errno = errno;
  close(fd);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of shm segment ", segment.name_, ": ", ErrnoText(map_errno)));
  }
  segment.base_ = base;
  segment.size_ = bytes;

  // The file is fresh (zeros); construct the header in place.
  ShmHeader* h = new (base) ShmHeader();
  std::memcpy(h->magic, kShmMagic, 4);
  h->version = kShmVersion;
  h->segment_bytes = bytes;
  h->range_offset = layout.range_offset;
  h->range_length = layout.range_length;
  h->param_dtype = layout.param_dtype;
  h->chunk_slots = static_cast<uint32_t>(layout.chunk_slots);
  h->chunk_slot_bytes = layout.chunk_slot_bytes;
  h->grad_area_offset = grad_offset;
  h->param_area_offset = param_offset;
  h->slots_offset = slots_offset;
  for (int i = 0; i < kShmSecretBytes; i += 8) {
    const uint64_t r = absl::Uniform<uint64_t>(gen);
    std::memcpy(h->secret + i, &r, 8);
  }
  std::atomic_thread_fence(std::memory_order_release);
  return segment;
}

absl::Status ShmSegment::Validate(const void* base, uint64_t file_bytes) {
  if (file_bytes < kHeaderBytes) {
    return absl::DataLossError(absl::StrCat("shm segment is ", file_bytes,
                                            " bytes, smaller than its ", kHeaderBytes,
                                            "-byte header (truncated?)"));
  }
  const ShmHeader* h = static_cast<const ShmHeader*>(base);
  if (std::memcmp(h->magic, kShmMagic, 4) != 0) {
    return absl::DataLossError("shm segment has a bad magic (not an Offload segment)");
  }
  if (h->version != kShmVersion) {
    return absl::FailedPreconditionError(absl::StrCat("shm segment has version ", h->version,
                                                      " but this build speaks ", kShmVersion));
  }
  if (h->segment_bytes != file_bytes) {
    return absl::DataLossError(absl::StrCat("shm segment header says ", h->segment_bytes,
                                            " bytes but the file has ", file_bytes,
                                            " (truncated?)"));
  }
  if (h->range_length < 0 || h->range_length > (int64_t{1} << 51) ||
      h->chunk_slots > kShmMaxChunkSlots || h->chunk_slot_bytes < 0 ||
      h->chunk_slot_bytes > (int64_t{1} << 32) || h->param_dtype > 2) {
    return absl::DataLossError(absl::StrCat("shm segment header is inconsistent: range_length ",
                                            h->range_length, ", ", h->chunk_slots,
                                            " chunk slots of ", h->chunk_slot_bytes, " bytes"));
  }
  const uint64_t area = static_cast<uint64_t>(h->range_length) * 2;
  const uint64_t slots = static_cast<uint64_t>(h->chunk_slots) * h->chunk_slot_bytes;
  if (h->grad_area_offset < kHeaderBytes || h->grad_area_offset > file_bytes ||
      area > file_bytes - h->grad_area_offset || h->param_area_offset < kHeaderBytes ||
      h->param_area_offset > file_bytes || area > file_bytes - h->param_area_offset ||
      h->slots_offset < kHeaderBytes || h->slots_offset > file_bytes ||
      slots > file_bytes - h->slots_offset) {
    return absl::DataLossError(absl::StrCat("shm segment of ", file_bytes,
                                            " bytes is too small for the areas its header names"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ShmSegment> ShmSegment::Open(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::FailedPreconditionError(
          absl::StrCat("shm segment ", name,
                       " does not exist here: the shard is on another host or in another IPC "
                       "namespace (no shared /dev/shm)"));
    }
    return absl::FailedPreconditionError(absl::StrCat("shm_open(", name, "): ", ErrnoText(err)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("fstat of shm segment ", name, ": ", ErrnoText(err)));
  }
  const uint64_t bytes = static_cast<uint64_t>(st.st_size);
  if (bytes < kHeaderBytes) {
    close(fd);
    return Validate(nullptr, bytes);
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_errno = errno;
  close(fd);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of shm segment ", name, ": ", ErrnoText(map_errno)));
  }
  ShmSegment segment;
  segment.name_ = name;
  segment.base_ = base;
  segment.size_ = bytes;
  OFFLOAD_RETURN_IF_ERROR(Validate(base, bytes));
  return segment;
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept
    : name_(std::move(other.name_)),
      base_(std::exchange(other.base_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      linked_(std::exchange(other.linked_, false)) {}

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    Reset();
    name_ = std::move(other.name_);
    base_ = std::exchange(other.base_, nullptr);
    size_ = std::exchange(other.size_, 0);
    linked_ = std::exchange(other.linked_, false);
  }
  return *this;
}

ShmSegment::~ShmSegment() { Reset(); }

void ShmSegment::Reset() {
  Unlink();
  if (base_ != nullptr) munmap(base_, size_);
  base_ = nullptr;
  size_ = 0;
}

void ShmSegment::Unlink() {
  if (!linked_) return;
  shm_unlink(name_.c_str());
  linked_ = false;
}

void ShmWait(std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout) {
  // A reply usually follows within microseconds; a short spin saves two syscalls then. Kept
  // short: the shard's Adam pass wants the cores.
  for (int i = 0; i < 200; ++i) {
    if (word->load(std::memory_order_acquire) != expected) return;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  const timespec ts = absl::ToTimespec(timeout);
  // Not FUTEX_WAIT_PRIVATE: the word is shared with another process.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void ShmWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

bool ShmSecretEquals(const void* a, const void* b, size_t n) {
  const volatile uint8_t* x = static_cast<const uint8_t*>(a);
  const volatile uint8_t* y = static_cast<const uint8_t*>(b);
  uint8_t diff = 0;
  for (size_t i = 0; i < n; ++i) diff |= x[i] ^ y[i];
  return diff == 0;
}

}  // namespace offload
