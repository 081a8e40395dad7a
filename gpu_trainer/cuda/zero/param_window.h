// ZeRO-3 on the CUDA backend (ARCHITECTURE.md section 10), as host arithmetic the CPU tests check:
// which device slot of the parameter window holds each unit at each use in one step, and when each
// slot is filled. The device holds the embeddings (slot 0, from the encoder to the end of
// backward), ln_f (slot 1, from the end of forward to its backward) and window_layers block slots;
// a block is filled into the block slot used longest ago, unless it is still resident (the last
// blocks of forward are the first of backward).
//
// A use's fill waits for the release of the slot's previous use, and is queued as soon as that
// release is: after the compute stream records it, the host queues the fill that follows
// (fill_after_release), so a fill runs ahead by up to window_layers - 1 blocks while the current
// ones compute, and waiting on an event never comes before the event is recorded.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_ZERO_PARAM_WINDOW_H_
#define OFFLOAD_GPU_TRAINER_CUDA_ZERO_PARAM_WINDOW_H_

#include <cstdint>
#include <vector>

#include "model_spec/gpt2_config.h"

namespace offload {

inline constexpr int kWindowEmbeddingSlot = 0;
inline constexpr int kWindowLnfSlot = 1;
// 256 bytes of 16-bit elements: the largest alignment cuBLASLt's plans look at.
inline constexpr int64_t kWindowPhaseElements = 128;

struct WindowUse {
  int unit = 0;       // Gpt2UnitRange's unit
  int slot = 0;       // window slot
  bool fill = false;  // the unit is copied into the slot for this use (else still resident)
  int previous = -1;  // the use whose release the fill waits for (-1: the slot was empty)
  bool backward = false;
  // Elements from the window's start to the unit's first: the slot's offset plus the unit's
  // address phase (its flat begin % kWindowPhaseElements), so every tensor has the address phase
  // it has in the flat buffer and cuBLASLt picks the same algorithms.
  int64_t offset = 0;
};

struct ParamWindowPlan {
  int window_layers = 0;  // block slots, min(requested, L)
  // One step's uses in order. Forward: embeddings, blocks 0..L-1, ln_f. Backward: blocks L-1..0.
  // The embeddings' use lasts to the end of backward, ln_f's to its backward (the start of
  // backward), so neither has a second use.
  std::vector<WindowUse> uses;
  // (uses,) the use whose fill the host queues once use i is released, or -1. The fills of each
  // slot's first use are queued at the start of the step (initial_fills).
  std::vector<int> fill_after_release;
  std::vector<int> initial_fills;
  std::vector<int> forward_use_of_block;   // (L,)
  std::vector<int> backward_use_of_block;  // (L,)
  int embeddings_use = 0, lnf_use = 0;
  std::vector<int64_t> slot_offset;    // (2 + window_layers,) elements from the window's start
  std::vector<int64_t> slot_elements;  // (2 + window_layers,) the largest unit with its phase
  int64_t total_elements = 0;
  int fills() const;  // units copied in one step
};

// window_layers >= 1 (clamped to L). Slot offsets are multiples of kWindowPhaseElements.
ParamWindowPlan PlanParamWindow(const Gpt2Config& config, int window_layers);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_ZERO_PARAM_WINDOW_H_
