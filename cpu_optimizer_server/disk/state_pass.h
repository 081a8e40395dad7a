// One pass over a range's state file, wave by wave through the disk tier's ring: the caller
// Acquires wave w (its master, exp_avg and exp_avg_sq in a slot), updates it in place and
// Releases it; the pass writes it back and reuses the slot to read a later wave ahead. Reads run
// up to slots - 2 waves ahead of the wave being updated, and write-backs trail it, so the disk
// never waits on the cores and the cores wait on the disk only when it is the slower.
//
// All calls come from one thread. The pass holds the tier (one pass at a time) until it ends.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_DISK_STATE_PASS_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_DISK_STATE_PASS_H_

#include <cstdint>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cpu_optimizer_server/disk/disk_tier.h"

namespace offload {

// A wave's state in memory: element e of the range (lo <= e < hi) is master[e - lo], and so on.
// The moments are in the job's state_dtype, in a slot as in memory.
struct StateWave {
  int64_t lo = 0, hi = 0;
  float* master = nullptr;     // (hi - lo,)
  void* exp_avg = nullptr;     // (hi - lo,)
  void* exp_avg_sq = nullptr;  // (hi - lo,)
};

// Per-pass figures, also added to the tier's counters.
struct StatePassStats {
  int64_t bytes_read = 0;
  int64_t bytes_written = 0;
  double wait_seconds = 0;  // the caller's thread blocked on the disk
};

class StatePass {
 public:
  // Waves of tier->wave_elements() over elements [0, file->length()). With write_back false the
  // pass only reads (a replay, which converts the weights and changes nothing).
  StatePass(DiskTier* tier, const StateFile* file, bool write_back);
  ~StatePass();  // waits for every transfer, so the slots can be reused
  StatePass(const StatePass&) = delete;
  StatePass& operator=(const StatePass&) = delete;

  int64_t num_waves() const { return num_waves_; }
  // Waits until wave w is in memory. Waves are acquired in order, each once, after the one
  // before has been released or while it is being updated (at most two at once).
  absl::StatusOr<StateWave> Acquire(int64_t w);
  // Wave w is done: queue its write-back (or, without write_back, free its slot).
  absl::Status Release(int64_t w);
  // Waits for the last write-backs. The first error of the pass, naming the file, the tensor
  // and the elements; after an error mid-pass the file holds some waves updated and some not.
  absl::Status Finish();
  const StatePassStats& stats() const { return stats_; }

 private:
  int64_t WaveElements(int64_t w) const;
  int64_t WaveBytes(int64_t w, int tensor) const;  // rounded up to whole blocks
  // Queues wave w's three transfers between its slot and the file (not yet submitted).
  absl::Status QueueWave(int64_t w, bool write);
  absl::Status IssueReads();
  absl::Status ReapOne();  // blocks for one completion
  absl::Status Fail(absl::Status s);

  DiskTier* const tier_;
  const StateFile* const file_;
  const bool write_back_;
  std::lock_guard<std::mutex> lock_;
  const int64_t wave_;
  const int64_t num_waves_;
  const int slots_;
  std::vector<int64_t> slot_wave_;   // the wave a slot holds, -1 when free
  std::vector<int> slot_transfers_;  // transfers in flight into or out of a slot
  int64_t next_read_ = 0;            // the next wave whose reads are not yet queued
  absl::Status error_;
  StatePassStats stats_;
};

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_DISK_STATE_PASS_H_
