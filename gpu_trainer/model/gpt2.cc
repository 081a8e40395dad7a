#include "gpu_trainer/model/gpt2.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "gpu_trainer/model/layer_kernels.h"
#include "gpu_trainer/model/layers_fast.h"
#include "gpu_trainer/model/layers_naive.h"
#include "model_spec/gpt2_config.h"
#include "model_spec/param_layout.h"

namespace offload {
namespace {

// Hands out consecutive views of one buffer; with a null base it only counts, so the same code
// sizes the allocation and then carves it.
class Carver {
 public:
  explicit Carver(float* base) : base_(base) {}
  float* Take(int64_t n) {
    float* view = base_ == nullptr ? nullptr : base_ + used_;
    used_ += n;
    return view;
  }
  int64_t used() const { return used_; }

 private:
  float* const base_;
  int64_t used_ = 0;
};

// A unit of weights from a Gpt2ParamSource, released when it goes out of scope, so that an error
// part way through a pass leaves nothing held.
class HeldUnit {
 public:
  HeldUnit(Gpt2ParamSource& source, int unit) : source_(source), unit_(unit) {}
  HeldUnit(const HeldUnit&) = delete;
  HeldUnit& operator=(const HeldUnit&) = delete;
  ~HeldUnit() { Release(); }

  absl::Status Acquire() {
    OFFLOAD_ASSIGN_OR_RETURN(base_, source_.Acquire(unit_));
    held_ = true;
    return absl::OkStatus();
  }
  void Release() {
    if (held_) source_.Release(unit_);
    held_ = false;
  }
  const float* base() const { return base_; }
  int unit() const { return unit_; }

 private:
  Gpt2ParamSource& source_;
  const int unit_;
  const float* base_ = nullptr;
  bool held_ = false;
};

// With ValidateGpt2Config's bounds, kMaxTokens keeps B*T an int and every activation size in
// Create below int64 (the largest, L*B*NH*T*T, stays under 2^60).
constexpr int64_t kMaxTokens = int64_t{1} << 24;            // max_batch * max_seq
constexpr int64_t kMaxActivationFloats = int64_t{1} << 40;  // 4 TiB: refuse rather than try

}  // namespace

FlatGpt2Params::FlatGpt2Params(const Gpt2Config& config, const float* params)
    : config_(config), params_(params) {}

absl::StatusOr<const float*> FlatGpt2Params::Acquire(int unit) {
  if (unit < 0 || unit >= Gpt2NumUnits(config_)) {
    return absl::InvalidArgumentError(absl::StrCat("FlatGpt2Params: no unit ", unit));
  }
  return params_ + Gpt2UnitRange(config_, unit).begin;
}

FlatGpt2Grads::FlatGpt2Grads(const Gpt2Config& config, float* grads,
                             std::function<void(int64_t offset, int64_t n)> on_ready)
    : config_(config), grads_(grads), on_ready_(std::move(on_ready)) {}

absl::StatusOr<float*> FlatGpt2Grads::Acquire(int unit) {
  if (unit < 0 || unit >= Gpt2NumUnits(config_)) {
    return absl::InvalidArgumentError(absl::StrCat("FlatGpt2Grads: no unit ", unit));
  }
  const ParamRange r = Gpt2UnitRange(config_, unit);
  std::memset(grads_ + r.begin, 0, sizeof(float) * r.size());
  return grads_ + r.begin;
}

absl::Status FlatGpt2Grads::Release(int unit) {
  const ParamRange r = Gpt2UnitRange(config_, unit);
  if (on_ready_) on_ready_(r.begin, r.size());
  return absl::OkStatus();
}

Gpt2Cpu::Gpt2Cpu(const Gpt2Config& config, int max_batch, int max_seq,
                 const CpuLayerKernels* kernels, bool activation_checkpointing)
    : config_(config),
      max_batch_(max_batch),
      max_seq_(max_seq),
      kernels_(kernels),
      checkpointing_(activation_checkpointing) {}

// Sizes are for (max_batch, max_seq); Forward packs smaller batches densely (see gpt2.h). With a
// null base it only counts, so the same code sizes the allocation and then carves it.
int64_t Gpt2Cpu::CarveActivations(const Gpt2Config& config, int max_batch, int max_seq,
                                  bool activation_checkpointing, float* base, Activations* a,
                                  ActivationGrads* g) {
  const int64_t Bi = max_batch, Ti = max_seq, Li = config.num_layers, Ci = config.channels,
                NHi = config.num_heads, Vi = config.vocab_size;
  const int64_t BT = Bi * Ti, BTC = BT * Ci, BHTT = Bi * NHi * Ti * Ti;
  const int64_t Ls = activation_checkpointing ? 1 : Li;  // layers of saved activations
  Carver c(base);
  a->encoded = c.Take(BTC);
  a->ln1 = c.Take(Ls * BTC);
  a->ln1_mean = c.Take(Ls * BT);
  a->ln1_rstd = c.Take(Ls * BT);
  a->qkv = c.Take(Ls * 3 * BTC);
  a->atty = c.Take(Ls * BTC);
  a->att = c.Take(Ls * BHTT);
  a->residual2 = c.Take(Ls * BTC);
  a->ln2 = c.Take(Ls * BTC);
  a->ln2_mean = c.Take(Ls * BT);
  a->ln2_rstd = c.Take(Ls * BT);
  a->fch = c.Take(Ls * 4 * BTC);
  a->fch_gelu = c.Take(Ls * 4 * BTC);
  a->residual3 = c.Take(Li * BTC);  // every block's output: the next block's input
  a->lnf = c.Take(BTC);
  a->lnf_mean = c.Take(BT);
  a->lnf_rstd = c.Take(BT);
  a->logits = c.Take(BT * Vi);
  a->probs = c.Take(BT * Vi);
  a->losses = c.Take(BT);
  a->preatt = c.Take(BHTT);
  a->proj = c.Take(BTC);
  g->dlogits = c.Take(BT * Vi);
  g->dlnf = c.Take(BTC);
  g->dresidual = c.Take(BTC);
  g->dln1 = c.Take(BTC);
  g->dqkv = c.Take(3 * BTC);
  g->datty = c.Take(BTC);
  g->dpreatt = c.Take(BHTT);
  g->datt = c.Take(BHTT);
  g->dln2 = c.Take(BTC);
  g->dfch = c.Take(4 * BTC);
  g->dfch_gelu = c.Take(4 * BTC);
  return c.used();
}

int64_t Gpt2Cpu::ActivationBytes(const Gpt2Config& config, int max_batch, int max_seq,
                                 bool activation_checkpointing) {
  Activations a{};
  ActivationGrads g{};
  return 4 *
         CarveActivations(config, max_batch, max_seq, activation_checkpointing, nullptr, &a, &g);
}

absl::StatusOr<std::unique_ptr<Gpt2Cpu>> Gpt2Cpu::Create(const Gpt2Config& config, int max_batch,
                                                         int max_seq, CpuKernelSet kernels,
                                                         bool activation_checkpointing) {
  OFFLOAD_RETURN_IF_ERROR(ValidateGpt2Config(config));
  if (max_batch <= 0 || max_seq <= 0 || max_seq > config.context_length ||
      int64_t{max_batch} * max_seq > kMaxTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Gpt2Cpu::Create: max_batch = ", max_batch, ", max_seq = ", max_seq,
        ": need max_batch >= 1, 1 <= max_seq <= context_length = ", config.context_length,
        ", max_batch * max_seq <= ", kMaxTokens));
  }
  std::unique_ptr<Gpt2Cpu> model(new Gpt2Cpu(
      config, max_batch, max_seq, kernels == CpuKernelSet::kFast ? &FastKernels() : &NaiveKernels(),
      activation_checkpointing));
  for (const ParamTensor& t : Gpt2ParamLayout(config)) model->tensor_offsets_.push_back(t.offset);
  model->num_params_ = Gpt2NumParams(config);
  for (int u = 0; u < Gpt2NumUnits(config); ++u) {
    model->unit_begins_.push_back(Gpt2UnitRange(config, u).begin);
  }

  const int64_t total = CarveActivations(config, max_batch, max_seq, activation_checkpointing,
                                         nullptr, &model->acts_, &model->grads_);
  if (total > kMaxActivationFloats) {
    return absl::ResourceExhaustedError(
        absl::StrCat("Gpt2Cpu::Create: activations for max_batch = ", max_batch,
                     ", max_seq = ", max_seq, " need ", total * 4, " bytes"));
  }
  // Value-initialised, so logits() reads zeros, not garbage, before the first Forward.
  model->memory_.reset(new (std::nothrow) float[total]());
  if (model->memory_ == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("Gpt2Cpu::Create: cannot allocate ", total * 4, " bytes of activations"));
  }
  model->activation_floats_ = total;
  CarveActivations(config, max_batch, max_seq, activation_checkpointing, model->memory_.get(),
                   &model->acts_, &model->grads_);
  model->inputs_.resize(int64_t{max_batch} * max_seq);
  model->targets_.resize(int64_t{max_batch} * max_seq);
  return model;
}

absl::StatusOr<float> Gpt2Cpu::Forward(const float* params, const int32_t* inputs,
                                       const int32_t* targets, int B, int T) {
  if (params == nullptr) {
    return absl::InvalidArgumentError("Gpt2Cpu::Forward: params and inputs must not be null");
  }
  FlatGpt2Params flat(config_, params);
  return Forward(flat, inputs, targets, B, T);
}

absl::StatusOr<float> Gpt2Cpu::Forward(Gpt2ParamSource& params, const int32_t* inputs,
                                       const int32_t* targets, int B, int T) {
  // Everything is checked before anything is written, so a refused call leaves the previous
  // Forward's activations, logits and batch intact for a Backward.
  if (inputs == nullptr) {
    return absl::InvalidArgumentError("Gpt2Cpu::Forward: inputs must not be null");
  }
  if (B <= 0 || B > max_batch_ || T <= 0 || T > max_seq_) {
    return absl::InvalidArgumentError(absl::StrCat("Gpt2Cpu::Forward: (B, T) = (", B, ", ", T,
                                                   ") outside [1, ", max_batch_, "] x [1, ",
                                                   max_seq_, "]"));
  }
  const int V = config_.vocab_size;
  for (const int32_t* tokens : {inputs, targets}) {
    if (tokens == nullptr) continue;
    for (int64_t i = 0; i < int64_t{B} * T; i++) {
      if (tokens[i] < 0 || tokens[i] >= V) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Gpt2Cpu::Forward: ", tokens == inputs ? "inputs" : "targets", "[b=", i / T,
            ", t=", i % T, "] = ", tokens[i], " is outside the vocabulary [0, ", V, ")"));
      }
    }
  }
  std::memcpy(inputs_.data(), inputs, sizeof(int32_t) * B * T);
  if (targets != nullptr) std::memcpy(targets_.data(), targets, sizeof(int32_t) * B * T);
  B_ = B;
  T_ = T;
  have_targets_ = false;  // until the pass is through

  const CpuLayerKernels& k = *kernels_;
  const int L = config_.num_layers, C = config_.channels;
  const int64_t BT = int64_t{B} * T, BTC = BT * C;
  // Tensor `index` of the flat layout, inside the held unit that contains it.
  auto w = [&](const HeldUnit& unit, int index) {
    return unit.base() + (tensor_offsets_[index] - unit_begins_[unit.unit()]);
  };
  const Activations& a = acts_;

  HeldUnit embeddings(params, 0);  // also the tied head at the end
  OFFLOAD_RETURN_IF_ERROR(embeddings.Acquire());
  params.Prefetch(1);
  k.encoder_forward(a.encoded, inputs_.data(), w(embeddings, kWte), w(embeddings, kWpe), B, T, C);
  for (int l = 0; l < L; l++) {
    HeldUnit block(params, 1 + l);
    OFFLOAD_RETURN_IF_ERROR(block.Acquire());
    params.Prefetch(2 + l);  // the next block, or ln_f after the last
    BlockForward(l, block.base(), B, T);
  }
  HeldUnit lnf(params, L + 1);
  OFFLOAD_RETURN_IF_ERROR(lnf.Acquire());
  k.layernorm_forward(a.lnf, a.lnf_mean, a.lnf_rstd, a.residual3 + (L - 1) * BTC,
                      w(lnf, LnfWeightIndex(L)), w(lnf, LnfBiasIndex(L)), B, T, C);
  k.tied_head_forward(a.logits, a.lnf, w(embeddings, kWte), B, T, C, config_.vocab_size);
  have_targets_ = targets != nullptr;
  if (targets == nullptr) return 0.0f;

  k.crossentropy_forward(a.losses, a.probs, a.logits, targets_.data(), B, T, config_.vocab_size);
  double sum = 0.0;  // double: B*T terms of similar size, summed in a fixed order
  for (int64_t i = 0; i < BT; i++) sum += a.losses[i];
  return static_cast<float>(sum / BT);
}

void Gpt2Cpu::BlockForward(int l, const float* block, int B, int T) {
  const CpuLayerKernels& k = *kernels_;
  const int NH = config_.num_heads, C = config_.channels;
  const int64_t BT = int64_t{B} * T, BTC = BT * C, BHTT = BT * NH * T;
  const int64_t first = unit_begins_[1 + l];
  auto bw = [&](BlockTensor t) { return block + (tensor_offsets_[BlockIndex(l, t)] - first); };
  const Activations& a = acts_;
  const int64_t i = Slot(l);
  const float* residual = l == 0 ? a.encoded : a.residual3 + (l - 1) * BTC;  // (B, T, C)
  float* ln1 = a.ln1 + i * BTC;                                              // (B, T, C)
  float* ln1_mean = a.ln1_mean + i * BT;                                     // (B, T)
  float* ln1_rstd = a.ln1_rstd + i * BT;                                     // (B, T)
  float* qkv = a.qkv + i * 3 * BTC;                                          // (B, T, 3C)
  float* atty = a.atty + i * BTC;                                            // (B, T, C)
  float* att = a.att + i * BHTT;                                             // (B, NH, T, T)
  float* residual2 = a.residual2 + i * BTC;                                  // (B, T, C)
  float* ln2 = a.ln2 + i * BTC;                                              // (B, T, C)
  float* ln2_mean = a.ln2_mean + i * BT;                                     // (B, T)
  float* ln2_rstd = a.ln2_rstd + i * BT;                                     // (B, T)
  float* fch = a.fch + i * 4 * BTC;                                          // (B, T, 4C)
  float* fch_gelu = a.fch_gelu + i * 4 * BTC;                                // (B, T, 4C)
  float* residual3 = a.residual3 + l * BTC;                                  // (B, T, C)

  k.layernorm_forward(ln1, ln1_mean, ln1_rstd, residual, bw(kLn1Weight), bw(kLn1Bias), B, T, C);
  k.matmul_forward(qkv, ln1, bw(kAttnWeight), bw(kAttnBias), B, T, C, 3 * C);
  k.attention_forward(atty, a.preatt, att, qkv, B, T, C, NH);
  k.matmul_forward(a.proj, atty, bw(kAttnProjWeight), bw(kAttnProjBias), B, T, C, C);
  k.residual_forward(residual2, residual, a.proj, BTC);
  k.layernorm_forward(ln2, ln2_mean, ln2_rstd, residual2, bw(kLn2Weight), bw(kLn2Bias), B, T, C);
  k.matmul_forward(fch, ln2, bw(kFcWeight), bw(kFcBias), B, T, C, 4 * C);
  k.gelu_forward(fch_gelu, fch, 4 * BTC);
  k.matmul_forward(a.proj, fch_gelu, bw(kFcProjWeight), bw(kFcProjBias), B, T, 4 * C, C);
  k.residual_forward(residual3, residual2, a.proj, BTC);
}

absl::Status Gpt2Cpu::Backward(const float* params, float loss_scale, float* grads,
                               const std::function<void(int64_t offset, int64_t n)>& on_ready) {
  if (params == nullptr || grads == nullptr) {
    return absl::InvalidArgumentError("Gpt2Cpu::Backward: params and grads must not be null");
  }
  FlatGpt2Params flat(config_, params);
  FlatGpt2Grads flat_grads(config_, grads, on_ready);
  return Backward(flat, loss_scale, flat_grads);
}

absl::Status Gpt2Cpu::Backward(Gpt2ParamSource& params, float loss_scale, Gpt2GradSink& grads) {
  if (!have_targets_) {
    return absl::FailedPreconditionError(
        "Gpt2Cpu::Backward: needs a preceding Forward with targets");
  }
  if (!std::isfinite(loss_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gpt2Cpu::Backward: loss_scale = ", loss_scale, " is not finite"));
  }
  const CpuLayerKernels& k = *kernels_;
  const int B = B_, T = T_;
  const int L = config_.num_layers, NH = config_.num_heads, C = config_.channels,
            V = config_.vocab_size;
  const int64_t BT = int64_t{B} * T, BTC = BT * C, BHTT = BT * NH * T;
  auto w = [&](const HeldUnit& unit, int index) {
    return unit.base() + (tensor_offsets_[index] - unit_begins_[unit.unit()]);
  };
  // Tensor `index`'s gradient, inside the unit buffer `unit_grads` of the unit that contains it.
  auto dw = [&](float* unit_grads, int unit, int index) {
    return unit_grads + (tensor_offsets_[index] - unit_begins_[unit]);
  };
  const Activations& a = acts_;
  const ActivationGrads& g = grads_;

  // The kernels accumulate into parameter gradients (each unit's buffer comes zeroed) and into the
  // residual stream's gradient (layer_kernels.h); every other activation gradient they overwrite.
  std::memset(g.dresidual, 0, sizeof(float) * BTC);
  OFFLOAD_ASSIGN_OR_RETURN(float* const d_embeddings, grads.Acquire(0));
  OFFLOAD_ASSIGN_OR_RETURN(float* const d_lnf, grads.Acquire(L + 1));

  HeldUnit embeddings(params, 0);  // the tied head now, the embedding at the end
  OFFLOAD_RETURN_IF_ERROR(embeddings.Acquire());
  HeldUnit lnf(params, L + 1);
  OFFLOAD_RETURN_IF_ERROR(lnf.Acquire());
  params.Prefetch(L);  // the last block
  k.crossentropy_backward(g.dlogits, a.probs, targets_.data(), loss_scale / BT, B, T, V);
  k.tied_head_backward(g.dlnf, dw(d_embeddings, 0, kWte), g.dlogits, a.lnf, w(embeddings, kWte), B,
                       T, C, V);
  k.layernorm_backward(g.dresidual, dw(d_lnf, L + 1, LnfWeightIndex(L)),
                       dw(d_lnf, L + 1, LnfBiasIndex(L)), g.dlnf, a.residual3 + (L - 1) * BTC,
                       w(lnf, LnfWeightIndex(L)), a.lnf_mean, a.lnf_rstd, B, T, C);
  lnf.Release();
  OFFLOAD_RETURN_IF_ERROR(grads.Release(L + 1));

  for (int l = L - 1; l >= 0; l--) {
    HeldUnit block(params, 1 + l);
    OFFLOAD_RETURN_IF_ERROR(block.Acquire());
    if (l > 0) params.Prefetch(l);  // the block below
    // Checkpointing: the last block's activations are still those Forward left.
    if (checkpointing_ && l < L - 1) BlockForward(l, block.base(), B, T);
    OFFLOAD_ASSIGN_OR_RETURN(float* const d_block, grads.Acquire(1 + l));
    auto bw = [&](BlockTensor t) { return w(block, BlockIndex(l, t)); };
    auto dbw = [&](BlockTensor t) { return dw(d_block, 1 + l, BlockIndex(l, t)); };
    const int64_t i = Slot(l);
    const float* residual = l == 0 ? a.encoded : a.residual3 + (l - 1) * BTC;  // (B, T, C)
    const float* ln1 = a.ln1 + i * BTC;                                        // (B, T, C)
    const float* ln1_mean = a.ln1_mean + i * BT;                               // (B, T)
    const float* ln1_rstd = a.ln1_rstd + i * BT;                               // (B, T)
    const float* qkv = a.qkv + i * 3 * BTC;                                    // (B, T, 3C)
    const float* atty = a.atty + i * BTC;                                      // (B, T, C)
    const float* att = a.att + i * BHTT;                                       // (B, NH, T, T)
    const float* residual2 = a.residual2 + i * BTC;                            // (B, T, C)
    const float* ln2 = a.ln2 + i * BTC;                                        // (B, T, C)
    const float* ln2_mean = a.ln2_mean + i * BT;                               // (B, T)
    const float* ln2_rstd = a.ln2_rstd + i * BT;                               // (B, T)
    const float* fch = a.fch + i * 4 * BTC;                                    // (B, T, 4C)
    const float* fch_gelu = a.fch_gelu + i * 4 * BTC;                          // (B, T, 4C)

    // g.dresidual holds d loss / d residual3. Both branches of the block add into it in place:
    // the skip path passes it through unchanged, so after the MLP branch's LayerNorm it is
    // d loss / d residual2, and after the attention branch's, d loss / d residual.
    k.matmul_backward(g.dfch_gelu, dbw(kFcProjWeight), dbw(kFcProjBias), g.dresidual, fch_gelu,
                      bw(kFcProjWeight), B, T, 4 * C, C);
    k.gelu_backward(g.dfch, fch, g.dfch_gelu, 4 * BTC);
    k.matmul_backward(g.dln2, dbw(kFcWeight), dbw(kFcBias), g.dfch, ln2, bw(kFcWeight), B, T, C,
                      4 * C);
    k.layernorm_backward(g.dresidual, dbw(kLn2Weight), dbw(kLn2Bias), g.dln2, residual2,
                         bw(kLn2Weight), ln2_mean, ln2_rstd, B, T, C);
    k.matmul_backward(g.datty, dbw(kAttnProjWeight), dbw(kAttnProjBias), g.dresidual, atty,
                      bw(kAttnProjWeight), B, T, C, C);
    k.attention_backward(g.dqkv, g.dpreatt, g.datt, g.datty, qkv, att, B, T, C, NH);
    k.matmul_backward(g.dln1, dbw(kAttnWeight), dbw(kAttnBias), g.dqkv, ln1, bw(kAttnWeight), B, T,
                      C, 3 * C);
    k.layernorm_backward(g.dresidual, dbw(kLn1Weight), dbw(kLn1Bias), g.dln1, residual,
                         bw(kLn1Weight), ln1_mean, ln1_rstd, B, T, C);
    OFFLOAD_RETURN_IF_ERROR(grads.Release(1 + l));
  }

  k.encoder_backward(dw(d_embeddings, 0, kWte), dw(d_embeddings, 0, kWpe), g.dresidual,
                     inputs_.data(), B, T, C);
  return grads.Release(0);
}

}  // namespace offload
