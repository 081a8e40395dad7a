// The CUDA GPT-2's attention: which one runs, chosen once when the model is made
// (CudaModelOptions::attention, attention_kind.h), what it takes of the activation carve, and
// each layer's forward and backward through it.
//
// cuDNN's fused flash attention (cudnn/cudnn_attention.h) saves (B, NH, T) fp32 statistics per
// layer; the reference (blas/attention.h) saves the (B, NH, T, T) softmax. The choice is made
// before the activations are carved, because it decides what they hold: cuDNN's plans for
// (max_batch, max_seq) are built first and their workspace is carved with the rest. A later
// batch cuDNN cannot take (no plan for its shape, or one needing more workspace than was carved)
// runs the reference instead, in buffers allocated for it on first need, and says so once.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_GPT2_CUDA_ATTENTION_H_
#define OFFLOAD_GPU_TRAINER_CUDA_GPT2_CUDA_ATTENTION_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "gpu_trainer/cuda/blas/gemm.h"
#include "gpu_trainer/cuda/cudnn/attention_kind.h"
#include "gpu_trainer/cuda/cudnn/cudnn_attention.h"
#include "gpu_trainer/cuda/gpt2_cuda_buffers.h"
#include "gpu_trainer/cuda/runtime/device_buffer.h"
#include "model_spec/gpt2_config.h"

namespace offload {

template <typename T>
class Gpt2CudaAttention {
 public:
  // Chooses the attention and logs one line saying which and why. kAuto: cuDNN when it loads,
  // T is 16-bit, the shape suits its engines and both plans build at (max_batch, max_seq); the
  // reference otherwise. kCudnn: the same, but FailedPrecondition (with the reason) instead of
  // the reference. Call on the model's device, before the carve.
  absl::Status Init(AttentionKind kind, const Gpt2Config& config, int max_batch, int max_seq,
                    bool activation_checkpointing);
  // What the carve must hold for the chosen attention.
  AttentionMemory memory() const;
  // The carved views (after CarveGpt2CudaActivations with memory()).
  void Bind(const Gpt2CudaActivations<T>& a);

  // Layer `slot`'s attention of a (B, Tn) batch: atty (B, Tn, C) = attention(qkv (B, Tn, 3C)),
  // saving what Backward needs in slot `slot` (the layer, or 0 under checkpointing).
  absl::Status Forward(CublasLt& lt, int64_t slot, T* atty, const T* qkv, int B, int Tn,
                       cudaStream_t stream);
  // dqkv (B, Tn, 3C) = from datty (B, Tn, C), with what Forward saved in `slot` and its qkv and
  // atty.
  absl::Status Backward(CublasLt& lt, int64_t slot, T* dqkv, const T* datty, const T* qkv,
                        const T* atty, int B, int Tn, cudaStream_t stream);

  // "cudnn" or "reference": what Init chose (a batch may still fall back, see above).
  const char* path() const { return fused_ ? "cudnn" : "reference"; }
  // The line Init logged.
  const std::string& summary() const { return summary_; }
  // The cuDNN attention when chosen, else null (tests: plans_built).
  const CudnnAttention* cudnn() const { return cudnn_.get(); }

 private:
  // Tries cuDNN at (max_batch, max_seq): on success cudnn_ holds its plans and workspace_bytes_
  // what they need.
  absl::Status TryCudnn(int max_batch, int max_seq);
  // The reference's buffers for a (B, Tn) batch of a model carved for cuDNN.
  absl::Status EnsureFallback(int B, int Tn, cudaStream_t stream);
  // Whether this batch runs on cuDNN.
  bool Fused(int B, int Tn);

  Gpt2Config c_{};
  int layers_saved_ = 0;  // L, or 1 under checkpointing
  bool fused_ = false;
  std::string summary_;
  std::unique_ptr<CudnnAttention> cudnn_;
  int64_t workspace_bytes_ = 0;
  // The carved views: the statistics for cuDNN, the softmax and scratch for the reference.
  float* stats_ = nullptr;
  T* att_ = nullptr;
  T* scratch_ = nullptr;
  // The reference's buffers for batches cuDNN cannot take, allocated on first need.
  DeviceBuffer fallback_;
  int64_t fallback_att_elems_ = 0;  // (layers_saved_, B, NH, T, T) they were sized for
  int64_t fallback_scratch_elems_ = 0;
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_GPT2_CUDA_ATTENTION_H_
