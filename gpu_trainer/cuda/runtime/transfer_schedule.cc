#include "gpu_trainer/cuda/runtime/transfer_schedule.h"

#include "model_spec/param_layout.h"

namespace offload {
namespace {

// Where block l starts in the flat layout; l = L gives ln_f's start.
int64_t BlockStart(const Gpt2Config& c, const std::vector<ParamTensor>& layout, int l) {
  return layout[l < c.num_layers ? BlockIndex(l, kLn1Weight) : LnfWeightIndex(c.num_layers)].offset;
}

}  // namespace

std::vector<FlatRange> ForwardWeightUnits(const Gpt2Config& c) {
  const std::vector<ParamTensor> layout = Gpt2ParamLayout(c);
  const int L = c.num_layers;
  const int64_t n = Gpt2NumParams(c);
  std::vector<FlatRange> units;
  units.reserve(L + 2);
  units.push_back({0, BlockStart(c, layout, 0)});
  for (int l = 0; l < L; ++l) {
    const int64_t begin = BlockStart(c, layout, l);
    units.push_back({begin, BlockStart(c, layout, l + 1) - begin});
  }
  const int64_t lnf = BlockStart(c, layout, L);
  units.push_back({lnf, n - lnf});
  return units;
}

std::vector<FlatRange> BackwardGradientRanges(const Gpt2Config& c) {
  std::vector<FlatRange> units = ForwardWeightUnits(c);
  // Forward order is embeddings, blocks, ln_f; backward finishes ln_f, the blocks from the last,
  // and the embeddings last of all: the exact reverse.
  return std::vector<FlatRange>(units.rbegin(), units.rend());
}

}  // namespace offload
