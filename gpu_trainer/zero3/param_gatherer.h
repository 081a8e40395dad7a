// ZeRO-3's parameter source (ARCHITECTURE.md section 3): a rank holds only its partition of the
// 16-bit weights, and each unit the model asks for (Gpt2UnitRange: the embeddings, a block, ln_f)
// is all-gathered from the ranks that own its pieces into a slot of a fixed window, upcast to fp32
// for the CPU backend's kernels, and the slot is reused once the model has released the unit.
//
// The window: one slot for the embeddings (held through a whole pass: the tied head uses wte at
// the end of forward and the start of backward), one for ln_f, and window_layers slots for the
// blocks. A gather thread moves the unit the model announces next (Prefetch) while the current
// one computes; with one block slot the next gather starts only once the current block is
// released, so nothing overlaps. With one rank the partition is the whole model in host memory
// and the window is what the compute device holds: parameter offload.
//
// Gathers are collective, so every rank must see the same sequence of Acquire, Release and
// Prefetch calls (the model makes them in a fixed order): which unit goes to which slot, and
// whether a cached unit is reused, depends only on that sequence, never on timing.
#ifndef OFFLOAD_GPU_TRAINER_ZERO3_PARAM_GATHERER_H_
#define OFFLOAD_GPU_TRAINER_ZERO3_PARAM_GATHERER_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "gpu_trainer/collectives/collectives.h"
#include "gpu_trainer/model/gpt2.h"
#include "gpu_trainer/zero3/weight_meter.h"
#include "model_spec/gpt2_config.h"
#include "model_spec/param_layout.h"

namespace offload {

struct ParamGathererOptions {
  Gpt2Config model;
  DType dtype = DType::kFp16;
  // The partition: rank r owns flat elements [r * P, (r + 1) * P), P = padded_length / W.
  int64_t padded_length = 0;
  int rank = 0;
  int world_size = 1;
  int window_layers = 2;  // block slots, >= 1
  // Called on the gather thread after each unit is gathered and upcast (for the trace).
  std::function<void(int unit, std::chrono::steady_clock::time_point begin,
                     std::chrono::steady_clock::time_point end)>
      on_gathered;
};

class ParamGatherer final : public Gpt2ParamSource {
 public:
  // collectives: used by the gather thread alone (a Fork of the trainer's, so that its gathers
  // never interleave with the gradient reduce-scatter). partition16 (P,): this rank's weights,
  // owned by the caller, who changes them only while no unit is held or in flight and then calls
  // Invalidate. meter counts the slots' 16-bit bytes (may be null).
  static absl::StatusOr<std::unique_ptr<ParamGatherer>> Create(const ParamGathererOptions& options,
                                                               Collectives* collectives,
                                                               const uint16_t* partition16,
                                                               WeightMeter* meter);
  ~ParamGatherer() override;

  absl::StatusOr<const float*> Acquire(int unit) override;
  void Release(int unit) override;
  void Prefetch(int unit) override;

  // Forgets every gathered unit: the partition changed. Waits for gathers in flight.
  void Invalidate();

  int64_t gathers() const;         // units gathered so far
  int64_t window_bytes16() const;  // the slots' 16-bit buffers
  int64_t window_bytes32() const;  // the slots' fp32 copies (the compute device's share)

 private:
  enum class SlotState { kEmpty, kInFlight, kReady };
  struct Slot {
    int unit = -1;  // the unit it holds or is gathering; -1 when empty
    SlotState state = SlotState::kEmpty;
    int holders = 0;
    // Gathered (or gathering) for a Prefetch whose Acquire has not come yet: not to be reused,
    // whether or not the gather has finished, so that slot choice never depends on timing.
    bool awaiting_acquire = false;
    uint64_t released_at = 0;  // sequence number of its last release: the oldest is reused first
    Weights16 w16;             // (capacity,) what the gather writes
    std::vector<float> w32;    // (capacity,) its upcast, what the model computes with
  };

  ParamGatherer(const ParamGathererOptions& options, Collectives* collectives,
                const uint16_t* partition16);
  void GatherLoop();
  absl::Status Gather(int unit, Slot& slot);
  // The slot that holds or gathers `unit`, or -1. Needs mu_.
  int FindSlot(int unit) const;
  // A slot `unit` may take: its own for the embeddings and ln_f; for a block, an empty block slot
  // or the one released longest ago; -1 when every block slot is held or in flight. Needs mu_.
  int FreeSlot(int unit) const;
  // Queues the gather of `unit` into `slot`. Needs mu_.
  void StartGather(int unit, int slot);

  const ParamGathererOptions options_;
  Collectives* const collectives_;
  const uint16_t* const partition16_;
  const int num_units_;
  const int64_t partition_length_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Slot> slots_;     // 0: embeddings, 1: ln_f, 2..: blocks
  std::deque<int> queue_;       // slots to gather into, in order
  int deferred_prefetch_ = -1;  // a prefetch that found no free slot: started on a release
  uint64_t releases_ = 0;
  int64_t gathers_ = 0;
  absl::Status broken_;  // the first gather failure: every later Acquire fails with it
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_ZERO3_PARAM_GATHERER_H_
