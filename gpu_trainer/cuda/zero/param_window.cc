#include "gpu_trainer/cuda/zero/param_window.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "model_spec/gpt2_config.h"
#include "model_spec/param_layout.h"

namespace offload {

int ParamWindowPlan::fills() const {
  return static_cast<int>(
      std::count_if(uses.begin(), uses.end(), [](const WindowUse& u) { return u.fill; }));
}

ParamWindowPlan PlanParamWindow(const Gpt2Config& config, int window_layers) {
  const int L = config.num_layers;
  const int64_t align = kWindowPhaseElements;
  ParamWindowPlan plan;
  plan.window_layers = std::min(std::max(window_layers, 1), L);
  const int slots = 2 + plan.window_layers;

  // Per block slot: the unit it holds and the use that holds it last, -1 while empty.
  std::vector<int> resident(slots, -1), last_use(slots, -1);
  auto use_fixed = [&](int unit, int slot) {
    plan.uses.push_back(WindowUse{unit, slot, /*fill=*/true, /*previous=*/-1, /*backward=*/false});
    return static_cast<int>(plan.uses.size()) - 1;
  };
  auto use_block = [&](int l, bool backward) {
    const int unit = l + 1;
    const int i = static_cast<int>(plan.uses.size());
    // Still resident: no copy. Else the first empty slot, else the one released longest ago,
    // whose fill can be queued earliest.
    int slot = -1;
    for (int s = 2; s < slots && slot < 0; ++s) {
      if (resident[s] == unit) slot = s;
    }
    const bool fill = slot < 0;
    if (fill) {
      for (int s = 2; s < slots; ++s) {
        if (slot < 0 || last_use[s] < last_use[slot]) slot = s;
      }
    }
    plan.uses.push_back(WindowUse{unit, slot, fill, last_use[slot], backward});
    resident[slot] = unit;
    last_use[slot] = i;
    return i;
  };

  plan.forward_use_of_block.resize(L);
  plan.backward_use_of_block.resize(L);
  plan.embeddings_use = use_fixed(0, kWindowEmbeddingSlot);
  for (int l = 0; l < L; ++l) plan.forward_use_of_block[l] = use_block(l, /*backward=*/false);
  plan.lnf_use = use_fixed(L + 1, kWindowLnfSlot);
  for (int l = L - 1; l >= 0; --l) plan.backward_use_of_block[l] = use_block(l, /*backward=*/true);

  plan.fill_after_release.assign(plan.uses.size(), -1);
  for (int j = 0; j < static_cast<int>(plan.uses.size()); ++j) {
    const WindowUse& u = plan.uses[j];
    if (!u.fill) continue;
    if (u.previous < 0) {
      plan.initial_fills.push_back(j);
    } else {
      plan.fill_after_release[u.previous] = j;
    }
  }

  // A slot holds the largest unit it takes with that unit's phase in front.
  auto phase = [&](int unit) { return Gpt2UnitRange(config, unit).begin % kWindowPhaseElements; };
  plan.slot_elements.assign(slots, 0);
  for (const WindowUse& u : plan.uses) {
    plan.slot_elements[u.slot] =
        std::max(plan.slot_elements[u.slot], phase(u.unit) + Gpt2UnitRange(config, u.unit).size());
  }
  plan.slot_offset.resize(slots);
  int64_t end = 0;
  for (int s = 0; s < slots; ++s) {
    plan.slot_offset[s] = end;
    end = (end + plan.slot_elements[s] + align - 1) / align * align;
  }
  plan.total_elements = end;
  for (WindowUse& u : plan.uses) u.offset = plan.slot_offset[u.slot] + phase(u.unit);
  return plan;
}

}  // namespace offload
