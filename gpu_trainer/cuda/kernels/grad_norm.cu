// Sum of squares and the inf/NaN check of gradients, deterministic: the grid depends on n only,
// each thread walks a fixed set of elements, and every reduction after that has a fixed shape.
//
// Squares are accumulated in double: the square of a widened fp16 or bf16 value is exact in
// double (and in fp32), that of an fp32 value exact in double, so a thread's sum only rounds in
// its additions, at 2^-53; over billions of elements that keeps the norm's relative error far
// below anything clipping could notice. A finite double sum of finite fp32 squares cannot
// overflow (needs > 10^231 elements), and squares are never negative, so a partial is inf or NaN
// exactly when one of its elements was: the flag comes from the partials, with no extra pass.
#include <algorithm>
#include <cstdint>

#include "gpu_trainer/cuda/kernels/grad_norm.h"
#include "gpu_trainer/cuda/runtime/cuda_dtype.cuh"

namespace offload {
namespace {

constexpr int kBlock = 256;
constexpr int kWarps = kBlock / 32;
// Enough threads to keep a large GPU's memory system busy (H100: 132 SMs x 2048 threads).
constexpr int kMaxBlocks = 1024;

__device__ __forceinline__ double WarpSumDouble(double x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// The sum over the block in a fixed order; valid in thread 0. blockDim.x == kBlock.
__device__ double BlockSumDouble(double x) {
  __shared__ double warp_sums[kWarps];
  x = WarpSumDouble(x);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = x;
  __syncthreads();
  double total = 0.0;
  if (threadIdx.x == 0) {
    for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
  }
  return total;
}

// partials (gridDim.x,): the sum of squares of the elements each block walked.
template <typename T>
__global__ void GradNormPartialsKernel(double* partials, const T* x, int64_t n) {
  double acc = 0.0;
  for (int64_t i = blockIdx.x * int64_t{kBlock} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * kBlock) {
    const double v = ToFloat(x[i]);
    acc += v * v;
  }
  const double total = BlockSumDouble(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// One block: adds the partials (thread k takes k, k + kBlock, ... in order, then the fixed block
// sum) into the result.
__global__ void GradNormFinishKernel(GradNormResult* result, const double* partials,
                                     int num_partials) {
  double acc = 0.0;
  for (int i = threadIdx.x; i < num_partials; i += kBlock) acc += partials[i];
  const double total = BlockSumDouble(acc);
  if (threadIdx.x == 0) {
    if (!isfinite(total)) result->nonfinite = 1;
    result->sum_squares += total;
  }
}

}  // namespace

int64_t GradNormScratchDoubles() { return kMaxBlocks; }

template <typename T>
cudaError_t GradNormAccumulate(GradNormResult* result, double* scratch, const T* x, int64_t n,
                               cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int blocks = static_cast<int>(std::min<int64_t>((n + kBlock - 1) / kBlock, kMaxBlocks));
  GradNormPartialsKernel<T><<<blocks, kBlock, 0, stream>>>(scratch, x, n);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  GradNormFinishKernel<<<1, kBlock, 0, stream>>>(result, scratch, blocks);
  return cudaGetLastError();
}

#define OFFLOAD_INSTANTIATE_GRAD_NORM(T)                                                  \
  template cudaError_t GradNormAccumulate<T>(GradNormResult*, double*, const T*, int64_t, \
                                             cudaStream_t);
OFFLOAD_INSTANTIATE_FOR_STORAGE_TYPES(OFFLOAD_INSTANTIATE_GRAD_NORM)

}  // namespace offload
