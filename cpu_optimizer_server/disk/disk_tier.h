// A server's disk tier (ARCHITECTURE.md section 2, "Optimizer state on disk"): a directory of its
// own under --state_dir holding the jobs' state files, and the ring of aligned host buffers and
// the io_uring every streaming pass goes through. Passes run one at a time: the disk, not the
// cores, bounds them, and one ring then bounds the memory (--state_memory_mib) whatever the
// number of jobs and ranges.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_DISK_DISK_TIER_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_DISK_DISK_TIER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/host_buffer.h"
#include "cpu_optimizer_server/disk/io_ring.h"
#include "cpu_optimizer_server/disk/state_file.h"

namespace offload {

struct DiskTierOptions {
  std::string state_dir;
  // The ring: slots of one wave each (wave_elements of master, exp_avg and exp_avg_sq), as many
  // as fit, at least kMinStateSlots.
  int64_t memory_bytes = int64_t{192} << 20;
  int64_t wave_elements = int64_t{2} << 20;
};

// One wave being updated, one being written back, one being read ahead.
inline constexpr int kMinStateSlots = 3;

// What the tier has moved since it opened, over all passes (bench_adam reads the wait; the
// metrics take each pass's own StatePassStats).
struct DiskTierCounters {
  std::atomic<int64_t> bytes_read{0};
  std::atomic<int64_t> bytes_written{0};
  std::atomic<int64_t> wait_nanos{0};  // a pass's thread blocked on the disk
};

class DiskTier {
 public:
  // Makes state_dir (and its parents) and a directory of this server's own in it, holding a
  // lock for as long as the server lives; removes the directories of servers that died without
  // removing theirs (their lock is free). Several servers may share one state_dir and start
  // together: the sweep and the claim run under a lock on state_dir/.lock.
  static absl::StatusOr<std::unique_ptr<DiskTier>> Open(const DiskTierOptions& options);
  ~DiskTier();  // removes this server's directory

  const std::string& dir() const { return dir_; }
  int64_t wave_elements() const { return wave_elements_; }
  int slots() const { return slots_; }
  int64_t ring_bytes() const { return ring_.size(); }
  // Free bytes of the state directory's file system (statvfs), -1 if unknown.
  int64_t FreeBytes() const;

  // A state file for range `range_index` of `job_id`, preallocated (see StateFile::Create), its
  // moments in `moments`. RESOURCE_EXHAUSTED naming the file and both sizes when the disk has no
  // room.
  absl::StatusOr<std::unique_ptr<StateFile>> CreateStateFile(const std::string& job_id,
                                                             int range_index, int64_t length,
                                                             bool staging,
                                                             DType moments = DType::kFp32);

  DiskTierCounters& counters() { return counters_; }

 private:
  friend class StatePass;
  DiskTier(std::string dir, int lock_fd, HostBuffer ring, int slots, int64_t wave_elements,
           std::unique_ptr<IoRing> io)
      : dir_(std::move(dir)),
        lock_fd_(lock_fd),
        ring_(std::move(ring)),
        slots_(slots),
        wave_elements_(wave_elements),
        io_(std::move(io)) {}
  // Slot s: (3, wave_elements) fp32, one tensor after the other.
  float* Slot(int s) const {
    return static_cast<float*>(ring_.data()) + int64_t{s} * kStateTensors * wave_elements_;
  }

  const std::string dir_;
  const int lock_fd_;
  const HostBuffer ring_;
  const int slots_;
  const int64_t wave_elements_;
  std::mutex pass_mu_;  // held by the one StatePass running; guards io_ and the slots
  const std::unique_ptr<IoRing> io_;
  std::atomic<int64_t> next_file_{0};
  DiskTierCounters counters_;
};

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_DISK_DISK_TIER_H_
