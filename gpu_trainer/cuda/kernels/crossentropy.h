// Fused softmax + cross-entropy. The probabilities are never stored: the forward keeps only each
// row's log-sum-exp (fp32), and the backward recomputes softmax from the logits and that value,
// writing the logit gradients over the logits in the same pass.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_KERNELS_CROSSENTROPY_H_
#define OFFLOAD_GPU_TRAINER_CUDA_KERNELS_CROSSENTROPY_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace offload {

// logits (N, ld) with V valid columns; targets (N,) in [0, V). losses (N,) fp32 =
// lse - logits[target]; lse (N,) fp32 = log(sum_v exp(logits[v])), max-subtracted.
template <typename T>
cudaError_t CrossEntropyForward(float* losses, float* lse, const T* logits, int64_t ld,
                                const int32_t* targets, int N, int V, cudaStream_t stream);

// In place: logits (N, ld) := (exp(logits - lse) - onehot(targets)) * dloss for columns [0, V),
// and 0 in columns [V, ld). The gradient of dloss * sum(losses); for the mean loss scaled by s,
// dloss = s / N.
template <typename T>
cudaError_t CrossEntropyBackward(T* logits, const float* lse, const int32_t* targets, float dloss,
                                 int64_t ld, int N, int V, cudaStream_t stream);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_KERNELS_CROSSENTROPY_H_
