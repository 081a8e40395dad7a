// Buffers that gRPC messages' payload slices own (step_wire.h SharedSlice), reused once gRPC has
// dropped its last reference. A step moves hundreds of MiB in 4 MiB pieces; a fresh allocation
// for each would zero-fill and page-fault every byte again (glibc hands large blocks back to the
// kernel on free), one more pass over memory beside the kernel's own copies.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_SLICE_BUFFER_POOL_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_SLICE_BUFFER_POOL_H_

#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

namespace offload {

// Uninitialized bytes: whatever a message sends from one was written there first.
class SliceBuffer {
 public:
  explicit SliceBuffer(size_t capacity) : bytes_(new char[capacity]), capacity_(capacity) {}
  char* data() { return bytes_.get(); }
  size_t capacity() const { return capacity_; }

 private:
  std::unique_ptr<char[]> bytes_;
  size_t capacity_;
};

// Whether `buffer` is referenced only through this pointer: gRPC dropped every slice over it (with
// release order), so its reads of the bytes are over and they may be written again.
inline bool HeldOnlyHere(const std::shared_ptr<SliceBuffer>& buffer) {
  if (buffer.use_count() != 1) return false;
  std::atomic_thread_fence(std::memory_order_acquire);
  return true;
}

class SliceBufferPool {
 public:
  // Keeps at most max_kept buffers; a burst past that allocates buffers that are freed after use.
  explicit SliceBufferPool(size_t max_kept) : max_kept_(max_kept) {}
  // A buffer of at least `bytes` that nothing else references: a kept one gRPC released, else a
  // new one.
  std::shared_ptr<SliceBuffer> Take(size_t bytes);

 private:
  const size_t max_kept_;
  std::mutex mu_;
  std::vector<std::shared_ptr<SliceBuffer>> kept_;
};

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_SLICE_BUFFER_POOL_H_
