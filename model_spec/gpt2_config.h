// The GPT-2 hyper-parameters (ARCHITECTURE.md section 6) and the FLOP count benchmarks report
// against.
#ifndef OFFLOAD_MODEL_SPEC_GPT2_CONFIG_H_
#define OFFLOAD_MODEL_SPEC_GPT2_CONFIG_H_

#include "absl/status/status.h"

namespace offload {

// Defaults are the small byte-level demo model (vocab 256: UTF-8 bytes).
struct Gpt2Config {
  int vocab_size = 256;
  int context_length = 256;  // maxT: rows of the position embedding
  int num_layers = 4;
  int num_heads = 4;
  int channels = 128;
};

// Every field > 0, channels divisible by num_heads, and each field below a bound far above any
// GPT-2 size, so that sizes derived from it cannot overflow. The message names the field.
absl::Status ValidateGpt2Config(const Gpt2Config& c);

// FLOPs of one training step (forward + backward) per token at sequence length T: 6 per weight of
// every matrix product (2 forward, 4 backward; the 12*L*C^2 block weights plus V*C for the tied
// head, not the embedding lookups, biases or LayerNorms), plus attention's own products
// (Q.K^T and att.V: 4*T*C per layer forward, 12*T*C forward + backward). Like PaLM's MFU
// (appendix B) the attention term counts the whole T x T score matrix, not its causal half.
double Gpt2FlopsPerToken(const Gpt2Config& c, int T);

}  // namespace offload

#endif  // OFFLOAD_MODEL_SPEC_GPT2_CONFIG_H_
