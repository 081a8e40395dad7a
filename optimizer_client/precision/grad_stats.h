// Gradients leave the trainer as 16-bit values. This pass rounds them and, in the same pass,
// measures what the shards will see: the sum of squares for the global norm and whether any is
// inf or NaN (an fp16 overflow under loss scaling).
#ifndef OFFLOAD_OPTIMIZER_CLIENT_PRECISION_GRAD_STATS_H_
#define OFFLOAD_OPTIMIZER_CLIENT_PRECISION_GRAD_STATS_H_

#include <cstdint>

#include "base/dtype.h"

namespace offload {

struct GradStats {
  double sum_squares = 0;  // of the rounded values, still multiplied by the loss scale
  bool nonfinite = false;
  void Merge(const GradStats& o) {
    sum_squares += o.sum_squares;
    nonfinite = nonfinite || o.nonfinite;
  }
};

// grads (n,) fp32 * scale -> out (n,) fp16 or bf16 (round to nearest even), with their
// statistics. The scale (the mean over ranks) is applied in fp32 in the same pass.
GradStats RoundGradients(const float* grads, int64_t n, DType dtype, uint16_t* out,
                         float scale = 1.0f);

// The same statistics of gradients already rounded: g (n,) fp16 or bf16.
GradStats MeasureGradients16(const uint16_t* g, int64_t n, DType dtype);
// The same of fp32 sums of rounded gradients (a micro-batch accumulator): g (n,).
GradStats MeasureGradients32(const float* g, int64_t n);

// clip_coef of torch.nn.utils.clip_grad_norm_: min(1, max_norm / (norm + 1e-6)); 1 when
// max_norm <= 0 (clipping off).
float ClipCoefficient(double global_norm, float max_norm);

}  // namespace offload

#endif  // OFFLOAD_OPTIMIZER_CLIENT_PRECISION_GRAD_STATS_H_
