// cuDNN's fused causal attention as backend operation graphs, made from sdpa_graph.h's layouts:
// the composite graphs the cuDNN frontend builds for its flash-attention path (cuDNN 9.19 has a
// unified SDPA operation but no causal mask on it), written out operation by operation:
//
//   forward   S = Q KT; S *= scale; causal mask (row index >= column index, else -inf);
//             softmax with statistics: M = max S, E = exp(S - M), Z = sum E,
//             Stats = M + log Z, P = E / Z (in the storage type); O = P V
//   backward  Dsum = sum(dO * O) (fp32, per row); S = Q KT * scale - Stats, masked; P = exp S;
//             dV = P^T dO; dS = (dO VT - Dsum) * P * scale; dK = dS^T Q; dQ = dS K (through an
//             fp32 accumulator)
//
// cuDNN's fused flash-attention engines recognise these patterns and run each graph as one
// kernel (two for backward); nothing (B, NH, T, T) is ever stored. Building the graph needs no
// GPU (cudnn_library_test builds both where cuDNN is installed); its plans do (cudnn_attention.h).
#ifndef OFFLOAD_GPU_TRAINER_CUDA_CUDNN_SDPA_BACKEND_GRAPH_H_
#define OFFLOAD_GPU_TRAINER_CUDA_CUDNN_SDPA_BACKEND_GRAPH_H_

#include <cudnn_graph.h>

#include <vector>

#include "absl/status/statusor.h"
#include "gpu_trainer/cuda/cudnn/cudnn_library.h"
#include "gpu_trainer/cuda/cudnn/sdpa_graph.h"

namespace offload {

// One backend descriptor, destroyed with its owner (move-only).
class CudnnDescriptor {
 public:
  CudnnDescriptor() = default;
  ~CudnnDescriptor() { Reset(); }
  CudnnDescriptor(CudnnDescriptor&& other) noexcept : lib_(other.lib_), desc_(other.desc_) {
    other.desc_ = nullptr;
  }
  CudnnDescriptor& operator=(CudnnDescriptor&& other) noexcept;
  CudnnDescriptor(const CudnnDescriptor&) = delete;
  CudnnDescriptor& operator=(const CudnnDescriptor&) = delete;

  static absl::StatusOr<CudnnDescriptor> Create(const CudnnLibrary& lib,
                                                cudnnBackendDescriptorType_t type);
  cudnnBackendDescriptor_t get() const { return desc_; }
  void Reset();

 private:
  const CudnnLibrary* lib_ = nullptr;
  cudnnBackendDescriptor_t desc_ = nullptr;
};

// A finalized operation graph and every descriptor it was made from: cuDNN documents no
// ownership of descriptors set as attributes, so all of them live as long as the graph does.
struct SdpaOperationGraph {
  std::vector<CudnnDescriptor> parts;  // tensors, operations and their descriptors
  CudnnDescriptor graph;
  int num_operations = 0;
};

// The by-value fp32 scalars the graphs name (sdpa_uid::kScale, kNegInf, kOne).
struct SdpaScalars {
  float scale = 1.0f;
  float neg_inf = 0.0f;
  float one = 1.0f;
};
// cuDNN before 9.10 wanted the lowest finite float as the mask's value, later ones -inf (as the
// frontend chooses).
SdpaScalars SdpaScalarValues(const SdpaLayout& layout, int64_t cudnn_version);

// Builds and finalizes the graph for `key` (forward or backward). handle: the cuDNN handle the
// graph's plans will run on; nullptr leaves the graph's (deprecated, optional since cuDNN 9)
// handle attribute unset, which is how a machine without a GPU builds it. Assumes
// SdpaUnsupportedReason(key's shape) == nullptr.
absl::StatusOr<SdpaOperationGraph> BuildSdpaOperationGraph(const CudnnLibrary& lib,
                                                           cudnnHandle_t handle,
                                                           const SdpaKey& key);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_CUDNN_SDPA_BACKEND_GRAPH_H_
