// The flat parameter buffer of GPT-2 (ARCHITECTURE.md section 3): names, shapes and offsets, and
// the seeded initialisation.
//
// Names and shapes are Hugging Face GPT-2's (transformer.* prefix dropped), in its order, so its
// weights map one to one. Linear weights are Conv1D-style (in, out): y = x @ W + b. The LM head
// is tied to wte (logits = x @ wte^T) and owns no tensor.
//
//   wte.weight (V, C), wpe.weight (maxT, C), then for l in 0..L-1:
//     h.{l}.ln_1.weight (C), h.{l}.ln_1.bias (C),
//     h.{l}.attn.c_attn.weight (C, 3C), h.{l}.attn.c_attn.bias (3C),
//     h.{l}.attn.c_proj.weight (C, C), h.{l}.attn.c_proj.bias (C),
//     h.{l}.ln_2.weight (C), h.{l}.ln_2.bias (C),
//     h.{l}.mlp.c_fc.weight (C, 4C), h.{l}.mlp.c_fc.bias (4C),
//     h.{l}.mlp.c_proj.weight (4C, C), h.{l}.mlp.c_proj.bias (C),
//   ln_f.weight (C), ln_f.bias (C).
//
// Layer-major on purpose: backward finishes the last layer first, and that layer's gradients are
// one contiguous range that can be streamed to the optimizer while earlier layers still compute.
#ifndef OFFLOAD_MODEL_SPEC_PARAM_LAYOUT_H_
#define OFFLOAD_MODEL_SPEC_PARAM_LAYOUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "model_spec/gpt2_config.h"

namespace offload {

struct ParamTensor {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // first element in the flat buffer
  int64_t numel = 0;
};

// The tensors in buffer order, back to back (no padding). `c` must be valid.
std::vector<ParamTensor> Gpt2ParamLayout(const Gpt2Config& c);
int64_t Gpt2NumParams(const Gpt2Config& c);

// The first element of layer l's tensors (l == num_layers: of ln_f). Layer l occupies
// [Gpt2LayerOffset(c, l), Gpt2LayerOffset(c, l + 1)).
int64_t Gpt2LayerOffset(const Gpt2Config& c, int l);

// ZeRO-3 (ARCHITECTURE.md section 3) gathers the weights one unit at a time: unit 0 is the
// embeddings (wte, which is also the tied head, and wpe), units 1..L the blocks h.0..h.{L-1},
// unit L+1 ln_f. Each unit is one contiguous range of the flat buffer, in buffer order.
struct ParamRange {
  int64_t begin = 0;
  int64_t end = 0;  // one past the last element
  int64_t size() const { return end - begin; }
};
inline int Gpt2NumUnits(const Gpt2Config& c) { return c.num_layers + 2; }
ParamRange Gpt2UnitRange(const Gpt2Config& c, int unit);  // unit in [0, Gpt2NumUnits(c))

// Where each tensor sits in Gpt2ParamLayout: wte, wpe, 12 per block, then ln_f.
inline constexpr int kWte = 0;
inline constexpr int kWpe = 1;
enum BlockTensor {
  kLn1Weight,
  kLn1Bias,
  kAttnWeight,
  kAttnBias,
  kAttnProjWeight,
  kAttnProjBias,
  kLn2Weight,
  kLn2Bias,
  kFcWeight,
  kFcBias,
  kFcProjWeight,
  kFcProjBias,
  kNumBlockTensors,
};
inline int BlockIndex(int l, BlockTensor k) { return 2 + kNumBlockTensors * l + k; }
inline int LnfWeightIndex(int L) { return 2 + kNumBlockTensors * L; }
inline int LnfBiasIndex(int L) { return 3 + kNumBlockTensors * L; }

// GPT-2's initialisation: matrix weights and both embeddings normal(0, 0.02), the two residual
// projections (attn.c_proj.weight, mlp.c_proj.weight) normal(0, 0.02 / sqrt(2 * L)), biases 0,
// LayerNorm weight 1 and bias 0.
//
// Bit-reproducible from the seed on any IEEE-754 platform: one xoshiro256** stream (seeded by
// splitmix64) visits the tensors in layout order, and normals come from the Marsaglia polar
// method with a log of our own made of + - * / only, so neither the standard library's
// distributions nor libm's rounding enter (the file builds with -ffp-contract=off).
void InitGpt2Params(const Gpt2Config& c, uint64_t seed, float* params);  // params (num_params,)

}  // namespace offload

#endif  // OFFLOAD_MODEL_SPEC_PARAM_LAYOUT_H_
