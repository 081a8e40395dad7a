// The deterministic column reduction behind BiasGrad and LayerNormBackward's dweight/dbias: the
// rows are cut into a fixed set of chunks, a first kernel (each caller's own) writes one fp32
// partial per (chunk, column) by summing its chunk's rows in order, and SumChunkPartials adds the
// partials in chunk order and rounds once. The chunking depends on N only, never on the device,
// so the same inputs give the same bits on any GPU; no atomics anywhere.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_KERNELS_COLUMN_PARTIALS_CUH_
#define OFFLOAD_GPU_TRAINER_CUDA_KERNELS_COLUMN_PARTIALS_CUH_

#include <algorithm>
#include <cstdint>

#include "gpu_trainer/cuda/runtime/cuda_dtype.cuh"

namespace offload {
namespace column_partials {

// Enough chunks to fill a large GPU when there are few columns, few enough that the second pass
// is short and the scratch small (kMaxChunks * C floats per output).
constexpr int kMinRowsPerChunk = 16;
constexpr int kMaxChunks = 256;
// Threads per block of a first pass, one per column of a tile.
constexpr int kColumnTile = 128;

inline int NumRowChunks(int N) {
  return static_cast<int>(std::min<int64_t>(CeilDiv(N, kMinRowsPerChunk), kMaxChunks));
}

// Chunk `chunk` covers rows [chunk * RowsPerChunk, min(N, (chunk + 1) * RowsPerChunk)); trailing
// chunks may be empty and then contribute zero partials.
inline int RowsPerChunk(int N) { return N == 0 ? 0 : CeilDiv(N, NumRowChunks(N)); }

// partials (num_chunks, num_outputs, C); out0 (C) = the sums of output 0, out1 (C) those of
// output 1 (nullptr when num_outputs == 1). One thread per (output, column); num_chunks == 0
// writes zeros.
template <typename T>
__global__ void SumChunkPartialsKernel(T* out0, T* out1, const float* partials, int num_chunks,
                                       int num_outputs, int C) {
  const int width = num_outputs * C;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= width) return;
  float acc = 0.0f;
  // Unrolled so that several loads are in flight; the additions stay in chunk order.
#pragma unroll 8
  for (int chunk = 0; chunk < num_chunks; ++chunk) acc += partials[int64_t{chunk} * width + j];
  if (j < C) {
    out0[j] = FromFloat<T>(acc);
  } else {
    out1[j - C] = FromFloat<T>(acc);
  }
}

// C > 0.
template <typename T>
cudaError_t SumChunkPartials(T* out0, T* out1, const float* partials, int num_chunks,
                             int num_outputs, int C, cudaStream_t stream) {
  constexpr int kBlock = 256;
  const int width = num_outputs * C;
  SumChunkPartialsKernel<T><<<CeilDiv(width, kBlock), kBlock, 0, stream>>>(
      out0, out1, partials, num_chunks, num_outputs, C);
  return cudaGetLastError();
}

}  // namespace column_partials
}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_KERNELS_COLUMN_PARTIALS_CUH_
