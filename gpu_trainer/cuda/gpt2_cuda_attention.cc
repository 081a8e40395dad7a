#include "gpu_trainer/cuda/gpt2_cuda_attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "gpu_trainer/cuda/blas/attention.h"
#include "gpu_trainer/cuda/cudnn/sdpa_graph.h"
#include "gpu_trainer/cuda/runtime/cuda_check.h"
#include "gpu_trainer/cuda/runtime/storage_type.h"

namespace offload {

template <typename T>
absl::Status Gpt2CudaAttention<T>::Init(AttentionKind kind, const Gpt2Config& config, int max_batch,
                                        int max_seq, bool activation_checkpointing) {
  c_ = config;
  layers_saved_ = activation_checkpointing ? 1 : config.num_layers;
  if (kind == AttentionKind::kReference) {
    fused_ = false;
    summary_ = "attention: reference (the options ask for it)";
  } else {
    const absl::Status cudnn = TryCudnn(max_batch, max_seq);
    if (cudnn.ok()) {
      fused_ = true;
      summary_ = absl::StrCat("attention: cuDNN ", cudnn_->version(),
                              " fused flash attention (workspace ", workspace_bytes_ >> 10,
                              " KiB at batch ", max_batch, " x sequence ", max_seq, ")");
    } else if (kind == AttentionKind::kCudnn) {
      return absl::FailedPreconditionError(
          absl::StrCat("attention = cudnn, but cuDNN's fused attention cannot run this model: ",
                       cudnn.message()));
    } else {
      cudnn_.reset();
      fused_ = false;
      summary_ = absl::StrCat("attention: reference (", cudnn.message(), ")");
    }
  }
  LOG(INFO) << summary_;
  return absl::OkStatus();
}

template <typename T>
absl::Status Gpt2CudaAttention<T>::TryCudnn(int max_batch, int max_seq) {
  OFFLOAD_ASSIGN_OR_RETURN(cudnn_, CudnnAttention::Create(StorageDType<T>()));
  OFFLOAD_ASSIGN_OR_RETURN(workspace_bytes_,
                           cudnn_->Prepare(max_batch, max_seq, c_.channels, c_.num_heads));
  return absl::OkStatus();
}

template <typename T>
AttentionMemory Gpt2CudaAttention<T>::memory() const {
  AttentionMemory m;
  m.fused = fused_;
  m.cudnn_workspace_bytes = fused_ ? workspace_bytes_ : 0;
  return m;
}

template <typename T>
void Gpt2CudaAttention<T>::Bind(const Gpt2CudaActivations<T>& a) {
  stats_ = a.att_lse;
  att_ = a.att;
  scratch_ = a.attn_scratch;
  if (fused_) cudnn_->SetWorkspace(a.cudnn_workspace, a.cudnn_bytes);
}

template <typename T>
bool Gpt2CudaAttention<T>::Fused(int B, int Tn) {
  return fused_ && cudnn_->Supports(B, Tn, c_.channels, c_.num_heads);
}

template <typename T>
absl::Status Gpt2CudaAttention<T>::EnsureFallback(int B, int Tn, cudaStream_t stream) {
  const int64_t att_elems = int64_t{layers_saved_} * B * c_.num_heads * Tn * Tn;
  const int64_t scratch_elems = AttentionScratchElems(B, Tn, c_.channels, c_.num_heads);
  if (att_elems <= fallback_att_elems_ && scratch_elems <= fallback_scratch_elems_) {
    return absl::OkStatus();
  }
  // Nothing queued may still use the old buffers when they are freed.
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  BufferCarver measure(nullptr);
  measure.Take<T>(att_elems);
  measure.Take<T>(scratch_elems);
  OFFLOAD_RETURN_IF_ERROR(fallback_.Allocate(measure.bytes(), "reference attention fallback"));
  fallback_att_elems_ = att_elems;
  fallback_scratch_elems_ = scratch_elems;
  return absl::OkStatus();
}

template <typename T>
absl::Status Gpt2CudaAttention<T>::Forward(CublasLt& lt, int64_t slot, T* atty, const T* qkv, int B,
                                           int Tn, cudaStream_t stream) {
  const int C = c_.channels, NH = c_.num_heads;
  if (Fused(B, Tn)) {
    float* stats = stats_ + slot * SdpaStatsLayerFloats(B, NH, Tn);  // (B, NH, T)
    return cudnn_->Forward(atty, stats, qkv, B, Tn, C, NH, stream);
  }
  T* att = att_;  // (layers_saved_, B, NH, T, T)
  T* scratch = scratch_;
  if (fused_) {
    OFFLOAD_RETURN_IF_ERROR(EnsureFallback(B, Tn, stream));
    BufferCarver carver(fallback_.data());
    att = carver.Take<T>(fallback_att_elems_);
    scratch = carver.Take<T>(fallback_scratch_elems_);
  }
  att += slot * B * NH * Tn * Tn;  // (B, NH, T, T)
  return AttentionForward<T>(lt, atty, att, scratch, qkv, B, Tn, C, NH, stream);
}

template <typename T>
absl::Status Gpt2CudaAttention<T>::Backward(CublasLt& lt, int64_t slot, T* dqkv, const T* datty,
                                            const T* qkv, const T* atty, int B, int Tn,
                                            cudaStream_t stream) {
  const int C = c_.channels, NH = c_.num_heads;
  if (Fused(B, Tn)) {
    const float* stats = stats_ + slot * SdpaStatsLayerFloats(B, NH, Tn);  // (B, NH, T)
    return cudnn_->Backward(dqkv, datty, qkv, atty, stats, B, Tn, C, NH, stream);
  }
  const T* att = att_;
  T* scratch = scratch_;
  if (fused_) {
    // Forward ran this batch on the reference too, so the buffers are there and sized for it.
    OFFLOAD_RETURN_IF_ERROR(EnsureFallback(B, Tn, stream));
    BufferCarver carver(fallback_.data());
    att = carver.Take<T>(fallback_att_elems_);
    scratch = carver.Take<T>(fallback_scratch_elems_);
  }
  att += slot * B * NH * Tn * Tn;  // (B, NH, T, T)
  return AttentionBackward<T>(lt, dqkv, scratch, datty, qkv, att, B, Tn, C, NH, stream);
}

template class Gpt2CudaAttention<float>;
template class Gpt2CudaAttention<__half>;
template class Gpt2CudaAttention<__nv_bfloat16>;

}  // namespace offload
