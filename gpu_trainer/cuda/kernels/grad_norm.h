// The gradient statistics of ARCHITECTURE.md section 1 over a partition on the GPU: the sum of
// squares (for the global norm) and whether any value is inf or NaN (an fp16 overflow under loss
// scaling). Deterministic: a fixed grid writes per-block partial sums, one block adds them in
// order, so the same gradients give the same norm bit for bit on the same GPU.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_KERNELS_GRAD_NORM_H_
#define OFFLOAD_GPU_TRAINER_CUDA_KERNELS_GRAD_NORM_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace offload {

// Lives on the device; the caller zeroes it (cudaMemsetAsync) before the first range of a step
// and copies it back after the last.
struct GradNormResult {
  double sum_squares;  // of the values as stored, still multiplied by the loss scale
  int nonfinite;       // 1 when any value was inf or NaN
};

// Doubles of scratch one GradNormAccumulate call needs (independent of n).
int64_t GradNormScratchDoubles();

// Adds the sum of squares of x (n,) to result->sum_squares and sets result->nonfinite if any
// element is inf or NaN. Calls on one stream may cover several ranges of a partition.
template <typename T>
cudaError_t GradNormAccumulate(GradNormResult* result, double* scratch, const T* x, int64_t n,
                               cudaStream_t stream);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_KERNELS_GRAD_NORM_H_
