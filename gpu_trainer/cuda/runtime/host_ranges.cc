#include "gpu_trainer/cuda/runtime/host_ranges.h"

#include <iterator>

namespace offload {

bool HostRanges::Add(const void* p, int64_t bytes) {
  if (p == nullptr || bytes <= 0) return false;
  const auto begin = reinterpret_cast<uintptr_t>(p);
  const uintptr_t end = begin + static_cast<uintptr_t>(bytes);
  if (end < begin) return false;           // wraps around the address space
  auto next = ranges_.lower_bound(begin);  // the first range starting at or after begin
  if (next != ranges_.end() && next->first < end) return false;
  if (next != ranges_.begin() && std::prev(next)->second > begin) return false;
  ranges_.emplace(begin, end);
  return true;
}

bool HostRanges::Remove(const void* p) { return ranges_.erase(reinterpret_cast<uintptr_t>(p)) > 0; }

bool HostRanges::Contains(const void* p, int64_t bytes) const {
  if (p == nullptr || bytes < 0) return false;
  const auto begin = reinterpret_cast<uintptr_t>(p);
  const uintptr_t end = begin + static_cast<uintptr_t>(bytes);
  if (end < begin) return false;
  auto after = ranges_.upper_bound(begin);  // the first range starting after begin
  if (after == ranges_.begin()) return false;
  const auto& [start, stop] = *std::prev(after);
  return start <= begin && (bytes == 0 ? begin < stop : end <= stop);
}

std::vector<const void*> HostRanges::Starts() const {
  std::vector<const void*> starts;
  for (const auto& [start, end] : ranges_) starts.push_back(reinterpret_cast<const void*>(start));
  return starts;
}

}  // namespace offload
