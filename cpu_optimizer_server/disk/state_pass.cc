#include "cpu_optimizer_server/disk/state_pass.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/thread_pool.h"

namespace offload {

namespace {

// A transfer's tag: the wave, the tensor, and whether it writes.
uint64_t Tag(int64_t wave, int tensor, bool write) {
  return (static_cast<uint64_t>(wave) * kStateTensors + tensor) << 1 | (write ? 1 : 0);
}

}  // namespace

StatePass::StatePass(DiskTier* tier, const StateFile* file, bool write_back)
    : tier_(tier),
      file_(file),
      write_back_(write_back),
      lock_(tier->pass_mu_),
      wave_(tier->wave_elements()),
      num_waves_((file->length() + wave_ - 1) / wave_),
      slots_(tier->slots()),
      slot_wave_(slots_, -1),
      slot_transfers_(slots_, 0) {}

StatePass::~StatePass() {
  while (tier_->io_->in_flight() > 0) {
    if (!ReapOne().ok() && tier_->io_->in_flight() == 0) break;
  }
}

int64_t StatePass::WaveElements(int64_t w) const {
  return std::min(wave_, file_->length() - w * wave_);
}

int64_t StatePass::WaveBytes(int64_t w, int tensor) const {
  // The tail wave reads and writes through to its block's end: the regions are padded to whole
  // blocks, so the padding it carries back is the padding it read.
  return StateRegionBytes(WaveElements(w), file_->ElementBytes(tensor));
}

absl::Status StatePass::Fail(absl::Status s) {
  if (error_.ok()) error_ = s;
  return error_;
}

// Waves are whole tiles (DiskTier::Open), so a wave of 2-byte moments starts on a block too.
static_assert(kTileElements * 2 % kStateBlockBytes == 0, "a bf16 wave must be whole blocks");

absl::Status StatePass::QueueWave(int64_t w, bool write) {
  const int s = static_cast<int>(w % slots_);
  float* slot = tier_->Slot(s);
  for (int t = 0; t < kStateTensors; ++t) {
    // A slot holds each tensor in a region of wave_ fp32 elements; bf16 moments fill the first
    // half of theirs (wave_ is whole tiles, so their file offsets stay block-aligned).
    const int64_t bytes = WaveBytes(w, t);
    const int64_t offset = file_->TensorOffset(t) + w * wave_ * file_->ElementBytes(t);
    absl::Status st = write ? tier_->io_->QueueWrite(file_->direct_fd(), slot + t * wave_, bytes,
                                                     offset, Tag(w, t, true))
                            : tier_->io_->QueueRead(file_->direct_fd(), slot + t * wave_, bytes,
                                                    offset, Tag(w, t, false));
    if (!st.ok()) return Fail(st);
    ++slot_transfers_[s];
  }
  return absl::OkStatus();
}

absl::Status StatePass::IssueReads() {
  bool queued = false;
  while (next_read_ < num_waves_) {
    const int s = static_cast<int>(next_read_ % slots_);
    if (slot_wave_[s] != -1) break;  // still held, or still being written back
    slot_wave_[s] = next_read_;
    OFFLOAD_RETURN_IF_ERROR(QueueWave(next_read_, /*write=*/false));
    queued = true;
    ++next_read_;
  }
  if (queued) {
    absl::Status st = tier_->io_->Submit();
    if (!st.ok()) return Fail(st);
  }
  return absl::OkStatus();
}

absl::Status StatePass::ReapOne() {
  const auto begin = std::chrono::steady_clock::now();
  absl::StatusOr<IoRing::Completion> c = tier_->io_->Wait();
  const auto nanos =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - begin)
          .count();
  stats_.wait_seconds += nanos * 1e-9;
  tier_->counters_.wait_nanos.fetch_add(nanos, std::memory_order_relaxed);
  if (!c.ok()) return Fail(c.status());
  const bool write = (c->tag & 1) != 0;
  const int64_t wave = static_cast<int64_t>(c->tag >> 1) / kStateTensors;
  const int tensor = static_cast<int>((c->tag >> 1) % kStateTensors);
  const int s = static_cast<int>(wave % slots_);
  --slot_transfers_[s];
  if (c->result != c->wanted) {
    const int64_t lo = wave * wave_;
    const std::string what =
        c->result < 0 ? std::string(std::strerror(static_cast<int>(-c->result)))
                      : absl::StrCat("moved ", c->result, " of ", c->wanted, " bytes",
                                     write ? "" : " (the file is shorter than the state)");
    const std::string message =
        absl::StrCat(write ? "writing " : "reading ", StateTensorName(tensor), " elements [", lo,
                     ", ", lo + WaveElements(wave), ") of ", file_->path(), ": ", what);
    return Fail(c->result == -ENOSPC ? absl::ResourceExhaustedError(message)
                                     : absl::DataLossError(message));
  }
  if (write) {
    stats_.bytes_written += c->result;
    tier_->counters_.bytes_written.fetch_add(c->result, std::memory_order_relaxed);
    if (slot_transfers_[s] == 0) slot_wave_[s] = -1;
  } else {
    stats_.bytes_read += c->result;
    tier_->counters_.bytes_read.fetch_add(c->result, std::memory_order_relaxed);
  }
  return absl::OkStatus();
}

absl::StatusOr<StateWave> StatePass::Acquire(int64_t w) {
  if (!error_.ok()) return error_;
  if (w < 0 || w >= num_waves_) {
    return Fail(absl::OutOfRangeError(absl::StrCat("wave ", w, " of ", num_waves_)));
  }
  const int s = static_cast<int>(w % slots_);
  for (;;) {
    absl::Status st = IssueReads();
    if (!st.ok()) return st;
    if (slot_wave_[s] == w && slot_transfers_[s] == 0) break;
    st = ReapOne();
    if (!st.ok()) return st;
  }
  float* slot = tier_->Slot(s);
  StateWave wave;
  wave.lo = w * wave_;
  wave.hi = wave.lo + WaveElements(w);
  wave.master = slot;
  wave.exp_avg = slot + wave_;
  wave.exp_avg_sq = slot + 2 * wave_;
  return wave;
}

absl::Status StatePass::Release(int64_t w) {
  if (!error_.ok()) return error_;
  const int s = static_cast<int>(w % slots_);
  if (slot_wave_[s] != w || slot_transfers_[s] != 0) {
    return Fail(absl::FailedPreconditionError(absl::StrCat("wave ", w, " is not acquired")));
  }
  if (!write_back_) {
    slot_wave_[s] = -1;
    return IssueReads();
  }
  OFFLOAD_RETURN_IF_ERROR(QueueWave(w, /*write=*/true));
  absl::Status st = tier_->io_->Submit();
  if (!st.ok()) return Fail(st);
  return IssueReads();
}

absl::Status StatePass::Finish() {
  while (tier_->io_->in_flight() > 0) {
    absl::Status st = ReapOne();
    if (!st.ok() && tier_->io_->in_flight() == 0) break;
  }
  return error_;
}

}  // namespace offload
