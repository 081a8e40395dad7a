#include "cpu_optimizer_server/grpc/slice_buffer_pool.h"

namespace offload {

std::shared_ptr<SliceBuffer> SliceBufferPool::Take(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<SliceBuffer>* too_small = nullptr;
  for (std::shared_ptr<SliceBuffer>& b : kept_) {
    // Nothing but the pool hands out references, so one it alone holds stays free.
    if (!HeldOnlyHere(b)) continue;
    if (b->capacity() >= bytes) return b;
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
