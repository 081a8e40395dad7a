// The layer kernels of the GPT-2 CPU backend behind one table, so the model is written once and
// runs on either set: the naive reference (layers_naive.h) or the fast one (layers_fast.h).
//
// Conventions, shared by both sets:
// - fp32, row-major, contiguous. B batch, T sequence, C channels, OC output channels, NH heads,
//   hs = C / NH head size, V vocab, maxT context length.
// - Linear weights are (in, out), as GPT-2's Conv1D: out = inp @ weight + bias.
// - Parameter gradients are ACCUMULATED (+=), as in llm.c: wte receives both the tied head's and
//   the embedding's share, so callers zero them once per backward pass.
// - Activation gradients are OVERWRITTEN (=), except LayerNorm's dinp, which is accumulated: in a
//   pre-LN model the gradient of every LayerNorm input is the residual stream's, which already
//   holds the skip connection's share. Every other activation gradient has a single producer,
//   so overwriting spares zeroing a dozen (B, T, 4C)-sized buffers per layer per step.
//   Arguments marked "scratch" are overwritten and their contents on entry do not matter.
// - Pointers to different tensors do not alias unless a comment says so.
#ifndef OFFLOAD_GPU_TRAINER_MODEL_LAYER_KERNELS_H_
#define OFFLOAD_GPU_TRAINER_MODEL_LAYER_KERNELS_H_

#include <cstdint>

namespace offload {

struct CpuLayerKernels {
  const char* name;  // "naive" or "fast"

  // out (B, T, C) = wte[inp] + wpe[t]; inp (B, T) token ids, wte (V, C), wpe (maxT, C).
  void (*encoder_forward)(float* out, const int32_t* inp, const float* wte, const float* wpe, int B,
                          int T, int C);
  // dwte (V, C) +=, dwpe (maxT, C) +=; dout (B, T, C), inp (B, T).
  void (*encoder_backward)(float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B,
                           int T, int C);

  // LayerNorm over C, eps 1e-5 (GPT-2's). out (B, T, C); mean, rstd (B, T) saved for backward;
  // inp (B, T, C), weight, bias (C).
  void (*layernorm_forward)(float* out, float* mean, float* rstd, const float* inp,
                            const float* weight, const float* bias, int B, int T, int C);
  // dinp (B, T, C) +=, dweight, dbias (C) +=; dout, inp (B, T, C); weight (C); mean, rstd (B, T).
  void (*layernorm_backward)(float* dinp, float* dweight, float* dbias, const float* dout,
                             const float* inp, const float* weight, const float* mean,
                             const float* rstd, int B, int T, int C);

  // out (B, T, OC) = inp (B, T, C) @ weight (C, OC) + bias (OC); bias may be nullptr.
  void (*matmul_forward)(float* out, const float* inp, const float* weight, const float* bias,
                         int B, int T, int C, int OC);
  // dinp (B, T, C) =, dweight (C, OC) +=, dbias (OC) += (may be nullptr); dout (B, T, OC).
  void (*matmul_backward)(float* dinp, float* dweight, float* dbias, const float* dout,
                          const float* inp, const float* weight, int B, int T, int C, int OC);

  // Causal multi-head self-attention, scores scaled by 1/sqrt(hs). qkv (B, T, 3C) holds Q, K, V
  // side by side, head h in channels [h*hs, (h+1)*hs) of each. out (B, T, C) heads side by side;
  // preatt (B, NH, T, T) scratch; att (B, NH, T, T) softmax weights saved for backward (zero
  // above the diagonal).
  void (*attention_forward)(float* out, float* preatt, float* att, const float* qkv, int B, int T,
                            int C, int NH);
  // dqkv (B, T, 3C) =; dpreatt, datt (B, NH, T, T) scratch; dout (B, T, C); qkv (B, T, 3C);
  // att (B, NH, T, T).
  void (*attention_backward)(float* dqkv, float* dpreatt, float* datt, const float* dout,
                             const float* qkv, const float* att, int B, int T, int C, int NH);

  // GELU, tanh approximation (GPT-2's): out (N,), inp (N,).
  void (*gelu_forward)(float* out, const float* inp, int64_t N);
  // dinp (N,) =; inp, dout (N,).
  void (*gelu_backward)(float* dinp, const float* inp, const float* dout, int64_t N);

  // out (N,) = inp1 + inp2; out may alias either input. Its backward is the identity, which the
  // model gets for free by letting both branches add into one residual-stream gradient.
  void (*residual_forward)(float* out, const float* inp1, const float* inp2, int64_t N);

  // The LM head tied to the token embedding: logits (B, T, V) = inp (B, T, C) @ wte (V, C)^T.
  void (*tied_head_forward)(float* logits, const float* inp, const float* wte, int B, int T, int C,
                            int V);
  // dinp (B, T, C) =, dwte (V, C) +=; dlogits (B, T, V), inp (B, T, C), wte (V, C).
  void (*tied_head_backward)(float* dinp, float* dwte, const float* dlogits, const float* inp,
                             const float* wte, int B, int T, int C, int V);

  // Fused softmax + cross-entropy. probs (B, T, V) = softmax(logits); losses (B, T) =
  // -log probs[target]; targets (B, T) in [0, V).
  void (*crossentropy_forward)(float* losses, float* probs, const float* logits,
                               const int32_t* targets, int B, int T, int V);
  // dlogits (B, T, V) = (probs - onehot(targets)) * dloss, the gradient of dloss * sum(losses);
  // for the mean loss scaled by s, dloss = s / (B * T).
  void (*crossentropy_backward)(float* dlogits, const float* probs, const int32_t* targets,
                                float dloss, int B, int T, int V);
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_MODEL_LAYER_KERNELS_H_
