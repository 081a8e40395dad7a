// A GPT-2 small enough that tests of the flat layout's planners can check sizes by hand.
#ifndef OFFLOAD_MODEL_SPEC_PARAM_LAYOUT_TEST_UTIL_H_
#define OFFLOAD_MODEL_SPEC_PARAM_LAYOUT_TEST_UTIL_H_

#include "model_spec/gpt2_config.h"

namespace offload {

// V 16, maxT 8, C 8, 2 heads. Its units: the embeddings 16*8 + 8*8 = 192 elements, each block
// 4*8 + (8*24 + 24) + (8*8 + 8) + (8*32 + 32) + (32*8 + 8) = 872, ln_f 16; with 3 layers
// 2824 parameters, at [0, 192) [192, 1064) [1064, 1936) [1936, 2808) [2808, 2824).
inline Gpt2Config TinyGpt2Config(int num_layers = 3) {
  Gpt2Config c;
  c.vocab_size = 16;
  c.context_length = 8;
  c.num_layers = num_layers;
  c.num_heads = 2;
  c.channels = 8;
  return c;
}

}  // namespace offload

#endif  // OFFLOAD_MODEL_SPEC_PARAM_LAYOUT_TEST_UTIL_H_
