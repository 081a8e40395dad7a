// GPT-2 on the CPU (ARCHITECTURE.md section 6): fp32 forward and backward over a flat parameter
// buffer in the layout of param_layout.h, on either kernel set of layer_kernels.h.
//
// The model owns only activations: parameters and gradients are the caller's flat buffers, so
// the trainer can stream gradient ranges out and parameter ranges in without copies.
#ifndef OFFLOAD_GPU_TRAINER_MODEL_GPT2_H_
#define OFFLOAD_GPU_TRAINER_MODEL_GPT2_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu_trainer/model/layer_kernels.h"
#include "model_spec/gpt2_config.h"

namespace offload {

enum class CpuKernelSet { kFast, kNaive };

// Where Forward and Backward find the fp32 weights, one unit at a time (Gpt2UnitRange): the whole
// flat buffer at once (FlatGpt2Params), or, under ZeRO-3, each unit gathered from the ranks that
// own it just before its use and freed after (gpu_trainer/train/param_gatherer.h).
//
// The model acquires and releases in a fixed order. Forward: 0 (held to the end), then each block
// 1..L in turn (acquired, used, released), then L+1. Backward: 0 and L+1, then L+1 is released,
// then the blocks L..1 in turn, then 0 is released. Each Acquire is followed by a Prefetch of the
// unit that comes next, so a source can move it while this one computes.
class Gpt2ParamSource {
 public:
  virtual ~Gpt2ParamSource() = default;
  // The fp32 weights of `unit`, (Gpt2UnitRange(unit).size(),), valid until Release(unit).
  virtual absl::StatusOr<const float*> Acquire(int unit) = 0;
  virtual void Release(int unit) = 0;
  // A hint that `unit` is acquired next.
  virtual void Prefetch(int unit) {}
};

// Where Backward writes the fp32 gradients, one unit at a time: into one flat buffer
// (FlatGpt2Grads), or into buffers that hold only the units still on their way (the trainer's
// gradient buckets, gpu_trainer/train/gradient_reducer.h). Backward acquires a unit before it
// writes into it and releases it once its gradient is final, in this order: 0 and L+1 acquired
// first (the tied head adds into wte at the start), L+1 released, each block L..1 acquired and
// released in turn, then 0 released. Release is where a unit is handed on.
class Gpt2GradSink {
 public:
  virtual ~Gpt2GradSink() = default;
  // Zeroed fp32 for the unit's gradient, (Gpt2UnitRange(unit).size(),), valid until Release.
  virtual absl::StatusOr<float*> Acquire(int unit) = 0;
  virtual absl::Status Release(int unit) = 0;
};

// Every unit is a view of one flat buffer grads (num_params,); Release reports the unit's range
// to on_ready(offset, n), which may be empty.
class FlatGpt2Grads final : public Gpt2GradSink {
 public:
  FlatGpt2Grads(const Gpt2Config& config, float* grads,
                std::function<void(int64_t offset, int64_t n)> on_ready);
  absl::StatusOr<float*> Acquire(int unit) override;
  absl::Status Release(int unit) override;

 private:
  const Gpt2Config config_;
  float* const grads_;
  const std::function<void(int64_t, int64_t)> on_ready_;
};

// Every unit is a view of one flat buffer params (num_params,) in layout order.
class FlatGpt2Params final : public Gpt2ParamSource {
 public:
  FlatGpt2Params(const Gpt2Config& config, const float* params);
  absl::StatusOr<const float*> Acquire(int unit) override;
  void Release(int unit) override {}

 private:
  const Gpt2Config config_;
  const float* const params_;
};

class Gpt2Cpu {
 public:
  // Activations for up to (max_batch, max_seq) in one allocation carved into views;
  // max_seq <= context_length. InvalidArgument for a bad config or size, ResourceExhausted when
  // the activations do not fit in memory.
  //
  // activation_checkpointing: Forward keeps only each block's input (the residual stream between
  // blocks), and Backward recomputes a block's forward just before its backward, with the same
  // kernels on the same inputs, so gradients are bit-identical to a plain run's. The per-layer
  // activations then take one layer's worth of memory instead of L layers'.
  static absl::StatusOr<std::unique_ptr<Gpt2Cpu>> Create(const Gpt2Config& config, int max_batch,
                                                         int max_seq, CpuKernelSet kernels,
                                                         bool activation_checkpointing = false);

  // Bytes Create would allocate for activations (no check of the sizes: Create does that).
  static int64_t ActivationBytes(const Gpt2Config& config, int max_batch, int max_seq,
                                 bool activation_checkpointing);

  const Gpt2Config& config() const { return config_; }
  bool activation_checkpointing() const { return checkpointing_; }
  int64_t num_params() const { return num_params_; }
  // Bytes of the one activation allocation (activations and their gradients).
  int64_t activation_bytes() const { return activation_floats_ * 4; }

  // params (num_params,) fp32 in layout order; inputs and targets (B, T) int32, B <= max_batch,
  // T <= max_seq. Token ids outside [0, vocab) -> InvalidArgument naming the position, nothing
  // computed and the previous Forward's state kept. targets may be nullptr (logits only, loss
  // returned as 0). Returns the mean cross-entropy loss over the B*T positions.
  absl::StatusOr<float> Forward(const float* params, const int32_t* inputs, const int32_t* targets,
                                int B, int T);
  // The same with the weights from `params`. A failed Acquire ends the call with its status after
  // the arguments were taken: the activations are then partly overwritten, and Backward is refused
  // until the next successful Forward with targets.
  absl::StatusOr<float> Forward(Gpt2ParamSource& params, const int32_t* inputs,
                                const int32_t* targets, int B, int T);

  // Requires a preceding Forward with targets (FailedPrecondition otherwise), and the same params.
  // Writes d(loss * loss_scale)/d(params) into grads (num_params,), overwriting it.
  //
  // on_ready(offset, n) is called on the calling thread each time a contiguous range of grads is
  // final, in backward order: [ln_f], [h.{L-1}.* whole layer], ..., [h.0.*], then [wte, wpe]
  // together (offset 0 up to the start of h.0) at the end, because the tied head and the embedding
  // both add into wte. The ranges cover [0, num_params) exactly once. on_ready may be empty.
  absl::Status Backward(const float* params, float loss_scale, float* grads,
                        const std::function<void(int64_t offset, int64_t n)>& on_ready);
  // The same with the gradients going unit by unit into `grads`.
  absl::Status Backward(Gpt2ParamSource& params, float loss_scale, Gpt2GradSink& grads);

  const float* logits() const { return acts_.logits; }  // (B, T, V) of the last Forward

 private:
  // What Forward saves for Backward, per layer with a leading (L) dimension, plus scratch reused
  // by every layer. Views into memory_, sized for (max_batch, max_seq); a call with a smaller
  // (B, T) packs each tensor densely at the start of its view. With activation checkpointing the
  // per-layer tensors but residual3 have a leading dimension of 1 (the layer being worked on).
  struct Activations {
    float* encoded;    // (B, T, C) wte + wpe, the residual stream entering layer 0
    float* ln1;        // (L, B, T, C)
    float* ln1_mean;   // (L, B, T)
    float* ln1_rstd;   // (L, B, T)
    float* qkv;        // (L, B, T, 3C)
    float* atty;       // (L, B, T, C) attention output, heads side by side
    float* att;        // (L, B, NH, T, T) softmax weights
    float* residual2;  // (L, B, T, C) stream after the attention branch
    float* ln2;        // (L, B, T, C)
    float* ln2_mean;   // (L, B, T)
    float* ln2_rstd;   // (L, B, T)
    float* fch;        // (L, B, T, 4C) MLP hidden, before GELU
    float* fch_gelu;   // (L, B, T, 4C)
    float* residual3;  // (L, B, T, C) stream after the MLP branch: layer output
    float* lnf;        // (B, T, C)
    float* lnf_mean;   // (B, T)
    float* lnf_rstd;   // (B, T)
    float* logits;     // (B, T, V)
    float* probs;      // (B, T, V)
    float* losses;     // (B, T)
    // Scratch: Backward needs neither, so one layer's worth serves all layers.
    float* preatt;  // (B, NH, T, T) scores before the softmax
    float* proj;    // (B, T, C) c_proj output before its residual add
  };
  // Gradients of activations. Backward walks one layer at a time, so one layer's worth is reused
  // by every layer; the residual stream's gradient is a single buffer that each block's two
  // branches add into, which is the whole of the residual add's backward.
  struct ActivationGrads {
    float* dlogits;    // (B, T, V)
    float* dlnf;       // (B, T, C)
    float* dresidual;  // (B, T, C) d loss / d stream, carried from ln_f down to the embedding
    float* dln1;       // (B, T, C)
    float* dqkv;       // (B, T, 3C)
    float* datty;      // (B, T, C)
    float* dpreatt;    // (B, NH, T, T) scratch
    float* datt;       // (B, NH, T, T) scratch
    float* dln2;       // (B, T, C)
    float* dfch;       // (B, T, 4C)
    float* dfch_gelu;  // (B, T, 4C)
  };

  Gpt2Cpu(const Gpt2Config& config, int max_batch, int max_seq, const CpuLayerKernels* kernels,
          bool activation_checkpointing);
  // Carves the activation views out of base (null: only counts); returns the floats used.
  static int64_t CarveActivations(const Gpt2Config& config, int max_batch, int max_seq,
                                  bool activation_checkpointing, float* base, Activations* a,
                                  ActivationGrads* g);
  // Block l's forward for the batch of the last Forward, from its input (the encoder's output or
  // block l-1's residual3) to its residual3; block (Gpt2UnitRange(l + 1).size(),) its weights.
  void BlockForward(int l, const float* block, int B, int T);
  // Where block l's saved activations live: l, or 0 under activation checkpointing.
  int64_t Slot(int l) const { return checkpointing_ ? 0 : l; }

  const Gpt2Config config_;
  const int max_batch_;
  const int max_seq_;
  const CpuLayerKernels* const kernels_;
  const bool checkpointing_;
  int64_t num_params_ = 0;
  std::vector<int64_t> tensor_offsets_;  // Gpt2ParamLayout(config_)[i].offset
  std::vector<int64_t> unit_begins_;     // Gpt2UnitRange(config_, u).begin
  std::unique_ptr<float[]> memory_;      // every Activations and ActivationGrads view
  int64_t activation_floats_ = 0;        // memory_'s length
  Activations acts_{};
  ActivationGrads grads_{};
  // The last Forward's batch, copied: Backward needs them and the caller's may be gone.
  std::vector<int32_t> inputs_;   // (B, T)
  std::vector<int32_t> targets_;  // (B, T)
  int B_ = 0;
  int T_ = 0;
  bool have_targets_ = false;  // the last Forward computed a loss, so Backward may run
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_MODEL_GPT2_H_
