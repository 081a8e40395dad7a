// A commit's per-element step overrides (StepCommit.range_steps; ARCHITECTURE.md section 4.3), in
// a header of its own, as param_groups.h, so that every data plane and the trainer's backends can
// carry them without depending on the shard store.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_RANGE_STEPS_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_RANGE_STEPS_H_

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "absl/types/span.h"

namespace offload {

// Flat elements [offset, offset + length) of the job's flat space (global offsets, as gradient
// chunks use) and how a commit updates them. PyTorch's Adam/AdamW skips a parameter whose grad is
// None and counts steps per parameter; these let a commit say the same per element range.
struct RangeStep {
  int64_t offset = 0;
  int64_t length = 0;
  // 0: not updated this step (master weights and moments unchanged, output = master rounded).
  // > 0: updated with the bias correction of step t (1-based) instead of the range's own.
  uint64_t t = 0;
};
// The shared-memory plane copies these through a chunk slot as they are.
static_assert(sizeof(RangeStep) == 24 && std::is_trivially_copyable_v<RangeStep>,
              "RangeStep is part of the shm and UCX commit layouts");

// The parts of `steps` (sorted by offset, not overlapping) inside [lo, hi), clipped to it: what
// one slice's commit carries. Entries that do not reach into [lo, hi), and empty ones, are left
// out. lo >= 0.
inline std::vector<RangeStep> ClipRangeSteps(absl::Span<const RangeStep> steps, int64_t lo,
                                             int64_t hi) {
  std::vector<RangeStep> clipped;
  for (const RangeStep& s : steps) {
    if (s.length <= 0) continue;
    const int64_t b = std::max(lo, s.offset);
    // min(hi, offset + length) without overflowing on an entry no one has checked yet.
    const int64_t e = s.offset > hi - s.length ? hi : s.offset + s.length;
    if (b < e) clipped.push_back(RangeStep{b, e - b, s.t});
  }
  return clipped;
}

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_SHARD_RANGE_STEPS_H_
