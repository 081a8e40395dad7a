// Disjoint ranges of host addresses: the host memory a model registered with CUDA
// (cudaHostRegister), which a transfer may then read or write directly instead of going through
// a pinned staging slot and a host memcpy. Host arithmetic only, tested on the CPU. Not
// thread-safe: one owner thread adds, removes and asks.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_HOST_RANGES_H_
#define OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_HOST_RANGES_H_

#include <cstdint>
#include <map>
#include <vector>

namespace offload {

class HostRanges {
 public:
  // False, changing nothing, for an empty range or one that overlaps a range already held.
  bool Add(const void* p, int64_t bytes);
  // Removes the range that starts at p; false if none does.
  bool Remove(const void* p);
  // Whether [p, p + bytes) lies inside one held range (bytes 0: whether p does).
  bool Contains(const void* p, int64_t bytes) const;
  // The start of every held range, in address order.
  std::vector<const void*> Starts() const;
  bool empty() const { return ranges_.empty(); }

 private:
  std::map<uintptr_t, uintptr_t> ranges_;  // start -> end (exclusive)
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_HOST_RANGES_H_
