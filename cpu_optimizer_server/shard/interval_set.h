// A set of disjoint half-open element intervals, for "which elements has this stream covered".
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_INTERVAL_SET_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_INTERVAL_SET_H_

#include <cstdint>
#include <map>
#include <optional>
#include <utility>

namespace offload {

class IntervalSet {
 public:
  using Interval = std::pair<int64_t, int64_t>;  // [first, second)

  // The first stored interval that overlaps [begin, end), if any.
  std::optional<Interval> FindOverlap(int64_t begin, int64_t end) const {
    auto it = by_begin_.upper_bound(begin);
    if (it != by_begin_.begin()) {
      auto prev = std::prev(it);
      if (prev->second > begin) return *prev;
    }
    if (it != by_begin_.end() && it->first < end) return *it;
    return std::nullopt;
  }

  // Adds [begin, end), merging with what it touches or overlaps.
  void Insert(int64_t begin, int64_t end) {
    if (begin >= end) return;
    auto it = by_begin_.upper_bound(begin);
    if (it != by_begin_.begin() && std::prev(it)->second >= begin) --it;
    while (it != by_begin_.end() && it->first <= end) {
      begin = std::min(begin, it->first);
      end = std::max(end, it->second);
      covered_ -= it->second - it->first;
      it = by_begin_.erase(it);
    }
    by_begin_.emplace(begin, end);
    covered_ += end - begin;
  }

  // The first element of [begin, end) not in the set, or nullopt when all are.
  std::optional<int64_t> FirstGap(int64_t begin, int64_t end) const {
    int64_t pos = begin;
    auto it = by_begin_.upper_bound(pos);
    if (it != by_begin_.begin() && std::prev(it)->second > pos) pos = std::prev(it)->second;
    return pos < end ? std::optional<int64_t>(pos) : std::nullopt;
  }

  // Calls fn(begin, end) for each stored interval in increasing order.
  template <typename Fn>
  void ForEach(Fn&& fn) const {
    for (const auto& [begin, end] : by_begin_) fn(begin, end);
  }

  int64_t covered() const { return covered_; }

 private:
  std::map<int64_t, int64_t> by_begin_;  // begin -> end, disjoint and not touching
  int64_t covered_ = 0;
};

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_INTERVAL_SET_H_
