// Causal multi-head attention through cuDNN's fused flash-attention engines: forward saves only
// the softmax statistics, (B, NH, T) fp32, instead of the reference's (B, NH, T, T) weights, and
// backward recomputes the weights from them. Q, K, V are read in place from the QKV product's
// output and O is written where the output projection reads it (sdpa_graph.h), so nothing is
// permuted either way.
//
// One handle on the current device, and one execution plan per shape, storage type and
// direction, made the first time it is asked for (operation graph, heuristics, the first engine
// configuration that finalizes) and kept. The workspace is the caller's: the model carves it
// with its activations, sized by Prepare at (max_batch, max_seq) before the carve.
//
// No cuDNN types in this header: the model includes it whether or not cuDNN's headers were
// there at build time (without them, Create says so and the model runs its reference).
#ifndef OFFLOAD_GPU_TRAINER_CUDA_CUDNN_CUDNN_ATTENTION_H_
#define OFFLOAD_GPU_TRAINER_CUDA_CUDNN_CUDNN_ATTENTION_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/dtype.h"

namespace offload {

class CudnnAttention {
 public:
  // Loads cuDNN (CudnnLibrary::Shared) and creates a handle on the current device. Unavailable
  // when cuDNN is not there (or this build had no cuDNN headers), InvalidArgument for a storage
  // type cuDNN's fused attention does not take (fp32).
  static absl::StatusOr<std::unique_ptr<CudnnAttention>> Create(DType dtype);
  ~CudnnAttention();

  // cuDNN's version (e.g. 91900).
  int64_t version() const;
  DType dtype() const;

  // Makes (once) the forward and backward plans for the shape and returns the workspace bytes
  // the larger of the two needs, backward's fp32 accumulators included. Unimplemented when the
  // shape is outside what the engines take (sdpa_graph.h's SdpaUnsupportedReason) or no engine
  // takes the graph; the outcome, failure included, is kept, so asking again costs a lookup.
  absl::StatusOr<int64_t> Prepare(int B, int T, int C, int NH);

  // The workspace every later call uses: `bytes` at `workspace` on the device, 256-byte aligned.
  void SetWorkspace(void* workspace, int64_t bytes);

  // Whether (B, T, C, NH) runs here: Prepare succeeded and its workspace fits in the one set.
  // The first "no" for a shape logs one line saying why.
  bool Supports(int B, int T, int C, int NH);

  // qkv (B, T, 3C) as the model lays it out; out (B, T, C) =; stats (B, NH, T) fp32 =, kept for
  // Backward. Queued on `stream`. FailedPrecondition when !Supports(...).
  absl::Status Forward(void* out, float* stats, const void* qkv, int B, int T, int C, int NH,
                       cudaStream_t stream);
  // dqkv (B, T, 3C) =; dout (B, T, C); qkv, out and stats as Forward left them.
  absl::Status Backward(void* dqkv, const void* dout, const void* qkv, const void* out,
                        const float* stats, int B, int T, int C, int NH, cudaStream_t stream);

  // Execution plans made so far (tests: a second call with the same shape makes none).
  int plans_built() const;

  class Impl;

 private:
  explicit CudnnAttention(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_CUDNN_CUDNN_ATTENTION_H_
