// Token + position embedding on the GPU. The backward reads the host-built token buckets
// (token_buckets.cc) so that every row of dwte has exactly one writer, which sums its positions
// in a fixed order: deterministic, and one rounding per row instead of one per position.
#include <cstdint>

#include "gpu_trainer/cuda/kernels/elementwise_grid.cuh"
#include "gpu_trainer/cuda/kernels/encoder.h"
#include "gpu_trainer/cuda/runtime/cuda_dtype.cuh"

namespace offload {
namespace {

// Threads per dwte block: one per channel of a tile; a tile of 128 wastes little for GPT-2's C.
constexpr int kChannelTile = 128;

template <typename T>
__global__ void EncoderForwardKernel(T* out, const int32_t* inp, const T* wte, const T* wpe, int Tn,
                                     int C, int64_t total) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t bt = i / C;
    const int c = static_cast<int>(i - bt * C);
    const int t = static_cast<int>(bt % Tn);
    const int64_t token = inp[bt];
    out[i] = FromFloat<T>(ToFloat(wte[token * C + c]) + ToFloat(wpe[int64_t{t} * C + c]));
  }
}

// grid (num_buckets, channel tiles). Starts from the row's current value and adds the positions
// in ascending order, the order of the CPU reference's loop, then rounds once.
template <typename T>
__global__ void EncoderBackwardWteKernel(T* dwte, const T* dout, const int32_t* bucket_tokens,
                                         const int32_t* bucket_offsets,
                                         const int32_t* bucket_positions, int C) {
  const int u = blockIdx.x;
  const int c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int begin = bucket_offsets[u];
  const int end = bucket_offsets[u + 1];
  T* dwte_row = dwte + int64_t{bucket_tokens[u]} * C;  // (C,)
  float acc = ToFloat(dwte_row[c]);
  for (int k = begin; k < end; ++k) acc += ToFloat(dout[int64_t{bucket_positions[k]} * C + c]);
  dwte_row[c] = FromFloat<T>(acc);
}

// One thread per element of dwpe (maxT, C): rows t < T sum dout[:, t] in b order, the rest are 0.
template <typename T>
__global__ void EncoderBackwardWpeKernel(T* dwpe, const T* dout, int B, int Tn, int C,
                                         int64_t total) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / C;
    const int c = static_cast<int>(i - t * C);
    float acc = 0.0f;
    if (t < Tn) {
      for (int b = 0; b < B; ++b) acc += ToFloat(dout[(int64_t{b} * Tn + t) * C + c]);
    }
    dwpe[i] = FromFloat<T>(acc);
  }
}

}  // namespace

template <typename T>
cudaError_t EncoderForward(T* out, const int32_t* inp, const T* wte, const T* wpe, int B, int Tn,
                           int C, cudaStream_t stream) {
  const int64_t total = int64_t{B} * Tn * C;
  if (total == 0) return cudaSuccess;
  EncoderForwardKernel<T>
      <<<ElementwiseGrid(total), kElementwiseBlock, 0, stream>>>(out, inp, wte, wpe, Tn, C, total);
  return cudaGetLastError();
}

template <typename T>
cudaError_t EncoderBackward(T* dwte, T* dwpe, const T* dout, const int32_t* bucket_tokens,
                            const int32_t* bucket_offsets, const int32_t* bucket_positions,
                            int num_buckets, int B, int Tn, int maxT, int C, cudaStream_t stream) {
  if (C == 0) return cudaSuccess;
  if (num_buckets > 0) {
    const dim3 grid(num_buckets, CeilDiv(C, kChannelTile));
    EncoderBackwardWteKernel<T><<<grid, kChannelTile, 0, stream>>>(
        dwte, dout, bucket_tokens, bucket_offsets, bucket_positions, C);
    const cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return error;
  }
  // Even with an empty batch: dwpe is overwritten, so its rows must become zero.
  const int64_t wpe_total = int64_t{maxT} * C;
  if (wpe_total == 0) return cudaSuccess;
  EncoderBackwardWpeKernel<T><<<ElementwiseGrid(wpe_total), kElementwiseBlock, 0, stream>>>(
      dwpe, dout, B, Tn, C, wpe_total);
  return cudaGetLastError();
}

#define OFFLOAD_INSTANTIATE_ENCODER(T)                                                          \
  template cudaError_t EncoderForward<T>(T*, const int32_t*, const T*, const T*, int, int, int, \
                                         cudaStream_t);                                         \
  template cudaError_t EncoderBackward<T>(T*, T*, const T*, const int32_t*, const int32_t*,     \
                                          const int32_t*, int, int, int, int, int, cudaStream_t);
OFFLOAD_INSTANTIATE_FOR_STORAGE_TYPES(OFFLOAD_INSTANTIATE_ENCODER)

}  // namespace offload
