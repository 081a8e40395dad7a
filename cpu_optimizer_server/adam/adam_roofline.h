// The Adam pass against its memory roofline on n elements (ARCHITECTURE.md section 9): the fused
// kernel (16-bit grad in; fp32 p, m, v updated; 16-bit copy out) and the roofline kernel (the same
// loads and stores, one add per stream) alternate over the same buffers, tiled across a pool by
// ForEachOwnedTile, so drift of a shared machine hits both alike. bench_adam reports it per path
// and thread count; bench_gpu reports it for the offloaded model's parameter count, the host's
// share of an offload step.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_ADAM_ADAM_ROOFLINE_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_ADAM_ADAM_ROOFLINE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "base/thread_pool.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"

namespace offload {

// The Adam state of n elements: 16 bytes each (2 + 4 + 4 + 4 + 2), pages first touched by the
// pool worker that owns their tile.
class AdamRooflineBuffers {
 public:
  // RESOURCE_EXHAUSTED when the memory cannot be had.
  static absl::StatusOr<std::unique_ptr<AdamRooflineBuffers>> Allocate(int64_t n);
  ~AdamRooflineBuffers();
  AdamRooflineBuffers(const AdamRooflineBuffers&) = delete;
  AdamRooflineBuffers& operator=(const AdamRooflineBuffers&) = delete;

  int64_t n() const { return n_; }
  // Fills every stream with positive, moderate values (the roofline's `+= g` keeps them finite
  // and normal across passes), tile by tile on the pool: also the first touch. With bf16 state
  // the moments are bf16, in the first half of their fp32 buffers' bytes.
  void Fill(DType grad_dtype, ThreadPool& pool, DType state_dtype = DType::kFp32);
  AdamSpan Span(DType grad_dtype, int64_t lo, int64_t hi, DType state_dtype = DType::kFp32) const;

 private:
  AdamRooflineBuffers() = default;
  int64_t n_ = 0;
  uint16_t* grad_ = nullptr;     // (n,) fp16 or bf16
  float* param_ = nullptr;       // (n,)
  float* exp_avg_ = nullptr;     // (n,)
  float* exp_avg_sq_ = nullptr;  // (n,)
  uint16_t* out_ = nullptr;      // (n,) the 16-bit copy, same family as the gradients
};

struct AdamVsRoofline {
  double adam_s = 0;                                    // best pass
  double roofline_s = 0;                                // best pass
  double ratio() const { return roofline_s / adam_s; }  // > 1: faster than the roofline kernel
  // Every timed pass, in the order run, for medians and spreads.
  std::vector<double> adam_passes_s, roofline_passes_s;
};

// One warm-up pass of each, then `iters` alternating passes (best and every pass), over buffers
// Filled with grad_dtype and state_dtype (bf16 moments: stochastic rounding).
AdamVsRoofline MeasureAdamVsRoofline(const AdamRooflineBuffers& buffers, DType grad_dtype,
                                     SimdPath path, ThreadPool& pool, int iters,
                                     DType state_dtype = DType::kFp32);

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_ADAM_ADAM_ROOFLINE_H_
