// The fused Adam/AdamW step on the GPU, per element the operation sequence of the CPU reference
// (cpu_optimizer_server/adam/adam_scalar.cc), so both give the same bits.
//
// Every rounding step is spelled with an IEEE round-to-nearest intrinsic (__fmul_rn, __fadd_rn,
// __fdiv_rn, __fsqrt_rn) or an explicit fmaf: those are never contracted or approximated,
// whatever -fmad, -prec-div, -prec-sqrt or -use_fast_math say. The file is also built with
// -fmad=false (CMakeLists.txt) so that nothing else in it fuses either. Denormals are kept: nvcc
// does not flush them unless told to (-ftz=true), and neither does the CPU reference.
#include <cstdint>

#include "base/adam/adam_math.h"
#include "gpu_trainer/cuda/kernels/elementwise_grid.cuh"
#include "gpu_trainer/cuda/optim/adamw.h"
#include "gpu_trainer/cuda/runtime/cuda_dtype.cuh"

namespace offload {
namespace {

// `s` by value: it lands in the kernel's constant parameter bank.
template <typename T>
__global__ void AdamWKernel(AdamStepScalars s, const T* grad, float* param, float* exp_avg,
                            float* exp_avg_sq, T* out, int64_t n) {
  const float neg_step_size = -s.step_size;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    float p = param[i];
    float g = __fmul_rn(ToFloat(grad[i]), s.grad_multiplier);
    // As the reference: no L2 term at all when it is 0, so an inf weight does not make g NaN.
    if (s.l2_weight_decay != 0.0f) g = fmaf(p, s.l2_weight_decay, g);
    p = __fmul_rn(p, s.decoupled_decay);
    const float m = fmaf(g, s.one_minus_beta1, __fmul_rn(exp_avg[i], s.beta1));
    const float v = fmaf(__fmul_rn(s.one_minus_beta2, g), g, __fmul_rn(exp_avg_sq[i], s.beta2));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bias_correction2_sqrt), s.eps);
    p = __fadd_rn(p, __fdiv_rn(__fmul_rn(neg_step_size, m), denom));
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (out != nullptr) out[i] = FromFloat<T>(p);
  }
}

}  // namespace

template <typename T>
cudaError_t AdamWUpdate(const AdamStepScalars& s, const T* grad, float* param, float* exp_avg,
                        float* exp_avg_sq, T* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  AdamWKernel<T><<<ElementwiseGrid(n), kElementwiseBlock, 0, stream>>>(s, grad, param, exp_avg,
                                                                       exp_avg_sq, out, n);
  return cudaGetLastError();
}

#define OFFLOAD_INSTANTIATE_ADAMW(T)                                                            \
  template cudaError_t AdamWUpdate<T>(const AdamStepScalars&, const T*, float*, float*, float*, \
                                      T*, int64_t, cudaStream_t);
OFFLOAD_INSTANTIATE_FOR_STORAGE_TYPES(OFFLOAD_INSTANTIATE_ADAMW)

}  // namespace offload
