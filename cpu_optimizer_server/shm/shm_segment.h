// The shared-memory segment of one attachment of the shm data plane (shm_transport.h): its
// layout, the commands and replies that travel through it, and the futex waits on its control
// words. The shard creates the segment; the trainer opens it by name and must not trust it more
// than the shard trusts the trainer: everything read from it is validated before use.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_SHM_SHM_SEGMENT_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_SHM_SHM_SEGMENT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cpu_optimizer_server/shard/param_groups.h"

namespace offload {

inline constexpr char kShmMagic[4] = {'O', 'F', 'S', 'M'};
// 2: a COMMIT carries per-group learning rates, so ShmCommand grew and the header with it.
// 3: the learning rates are doubles (torch's Python floats), so it grew again.
// 4: a COMMIT may carry range steps in a chunk slot (its `slot` and `n`).
// 5: the UPDATE command (an update during backward) and its `t`, so ShmCommand grew; the reply
//    counts the elements updated early that stood and those rolled back.
inline constexpr uint32_t kShmVersion = 5;
// The header's ten pages (its command ring is most of them); the areas follow it.
inline constexpr uint64_t kShmHeaderBytes = 40960;
inline constexpr int kShmSecretBytes = 32;
inline constexpr uint32_t kShmRingSize = 64;  // commands in flight
inline constexpr int kShmMaxChunkSlots = 64;
inline constexpr int kShmMessageBytes = 1024;  // status messages longer than this are cut

enum class ShmCommandKind : uint32_t {
  kOpen = 1,
  kGrad = 2,
  kCommit = 3,
  kAbandon = 4,
  // Adam now on part of the range, before the commit (StepSession::UpdateEarly). No reply: the
  // shard may decline (nothing to tell), and an error fails the step as a bad GRAD does.
  kUpdate = 5,
};

// A GRAD's `slot` when its gradients were written in place into the gradient area.
inline constexpr uint32_t kShmInPlace = 0xffffffffu;

// One command of the ring, written by the trainer and read once by the shard.
struct ShmCommand {
  uint32_t kind;  // ShmCommandKind
  // GRAD: the DType of the data, whether it adds to earlier micro-batches, and where it is:
  // kShmInPlace (the gradient area at its range-relative position) or a chunk slot.
  uint32_t dtype;
  uint32_t accumulate;
  // COMMIT: the chunk slot that holds its range steps (StepCommit.range_steps), n RangeStep
  // records (range_steps.h) from the slot's start; n == 0: none, and no slot is used. They travel
  // in a slot, not in the command, because a commit may carry one per parameter tensor.
  uint32_t slot;
  int64_t offset;  // GRAD, UPDATE: flat element offset
  int64_t n;       // GRAD, UPDATE: elements; COMMIT: range steps
  uint64_t step;   // OPEN, COMMIT, UPDATE
  double lr;       // COMMIT, UPDATE
  float grad_multiplier;
  uint32_t skip;
  // COMMIT, UPDATE: group_lr[0, group_count) are the lrs of the job's parameter groups; none (0)
  // means `lr` for every group. The shard refuses a count above kMaxParamGroups.
  uint32_t group_count;
  uint32_t reserved;  // keeps t and group_lr 8-byte aligned, spelled out
  // UPDATE: the bias-correction step of its elements; 0 means the range's next step.
  uint64_t t;
  double group_lr[kMaxParamGroups];
};
static_assert(sizeof(ShmCommand) == 72 + 8 * kMaxParamGroups &&
                  offsetof(ShmCommand, group_lr) % 8 == 0,
              "ShmCommand is part of the segment layout");

// The shard's answer to the last OPEN or COMMIT, or the first error of a step.
struct ShmReply {
  int32_t code;  // absl::StatusCode
  uint32_t message_bytes;
  uint64_t step;
  uint64_t adam_step;
  uint64_t skipped_steps;
  uint32_t applied;
  uint32_t replayed;
  uint32_t skipped;
  uint32_t reserved;
  uint64_t early_updated;  // StepResult.early_updated, early_rolled_back
  uint64_t early_rolled_back;
  char message[kShmMessageBytes];
};

// The first page of a segment. The fixed part is written by the shard before it offers the
// segment and never changes; the control words after it are shared.
struct ShmHeader {
  char magic[4];
  uint32_t version;
  uint64_t segment_bytes;
  int64_t range_offset;  // flat element of the range's first element
  int64_t range_length;  // elements (0 for a probe)
  uint32_t param_dtype;  // DType of the parameters sent back
  uint32_t chunk_slots;
  int64_t chunk_slot_bytes;
  uint64_t grad_area_offset;   // (range_length,) 16-bit gradients
  uint64_t param_area_offset;  // (range_length,) 16-bit parameters
  uint64_t slots_offset;       // (chunk_slots, chunk_slot_bytes)
  uint8_t secret[kShmSecretBytes];

  // Commands pushed by the trainer: command k (from 0) lives in ring[k % kShmRingSize]. The
  // shard futex-waits on cmd_head.
  alignas(64) std::atomic<uint32_t> cmd_head;
  // Commands the shard has finished with; the trainer reuses a ring entry only below it.
  alignas(64) std::atomic<uint32_t> cmd_tail;
  // Bumped by the shard after every change the trainer may wait for (a reply, parameters
  // published, a slot or ring entry freed); the trainer futex-waits on it.
  alignas(64) std::atomic<uint32_t> shard_event;
  // The command number (cmd_head after it was pushed) the reply answers.
  std::atomic<uint32_t> reply_seq;
  // Chunk slots the shard has copied out; slot use k (from 0) is slot k % chunk_slots.
  std::atomic<uint32_t> slots_released;
  // Elements of the range written into the parameter area by the current commit. The trainer
  // zeroes it before pushing a COMMIT, the shard advances it wave by wave.
  std::atomic<int64_t> params_published;

  alignas(64) ShmCommand ring[kShmRingSize];
  alignas(64) ShmReply reply;
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free");
static_assert(std::atomic<int64_t>::is_always_lock_free, "shared counters must be lock-free");
static_assert(sizeof(std::atomic<uint32_t>) == 4, "a futex word is 32 bits");
static_assert(sizeof(ShmHeader) <= kShmHeaderBytes, "the header fits its pages");

// Where the parts of a segment go.
struct ShmLayout {
  int64_t range_offset = 0;
  int64_t range_length = 0;
  uint32_t param_dtype = 0;
  int chunk_slots = 0;
  int64_t chunk_slot_bytes = 0;
};

// A mapped segment; unmaps on destruction (the name is unlinked separately, see Unlink).
class ShmSegment {
 public:
  // Creates a segment with a fresh random name (/offload-<pid>-<random>), sizes, maps and
  // commits it (posix_fallocate, so a full /dev/shm is an error now rather than SIGBUS later),
  // and fills in the header with a random secret.
  static absl::StatusOr<ShmSegment> Create(const ShmLayout& layout);
  // Maps the segment `name` and validates its header.
  static absl::StatusOr<ShmSegment> Open(const std::string& name);
  // Checks that `file_bytes` of mapped memory at `base` hold a valid segment.
  static absl::Status Validate(const void* base, uint64_t file_bytes);

  ShmSegment() = default;
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ~ShmSegment();

  // Removes the name; the memory stays until the last mapping goes. Idempotent.
  void Unlink();

  const std::string& name() const { return name_; }
  uint64_t size() const { return size_; }
  ShmHeader* header() const { return static_cast<ShmHeader*>(base_); }
  char* grad_area() const { return At(header()->grad_area_offset); }
  char* param_area() const { return At(header()->param_area_offset); }
  char* slot(int k) const {
    return At(header()->slots_offset + static_cast<uint64_t>(k) * header()->chunk_slot_bytes);
  }

 private:
  char* At(uint64_t offset) const { return static_cast<char*>(base_) + offset; }
  void Reset();

  std::string name_;
  void* base_ = nullptr;
  uint64_t size_ = 0;
  bool linked_ = false;  // this object created the name and has not unlinked it yet
};

// What both halves of the plane agree on (the shard sizes the segment by it).
struct ShmOptions {
  int64_t chunk_slot_bytes = int64_t{4} << 20;
  int chunk_slots = 4;
  // How often a waiting side checks that its peer is still there.
  absl::Duration poll_interval = absl::Milliseconds(100);
  // How long the shard waits for a trainer to prove an offer before it ends the Attach stream: a
  // caller that never answers must not hold a handler thread and a segment.
  absl::Duration setup_timeout = absl::Seconds(30);
};

// Waits until *word != expected, `timeout` passes or a spurious wake-up: spins briefly, then
// FUTEX_WAIT (shared, so it works across processes). Callers re-check their condition.
void ShmWait(std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout);
// Wakes every waiter on *word.
void ShmWake(std::atomic<uint32_t>* word);

// Constant-time comparison of two secrets.
bool ShmSecretEquals(const void* a, const void* b, size_t n);

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_SHM_SHM_SEGMENT_H_
