// Softmax cross-entropy over rows of up to ~50k logits: one block per row, each thread striding
// over the vocabulary in 16-byte vectors (vector_access.h), fp32 block reductions. Two reads of the
// row in the forward (max, then sum of exponentials) and one read-write pass in the backward; a row
// is at most ~100 KB, so the second read comes from L2.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "gpu_trainer/cuda/kernels/crossentropy.h"
#include "gpu_trainer/cuda/kernels/vector_access.h"
#include "gpu_trainer/cuda/runtime/cuda_dtype.cuh"

namespace offload {
namespace {

constexpr int kBlock = 512;

// Block-wide reductions; every thread gets the result. `shared` holds one value per warp and
// may be reused right away: the trailing barrier keeps the next call from overwriting it while
// a slow warp still reads.
__device__ float BlockMax(float x, float* shared) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  x = WarpMax(x);
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  x = lane < warps ? shared[lane] : -INFINITY;
  x = WarpMax(x);
  __syncthreads();
  return x;
}

__device__ float BlockSum(float x, float* shared) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  x = WarpSum(x);
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  x = lane < warps ? shared[lane] : 0.0f;
  x = WarpSum(x);
  __syncthreads();
  return x;
}

template <typename T>
__global__ void CrossEntropyForwardKernel(float* losses, float* lse, const T* logits, int64_t ld,
                                          const int32_t* targets, int V) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const T* logits_row = logits + row * ld;  // (V,) valid of (ld,)

  // 16-byte vectors when the row starts aligned (vector_access.h): the max is the same either
  // way, the sum of exponentials is added in another order (fp32).
  namespace va = vector_access;
  using Vec = Packed128<T>;
  const va::VectorSplit split = va::SplitVectors(V, Vec::kSize, va::IsAligned16(logits_row));
  const va::Stride threads = va::LaneStride(threadIdx.x, blockDim.x);
  float maxval = -INFINITY;
  va::ForEachShare(
      split, V, threads,
      [&](int64_t v) {
        const Vec x = Vec::Load(logits_row + v);
#pragma unroll
        for (int j = 0; j < Vec::kSize; ++j) maxval = fmaxf(maxval, ToFloat(x[j]));
      },
      [&](int64_t v) { maxval = fmaxf(maxval, ToFloat(logits_row[v])); });
  maxval = BlockMax(maxval, shared);
  float sum = 0.0f;
  va::ForEachShare(
      split, V, threads,
      [&](int64_t v) {
        const Vec x = Vec::Load(logits_row + v);
#pragma unroll
        for (int j = 0; j < Vec::kSize; ++j) sum += expf(ToFloat(x[j]) - maxval);
      },
      [&](int64_t v) { sum += expf(ToFloat(logits_row[v]) - maxval); });
  sum = BlockSum(sum, shared);

  if (threadIdx.x == 0) {
    const float log_sum = logf(sum);
    lse[row] = maxval + log_sum;
    const int32_t target = targets[row];
    // As the CPU reference: log(sum) - (x_target - max), which never subtracts two large
    // numbers. An out-of-range target yields NaN, not a read outside the row.
    losses[row] =
        target >= 0 && target < V ? log_sum - (ToFloat(logits_row[target]) - maxval) : NAN;
  }
}

template <typename T>
__global__ void CrossEntropyBackwardKernel(T* logits, const float* lse, const int32_t* targets,
                                           float dloss, int64_t ld, int V) {
  const int64_t row = blockIdx.x;
  T* row_ptr = logits + row * ld;  // (ld,): V logits, then padding
  const float row_lse = lse[row];
  const int32_t target = targets[row];
  // The padding columns get 0 so the head backward may read whole rows.
  auto grad = [&](int64_t v, T logit) {
    if (v >= V) return FromFloat<T>(0.0f);
    const float prob = expf(ToFloat(logit) - row_lse);
    return FromFloat<T>((prob - (v == target ? 1.0f : 0.0f)) * dloss);
  };
  // The whole padded row in 16-byte vectors when it starts aligned (vector_access.h); every
  // element's arithmetic as with single elements, so the same bits.
  namespace va = vector_access;
  using Vec = Packed128<T>;
  va::ForEachShare(
      va::SplitVectors(ld, Vec::kSize, va::IsAligned16(row_ptr)), ld,
      va::LaneStride(threadIdx.x, blockDim.x),
      [&](int64_t v) {
        Vec x = Vec::Load(row_ptr + v);
#pragma unroll
        for (int j = 0; j < Vec::kSize; ++j) x[j] = grad(v + j, x[j]);
        x.Store(row_ptr + v);
      },
      [&](int64_t v) { row_ptr[v] = grad(v, row_ptr[v]); });
}

}  // namespace

template <typename T>
cudaError_t CrossEntropyForward(float* losses, float* lse, const T* logits, int64_t ld,
                                const int32_t* targets, int N, int V, cudaStream_t stream) {
  if (N <= 0) return cudaSuccess;
  CrossEntropyForwardKernel<T><<<N, kBlock, 0, stream>>>(losses, lse, logits, ld, targets, V);
  return cudaGetLastError();
}

template <typename T>
cudaError_t CrossEntropyBackward(T* logits, const float* lse, const int32_t* targets, float dloss,
                                 int64_t ld, int N, int V, cudaStream_t stream) {
  if (N <= 0) return cudaSuccess;
  CrossEntropyBackwardKernel<T><<<N, kBlock, 0, stream>>>(logits, lse, targets, dloss, ld, V);
  return cudaGetLastError();
}

#define OFFLOAD_INSTANTIATE_CROSSENTROPY(T)                                                      \
  template cudaError_t CrossEntropyForward<T>(float*, float*, const T*, int64_t, const int32_t*, \
                                              int, int, cudaStream_t);                           \
  template cudaError_t CrossEntropyBackward<T>(T*, const float*, const int32_t*, float, int64_t, \
                                               int, int, cudaStream_t);
OFFLOAD_INSTANTIATE_FOR_STORAGE_TYPES(OFFLOAD_INSTANTIATE_CROSSENTROPY)
#undef OFFLOAD_INSTANTIATE_CROSSENTROPY

}  // namespace offload
