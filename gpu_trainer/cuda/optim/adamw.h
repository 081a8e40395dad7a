// Fused Adam/AdamW over flat fp32 state on the GPU: the no-offload baseline that offload is
// measured against. The same operations in the same order as the CPU reference
// (cpu_optimizer_server/adam/adam_scalar.cc, compiled without FMA contraction, explicit fmaf where
// it has std::fma), so the GPU result equals the CPU one bit for bit.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_OPTIM_ADAMW_H_
#define OFFLOAD_GPU_TRAINER_CUDA_OPTIM_ADAMW_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "base/adam/adam_math.h"

namespace offload {

// grad (n,) in T; param, exp_avg, exp_avg_sq (n,) fp32, updated in place; out (n,) the updated
// weights rounded to T (may be nullptr). `s` from ComputeAdamStepScalars.
template <typename T>
cudaError_t AdamWUpdate(const AdamStepScalars& s, const T* grad, float* param, float* exp_avg,
                        float* exp_avg_sq, T* out, int64_t n, cudaStream_t stream);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_OPTIM_ADAMW_H_
