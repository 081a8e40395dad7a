#include "cpu_optimizer_server/grpc/slice_buffer_pool.h"

#include <atomic>

namespace offload {

std::shared_ptr<SliceBuffer> SliceBufferPool::Take(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<SliceBuffer>* too_small = nullptr;
  for (std::shared_ptr<SliceBuffer>& b : kept_) {
    // Only the pool holds it: gRPC dropped its last reference (with release order), so its reads
    // of the bytes are over. Nothing but the pool hands out references, so it stays free.
    if (b.use_count() != 1) continue;
    if (b->capacity() >= bytes) {
      std::atomic_thread_fence(std::memory_order_acquire);
      return b;
    }
    if (too_small == nullptr) too_small = &b;
  }
  auto made = std::make_shared<SliceBuffer>(bytes);
  if (too_small != nullptr) {
    *too_small = made;  // a free one that is too small makes room
  } else if (kept_.size() < max_kept_) {
    kept_.push_back(made);
  }
  return made;
}

}  // namespace offload
