#include "gpu_trainer/zero3/param_gatherer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model_spec/gradient_buckets.h"

namespace offload {

absl::StatusOr<std::unique_ptr<ParamGatherer>> ParamGatherer::Create(
    const ParamGathererOptions& options, Collectives* collectives, const uint16_t* partition16,
    WeightMeter* meter) {
  const int W = options.world_size;
  if (collectives == nullptr || partition16 == nullptr) {
    return absl::InvalidArgumentError("ParamGatherer: collectives and partition16 are required");
  }
  if (W < 1 || options.rank < 0 || options.rank >= W || collectives->world_size() != W ||
      collectives->rank() != options.rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ParamGatherer: rank ", options.rank, " of ", W, " does not match the collectives' rank ",
        collectives->rank(), " of ", collectives->world_size()));
  }
  const int64_t num_params = Gpt2NumParams(options.model);
  if (options.padded_length < num_params || options.padded_length % W != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ParamGatherer: padded_length ", options.padded_length, " must cover the model's ",
        num_params, " parameters and split over ", W, " ranks"));
  }
  if (options.window_layers < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the parameter window must hold at least 1 layer, got ", options.window_layers));
  }
  if (options.dtype != DType::kFp16 && options.dtype != DType::kBf16) {
    return absl::InvalidArgumentError("ParamGatherer: the weights must be fp16 or bf16");
  }
  std::unique_ptr<ParamGatherer> g(new ParamGatherer(options, collectives, partition16));
  const Gpt2Config& c = options.model;
  const int blocks = std::min(options.window_layers, c.num_layers);
  g->slots_.resize(2 + blocks);
  for (int s = 0; s < static_cast<int>(g->slots_.size()); ++s) {
    const int64_t capacity = Gpt2UnitRange(c, s == 0   ? 0
                                              : s == 1 ? c.num_layers + 1
                                                       : 1)
                                 .size();  // (capacity,)
    g->slots_[s].w16 = Weights16(capacity, meter);
    g->slots_[s].w32.assign(capacity, 0.0f);
  }
  g->thread_ = std::thread([p = g.get()] { p->GatherLoop(); });
  return g;
}

ParamGatherer::ParamGatherer(const ParamGathererOptions& options, Collectives* collectives,
                             const uint16_t* partition16)
    : options_(options),
      collectives_(collectives),
      partition16_(partition16),
      num_units_(Gpt2NumUnits(options.model)),
      partition_length_(options.padded_length / options.world_size) {}

// The gathers still queued run first: they are collectives the other ranks make too, and dropping
// them would leave the ranks out of step. With a stalled peer that takes up to the collective
// timeout.
ParamGatherer::~ParamGatherer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

int ParamGatherer::FindSlot(int unit) const {
  for (int s = 0; s < static_cast<int>(slots_.size()); ++s) {
    if (slots_[s].unit == unit) return s;
  }
  return -1;
}

int ParamGatherer::FreeSlot(int unit) const {
  auto usable = [&](int s) {
    return slots_[s].holders == 0 && !slots_[s].awaiting_acquire &&
           slots_[s].state != SlotState::kInFlight;
  };
  if (unit == 0) return usable(0) ? 0 : -1;
  if (unit == num_units_ - 1) return usable(1) ? 1 : -1;
  int best = -1;
  for (int s = 2; s < static_cast<int>(slots_.size()); ++s) {
    if (!usable(s)) continue;
    if (slots_[s].state == SlotState::kEmpty) return s;
    if (best < 0 || slots_[s].released_at < slots_[best].released_at) best = s;
  }
  return best;
}

void ParamGatherer::StartGather(int unit, int slot) {
  slots_[slot].unit = unit;
  slots_[slot].state = SlotState::kInFlight;
  queue_.push_back(slot);
  cv_.notify_all();
}

absl::StatusOr<const float*> ParamGatherer::Acquire(int unit) {
  if (unit < 0 || unit >= num_units_) {
    return absl::InvalidArgumentError(absl::StrCat("ParamGatherer: no unit ", unit));
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (!broken_.ok()) return broken_;
  if (deferred_prefetch_ == unit) deferred_prefetch_ = -1;
  int s = FindSlot(unit);
  if (s < 0) {
    s = FreeSlot(unit);
    if (s < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("ParamGatherer: unit ", unit, " has no free slot: all ", slots_.size() - 2,
                       " block slots of the parameter window are held"));
    }
    StartGather(unit, s);
  }
  Slot& slot = slots_[s];
  slot.holders++;
  slot.awaiting_acquire = false;
  cv_.wait(lock, [&] { return slot.state != SlotState::kInFlight || !broken_.ok(); });
  if (!broken_.ok()) {
    slot.holders--;
    return broken_;
  }
  return static_cast<const float*>(slot.w32.data());
}

void ParamGatherer::Release(int unit) {
  std::lock_guard<std::mutex> lock(mu_);
  const int s = FindSlot(unit);
  if (s < 0 || slots_[s].holders == 0) return;
  if (--slots_[s].holders == 0) slots_[s].released_at = ++releases_;
  if (deferred_prefetch_ >= 0 && broken_.ok()) {
    const int free = FreeSlot(deferred_prefetch_);
    if (free >= 0) {
      StartGather(deferred_prefetch_, free);
      slots_[free].awaiting_acquire = true;
      deferred_prefetch_ = -1;
    }
  }
}

void ParamGatherer::Prefetch(int unit) {
  if (unit < 0 || unit >= num_units_) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (!broken_.ok() || FindSlot(unit) >= 0) return;
  const int free = FreeSlot(unit);
  if (free >= 0) {
    StartGather(unit, free);
    slots_[free].awaiting_acquire = true;
  } else {
    deferred_prefetch_ = unit;
  }
}

void ParamGatherer::Invalidate() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] {
    return queue_.empty() && std::none_of(slots_.begin(), slots_.end(), [](const Slot& s) {
             return s.state == SlotState::kInFlight;
           });
  });
  for (Slot& slot : slots_) {
    if (slot.holders > 0) continue;  // a caller error; that unit stays as it is
    slot.unit = -1;
    slot.state = SlotState::kEmpty;
    slot.awaiting_acquire = false;
  }
  deferred_prefetch_ = -1;
}

void ParamGatherer::GatherLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, nothing left
    const int s = queue_.front();
    queue_.pop_front();
    Slot& slot = slots_[s];
    const int unit = slot.unit;
    absl::Status status = broken_;
    if (status.ok()) {
      lock.unlock();
      const auto begin = std::chrono::steady_clock::now();
      status = Gather(unit, slot);
      if (status.ok() && options_.on_gathered) {
        options_.on_gathered(unit, begin, std::chrono::steady_clock::now());
      }
      lock.lock();
    }
    if (status.ok()) {
      gathers_++;
      slot.state = SlotState::kReady;
    } else {
      if (broken_.ok()) broken_ = status;
      slot.unit = -1;
      slot.state = SlotState::kEmpty;
      slot.awaiting_acquire = false;
    }
    cv_.notify_all();
  }
}

absl::Status ParamGatherer::Gather(int unit, Slot& slot) {
  const ParamRange range = Gpt2UnitRange(options_.model, unit);
  const int W = options_.world_size;
  const int64_t P = partition_length_;
  // counts (W,): the piece of [begin, end) each rank owns, in rank order, which is buffer order.
  const std::vector<int64_t> counts = RankCounts(range.begin, range.end, P, W);
  const int64_t mine_from = std::max(range.begin, int64_t{options_.rank} * P);
  const uint16_t* mine = counts[options_.rank] > 0
                             ? partition16_ + (mine_from - int64_t{options_.rank} * P)
                             : partition16_;
  uint16_t* w16 = slot.w16.data();  // (range.size(),)
  OFFLOAD_RETURN_IF_ERROR(collectives_->AllGatherV16(mine, w16, counts));
  float* w32 = slot.w32.data();  // (range.size(),)
  const int64_t n = range.size();
  if (options_.dtype == DType::kFp16) {
    for (int64_t i = 0; i < n; ++i) w32[i] = Fp16ToFloat(w16[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) w32[i] = Bf16ToFloat(w16[i]);
  }
  return absl::OkStatus();
}

int64_t ParamGatherer::gathers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return gathers_;
}

int64_t ParamGatherer::window_bytes16() const {
  int64_t bytes = 0;
  for (const Slot& s : slots_) bytes += s.w16.bytes();
  return bytes;
}

int64_t ParamGatherer::window_bytes32() const {
  int64_t bytes = 0;
  for (const Slot& s : slots_) bytes += static_cast<int64_t>(s.w32.size() * sizeof(float));
  return bytes;
}

}  // namespace offload
