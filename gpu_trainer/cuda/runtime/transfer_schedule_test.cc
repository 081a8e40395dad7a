// The host arithmetic of the CUDA backend's offload pipeline: the weight units and gradient
// ranges partition the layout in forward and backward order, and the registered-memory ranges
// answer exactly which transfers may skip the pinned ring. Runs on any machine.
#include "gpu_trainer/cuda/runtime/transfer_schedule.h"

#include <cstdint>
#include <vector>

#include "gpu_trainer/cuda/runtime/host_ranges.h"
#include "gtest/gtest.h"
#include "model_spec/param_layout.h"

namespace offload {
namespace {

std::vector<Gpt2Config> Configs() {
  return {Gpt2Config{101, 40, 2, 3, 48}, Gpt2Config{256, 64, 4, 4, 128},
          Gpt2Config{50257, 1024, 12, 12, 768}, Gpt2Config{50257, 1024, 1, 25, 1600}};
}

TEST(TransferSchedule, WeightUnitsPartitionTheLayoutInForwardOrder) {
  for (const Gpt2Config& c : Configs()) {
    const std::vector<FlatRange> units = ForwardWeightUnits(c);
    const std::vector<ParamTensor> layout = Gpt2ParamLayout(c);
    ASSERT_EQ(units.size(), static_cast<size_t>(c.num_layers + 2));
    int64_t next = 0;
    for (const FlatRange& u : units) {
      EXPECT_EQ(u.offset, next);
      EXPECT_GT(u.n, 0);
      next = u.end();
    }
    EXPECT_EQ(next, Gpt2NumParams(c));
    // Every tensor the forward reads before block l lies in units before WeightUnitBefore(l);
    // block l's own tensors lie in that unit exactly.
    for (int l = 0; l < c.num_layers; ++l) {
      const FlatRange& u = units[WeightUnitBefore(l)];
      for (int k = 0; k < kNumBlockTensors; ++k) {
        const ParamTensor& t = layout[BlockIndex(l, static_cast<BlockTensor>(k))];
        EXPECT_GE(t.offset, u.offset) << "block " << l << " tensor " << k;
        EXPECT_LE(t.offset + t.numel, u.end()) << "block " << l << " tensor " << k;
      }
    }
    EXPECT_EQ(units[0].end(), layout[BlockIndex(0, kLn1Weight)].offset);  // wte, wpe
    EXPECT_EQ(units.back().offset, layout[LnfWeightIndex(c.num_layers)].offset);
  }
}

TEST(TransferSchedule, GradientRangesAreTheReverseOfTheWeightUnits) {
  for (const Gpt2Config& c : Configs()) {
    const std::vector<FlatRange> units = ForwardWeightUnits(c);
    const std::vector<FlatRange> ranges = BackwardGradientRanges(c);
    ASSERT_EQ(ranges.size(), units.size());
    for (size_t i = 0; i < ranges.size(); ++i) {
      EXPECT_EQ(ranges[i].offset, units[units.size() - 1 - i].offset);
      EXPECT_EQ(ranges[i].n, units[units.size() - 1 - i].n);
    }
    // ln_f's range runs to the end of the layout; the embeddings' starts at 0 and comes last.
    EXPECT_EQ(ranges.front().end(), Gpt2NumParams(c));
    EXPECT_EQ(ranges.back().offset, 0);
  }
}

TEST(HostRanges, AnswersContainmentAndRefusesOverlaps) {
  std::vector<char> memory(1000);
  char* base = memory.data();
  HostRanges ranges;
  EXPECT_FALSE(ranges.Contains(base, 1));
  ASSERT_TRUE(ranges.Add(base + 100, 100));  // [100, 200)
  ASSERT_TRUE(ranges.Add(base + 300, 50));   // [300, 350)
  EXPECT_FALSE(ranges.Add(base + 150, 10));  // inside the first
  EXPECT_FALSE(ranges.Add(base + 50, 60));   // overlaps the first's start
  EXPECT_FALSE(ranges.Add(base + 199, 2));   // overlaps its end
  EXPECT_FALSE(ranges.Add(base + 250, 51));  // overlaps the second's start
  EXPECT_FALSE(ranges.Add(base, 0));
  EXPECT_FALSE(ranges.Add(nullptr, 8));
  EXPECT_TRUE(ranges.Add(base + 200, 100));  // exactly between: [200, 300)

  EXPECT_TRUE(ranges.Contains(base + 100, 100));
  EXPECT_TRUE(ranges.Contains(base + 120, 30));
  EXPECT_TRUE(ranges.Contains(base + 199, 0));
  EXPECT_FALSE(ranges.Contains(base + 200 - 1, 2)) << "straddles two ranges: not one transfer";
  EXPECT_FALSE(ranges.Contains(base + 99, 2));
  EXPECT_FALSE(ranges.Contains(base + 340, 11));
  EXPECT_FALSE(ranges.Contains(base + 350, 0));
  EXPECT_FALSE(ranges.Contains(base + 500, 1));

  EXPECT_EQ(ranges.Starts(), (std::vector<const void*>{base + 100, base + 200, base + 300}));
  EXPECT_TRUE(ranges.Remove(base + 200));
  EXPECT_FALSE(ranges.Remove(base + 200));
  EXPECT_FALSE(ranges.Remove(base + 120)) << "only by a range's start";
  EXPECT_FALSE(ranges.Contains(base + 250, 1));
  EXPECT_TRUE(ranges.Contains(base + 300, 50));
}

}  // namespace
}  // namespace offload
