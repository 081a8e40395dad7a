// One io_uring (liburing) submission and completion queue, for the disk tier's streaming passes:
// reads and writes of whole aligned blocks queued from one thread and reaped by the same thread,
// so a pass keeps several transfers in flight without a thread per transfer.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_DISK_IO_RING_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_DISK_IO_RING_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

struct io_uring;

namespace offload {

class IoRing {
 public:
  // A ring with room for `depth` transfers in flight. FAILED_PRECONDITION where the kernel has
  // io_uring disabled (kernel.io_uring_disabled, or a seccomp profile that refuses it).
  static absl::StatusOr<std::unique_ptr<IoRing>> Create(int depth);
  ~IoRing();
  IoRing(const IoRing&) = delete;
  IoRing& operator=(const IoRing&) = delete;

  // Queues a transfer of `bytes` between `buf` and file offset `offset` of `fd`; `tag` comes back
  // with its completion. Nothing reaches the kernel before Submit(). RESOURCE_EXHAUSTED when
  // `depth` transfers are already queued or in flight.
  absl::Status QueueRead(int fd, void* buf, int64_t bytes, int64_t offset, uint64_t tag);
  absl::Status QueueWrite(int fd, const void* buf, int64_t bytes, int64_t offset, uint64_t tag);
  absl::Status Submit();

  struct Completion {
    uint64_t tag = 0;
    int64_t result = 0;  // bytes moved, or -errno
    int64_t wanted = 0;  // the bytes queued
  };
  // Waits for the next completion (any order). FAILED_PRECONDITION when nothing is in flight.
  absl::StatusOr<Completion> Wait();
  int in_flight() const { return in_flight_; }
  int depth() const { return depth_; }

 private:
  IoRing(std::unique_ptr<io_uring> ring, int depth);
  absl::Status Queue(bool write, int fd, void* buf, int64_t bytes, int64_t offset, uint64_t tag);

  std::unique_ptr<io_uring> ring_;
  const int depth_;
  int in_flight_ = 0;  // queued or submitted, not yet reaped
};

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_DISK_IO_RING_H_
