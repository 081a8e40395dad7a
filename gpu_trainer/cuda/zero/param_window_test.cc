// The ZeRO-3 parameter window's schedule, simulated: every use finds its unit in its slot, every
// fill waits only for a release that comes before the use it serves, every fill is queued once,
// and resident blocks are not copied again.
#include "gpu_trainer/cuda/zero/param_window.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "model_spec/gpt2_config.h"
#include "model_spec/param_layout.h"
#include "model_spec/param_layout_test_util.h"

namespace offload {
namespace {

TEST(ParamWindow, HandCheckedThreeLayersTwoSlots) {
  const ParamWindowPlan plan = PlanParamWindow(TinyGpt2Config(3), 2);
  EXPECT_EQ(plan.window_layers, 2);
  // Forward: embeddings, h.0 h.1 into the two block slots, h.2 over h.0, ln_f. Backward: h.2 and
  // h.1 still resident, h.0 over h.2's slot, released first.
  struct Expected {
    int unit, slot;
    bool fill;
    int previous;
    bool backward;
  };
  const Expected expected[] = {{0, 0, true, -1, false}, {1, 2, true, -1, false},
                               {2, 3, true, -1, false}, {3, 2, true, 1, false},
                               {4, 1, true, -1, false}, {3, 2, false, 3, true},
                               {2, 3, false, 2, true},  {1, 2, true, 5, true}};
  ASSERT_EQ(plan.uses.size(), 8u);
  for (int i = 0; i < 8; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(plan.uses[i].unit, expected[i].unit);
    EXPECT_EQ(plan.uses[i].slot, expected[i].slot);
    EXPECT_EQ(plan.uses[i].fill, expected[i].fill);
    EXPECT_EQ(plan.uses[i].previous, expected[i].previous);
    EXPECT_EQ(plan.uses[i].backward, expected[i].backward);
  }
  EXPECT_EQ(plan.fills(), 6);
  EXPECT_EQ(plan.initial_fills, (std::vector<int>{0, 1, 2, 4}));
  EXPECT_EQ(plan.fill_after_release, (std::vector<int>{-1, 3, -1, -1, -1, 7, -1, -1}));
  EXPECT_EQ(plan.embeddings_use, 0);
  EXPECT_EQ(plan.lnf_use, 4);
  EXPECT_EQ(plan.forward_use_of_block, (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(plan.backward_use_of_block, (std::vector<int>{7, 6, 5}));
  // Each unit at its flat address phase (begin % 128) in its slot: the embeddings 0, h.0 64,
  // h.1 40, h.2 16, ln_f 120. Slot 2 takes h.0 and h.2 (64 + 872 = 936), slot 3 h.1 (912):
  // 192 -> 256 | + 136 = 392 -> 512 | + 936 = 1448 -> 1536 | + 912 = 2448 -> 2560.
  EXPECT_EQ(plan.slot_elements, (std::vector<int64_t>{192, 136, 936, 912}));
  EXPECT_EQ(plan.slot_offset, (std::vector<int64_t>{0, 256, 512, 1536}));
  EXPECT_EQ(plan.total_elements, 2560);
  const int64_t offset[] = {0,         512 + 64, 1536 + 40, 512 + 16,
                            256 + 120, 512 + 16, 1536 + 40, 512 + 64};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(plan.uses[i].offset, offset[i]) << i;
}

TEST(ParamWindow, WindowLayersAreClamped) {
  EXPECT_EQ(PlanParamWindow(TinyGpt2Config(3), 0).window_layers, 1);
  EXPECT_EQ(PlanParamWindow(TinyGpt2Config(3), -2).window_layers, 1);
  EXPECT_EQ(PlanParamWindow(TinyGpt2Config(3), 7).window_layers, 3);
  EXPECT_EQ(PlanParamWindow(TinyGpt2Config(3), 7).slot_elements.size(), 5u);
}

TEST(ParamWindow, SimulatedScheduleIsSound) {
  for (int L : {1, 2, 3, 5, 12}) {
    for (int requested : {1, 2, 3, L, L + 4}) {
      SCOPED_TRACE(testing::Message() << "L " << L << " window_layers " << requested);
      const Gpt2Config c = TinyGpt2Config(L);
      const ParamWindowPlan plan = PlanParamWindow(c, requested);
      const int Wn = std::min(requested, L);
      ASSERT_EQ(plan.window_layers, Wn);
      const int slots = 2 + Wn;
      const int n = static_cast<int>(plan.uses.size());
      ASSERT_EQ(n, 2 * L + 2);
      ASSERT_EQ(plan.fill_after_release.size(), static_cast<size_t>(n));

      // The uses, in order, and where the plan says they are.
      EXPECT_EQ(plan.embeddings_use, 0);
      EXPECT_EQ(plan.lnf_use, L + 1);
      ASSERT_EQ(plan.forward_use_of_block.size(), static_cast<size_t>(L));
      ASSERT_EQ(plan.backward_use_of_block.size(), static_cast<size_t>(L));
      for (int l = 0; l < L; ++l) {
        EXPECT_EQ(plan.forward_use_of_block[l], 1 + l);
        EXPECT_EQ(plan.backward_use_of_block[l], 2 * L + 1 - l);
        EXPECT_EQ(plan.uses[1 + l].unit, l + 1);
        EXPECT_FALSE(plan.uses[1 + l].backward);
        EXPECT_EQ(plan.uses[2 * L + 1 - l].unit, l + 1);
        EXPECT_TRUE(plan.uses[2 * L + 1 - l].backward);
      }
      // The embeddings and ln_f: their own slots, filled once at the start.
      EXPECT_EQ(plan.uses[0].unit, 0);
      EXPECT_EQ(plan.uses[0].slot, kWindowEmbeddingSlot);
      EXPECT_EQ(plan.uses[L + 1].unit, L + 1);
      EXPECT_EQ(plan.uses[L + 1].slot, kWindowLnfSlot);
      for (int i : {0, L + 1}) {
        EXPECT_TRUE(plan.uses[i].fill);
        EXPECT_EQ(plan.uses[i].previous, -1);
      }

      // Simulate the slots: each use finds its unit, filled or left there, and its previous use
      // is the slot's last one before it.
      std::vector<int> content(slots, -1), last_use(slots, -1);
      for (int j = 0; j < n; ++j) {
        const WindowUse& u = plan.uses[j];
        SCOPED_TRACE(j);
        ASSERT_GE(u.slot, 0);
        ASSERT_LT(u.slot, slots);
        const bool block = u.unit >= 1 && u.unit <= L;
        EXPECT_EQ(u.slot >= 2, block);
        EXPECT_EQ(u.previous, last_use[u.slot]);
        EXPECT_LT(u.previous, j);
        if (u.fill) {
          content[u.slot] = u.unit;
        } else {
          EXPECT_EQ(content[u.slot], u.unit);  // resident: no copy needed
        }
        last_use[u.slot] = j;
      }

      // The copy stream runs fills in the order the host queues them: the initial fills, then
      // each fill once the compute stream has released its slot's previous use. Fill j waits for
      // use i = previous(j), so it must come after every fill of a use at or before i: the
      // compute stream reaches i's release only once those have landed.
      std::vector<int> order = plan.initial_fills;
      std::vector<int> queued_after(n, -1);  // the release a fill is queued at, -1: the start
      for (int i = 0; i < n; ++i) {
        if (plan.fill_after_release[i] < 0) continue;
        const int j = plan.fill_after_release[i];
        ASSERT_LT(i, j);
        EXPECT_TRUE(plan.uses[j].fill);
        EXPECT_EQ(plan.uses[j].previous, i);
        order.push_back(j);
        queued_after[j] = i;
      }
      std::vector<int> times_queued(n, 0);
      for (int j : order) times_queued[j]++;
      for (int j = 0; j < n; ++j) EXPECT_EQ(times_queued[j], plan.uses[j].fill ? 1 : 0) << j;
      for (int j : plan.initial_fills) EXPECT_EQ(plan.uses[j].previous, -1) << j;
      for (size_t k = 0; k < order.size(); ++k) {
        const int wait = queued_after[order[k]];
        for (size_t m = k + 1; m < order.size(); ++m) {
          EXPECT_GT(order[m], wait) << "fill " << order[m] << " is behind fill " << order[k]
                                    << ", which waits for its release";
        }
      }

      // Copies: every unit once when the window holds all the blocks; with one block slot, all
      // but the last block again in backward.
      if (Wn >= L) {
        EXPECT_EQ(plan.fills(), L + 2);
      }
      if (Wn == 1) {
        EXPECT_EQ(plan.fills(), 2 + 2 * L - 1);
      }
      int block_fills = 0;
      for (const WindowUse& u : plan.uses) block_fills += u.fill && u.slot >= 2;
      EXPECT_EQ(plan.fills(), 2 + block_fills);
      // The last Wn blocks of forward are still there for backward.
      for (int l = L - Wn; l < L; ++l) EXPECT_FALSE(plan.uses[plan.backward_use_of_block[l]].fill);

      // The slots: back to back at multiples of 128 elements, each as large as the largest unit
      // it takes with that unit's address phase in front; each use at its unit's phase.
      ASSERT_EQ(plan.slot_elements.size(), static_cast<size_t>(slots));
      ASSERT_EQ(plan.slot_offset.size(), static_cast<size_t>(slots));
      std::vector<int64_t> largest(slots, 0);
      for (const WindowUse& u : plan.uses) {
        const ParamRange r = Gpt2UnitRange(c, u.unit);
        largest[u.slot] = std::max(largest[u.slot], r.begin % 128 + r.size());
        EXPECT_EQ(u.offset, plan.slot_offset[u.slot] + r.begin % 128);
      }
      int64_t end = 0;
      for (int s = 0; s < slots; ++s) {
        EXPECT_EQ(plan.slot_elements[s], largest[s]) << s;
        EXPECT_EQ(plan.slot_offset[s] % 128, 0);
        EXPECT_GE(plan.slot_offset[s], end);
        EXPECT_LT(plan.slot_offset[s], end + 128);
        end = plan.slot_offset[s] + plan.slot_elements[s];
      }
      EXPECT_EQ(plan.total_elements % 128, 0);
      EXPECT_GE(plan.total_elements, end);
      EXPECT_LT(plan.total_elements, end + 128);
    }
  }
}

}  // namespace
}  // namespace offload
