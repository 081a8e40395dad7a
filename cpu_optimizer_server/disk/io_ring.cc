#include "cpu_optimizer_server/disk/io_ring.h"

#include <liburing.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace offload {

namespace {

// The wanted size travels in the high bits of user_data beside the caller's tag, so a
// completion can be checked for a short transfer without a table.
constexpr int kTagBits = 24;
constexpr uint64_t kTagMask = (uint64_t{1} << kTagBits) - 1;

}  // namespace

absl::StatusOr<std::unique_ptr<IoRing>> IoRing::Create(int depth) {
  if (depth < 1 || depth > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("io_uring depth ", depth, " is not in [1, 4096]"));
  }
  auto ring = std::make_unique<io_uring>();
  const int err = io_uring_queue_init(static_cast<unsigned>(depth), ring.get(), 0);
  if (err < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("io_uring_queue_init(", depth, ") failed: ", std::strerror(-err),
                     " (the disk tier needs io_uring; see kernel.io_uring_disabled)"));
  }
  return std::unique_ptr<IoRing>(new IoRing(std::move(ring), depth));
}

IoRing::IoRing(std::unique_ptr<io_uring> ring, int depth) : ring_(std::move(ring)), depth_(depth) {}

IoRing::~IoRing() {
  // Transfers still in flight write into buffers the caller is about to free: wait them out.
  while (in_flight_ > 0) {
    if (!Wait().ok()) break;
  }
  io_uring_queue_exit(ring_.get());
}

absl::Status IoRing::Queue(bool write, int fd, void* buf, int64_t bytes, int64_t offset,
                           uint64_t tag) {
  // One transfer is at most what read(2) moves at once, well inside user_data's 40 bits.
  if (tag > kTagMask || bytes <= 0 || bytes > 0x7ffff000) {
    return absl::InvalidArgumentError(
        absl::StrCat("io_uring transfer of ", bytes, " bytes with tag ", tag, " is out of range"));
  }
  if (in_flight_ >= depth_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("io_uring ring of depth ", depth_, " is full"));
  }
  io_uring_sqe* sqe = io_uring_get_sqe(ring_.get());
  if (sqe == nullptr) return absl::ResourceExhaustedError("io_uring submission queue is full");
  if (write) {
    io_uring_prep_write(sqe, fd, buf, static_cast<unsigned>(bytes), static_cast<uint64_t>(offset));
  } else {
    io_uring_prep_read(sqe, fd, buf, static_cast<unsigned>(bytes), static_cast<uint64_t>(offset));
  }
  io_uring_sqe_set_data64(sqe, (static_cast<uint64_t>(bytes) << kTagBits) | tag);
  ++in_flight_;
  return absl::OkStatus();
}

absl::Status IoRing::QueueRead(int fd, void* buf, int64_t bytes, int64_t offset, uint64_t tag) {
  return Queue(false, fd, buf, bytes, offset, tag);
}

absl::Status IoRing::QueueWrite(int fd, const void* buf, int64_t bytes, int64_t offset,
                                uint64_t tag) {
  return Queue(true, fd, const_cast<void*>(buf), bytes, offset, tag);
}

absl::Status IoRing::Submit() {
  const int n = io_uring_submit(ring_.get());
  if (n < 0) return absl::InternalError(absl::StrCat("io_uring_submit: ", std::strerror(-n)));
  return absl::OkStatus();
}

absl::StatusOr<IoRing::Completion> IoRing::Wait() {
  if (in_flight_ == 0) return absl::FailedPreconditionError("no io_uring transfer in flight");
  io_uring_cqe* cqe = nullptr;
  int err;
  do {
    err = io_uring_wait_cqe(ring_.get(), &cqe);
  } while (err == -EINTR);
  if (err < 0) return absl::InternalError(absl::StrCat("io_uring_wait_cqe: ", std::strerror(-err)));
  const uint64_t data = io_uring_cqe_get_data64(cqe);
  Completion c;
  c.tag = data & kTagMask;
  c.wanted = static_cast<int64_t>(data >> kTagBits);
  c.result = cqe->res;
  io_uring_cqe_seen(ring_.get(), cqe);
  --in_flight_;
  return c;
}

}  // namespace offload
