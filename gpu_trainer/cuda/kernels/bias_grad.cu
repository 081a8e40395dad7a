// Bias gradients as column sums through the shared two-pass scheme of column_partials.cuh.
#include <cstdint>

#include "gpu_trainer/cuda/kernels/bias_grad.h"
#include "gpu_trainer/cuda/kernels/column_partials.cuh"
#include "gpu_trainer/cuda/runtime/cuda_dtype.cuh"

namespace offload {
namespace {

// grid (column tiles, row chunks); partials (num_chunks, OC). Consecutive threads read
// consecutive columns of a row, so every row is one coalesced read per warp.
template <typename T>
__global__ void BiasGradPartialsKernel(float* partials, const T* dout, int N, int OC,
                                       int rows_per_chunk) {
  const int oc = blockIdx.x * blockDim.x + threadIdx.x;
  if (oc >= OC) return;
  const int chunk = blockIdx.y;
  const int row_begin = chunk * rows_per_chunk;
  const int row_end = min(N, row_begin + rows_per_chunk);
  float acc = 0.0f;
  for (int row = row_begin; row < row_end; ++row) acc += ToFloat(dout[int64_t{row} * OC + oc]);
  partials[int64_t{chunk} * OC + oc] = acc;
}

}  // namespace

int64_t BiasGradScratchFloats(int N, int OC) {
  return int64_t{column_partials::NumRowChunks(N)} * OC;
}

template <typename T>
cudaError_t BiasGrad(T* dbias, float* scratch, const T* dout, int N, int OC, cudaStream_t stream) {
  namespace cp = column_partials;
  if (OC == 0) return cudaSuccess;
  const int num_chunks = cp::NumRowChunks(N);
  if (num_chunks > 0) {
    const dim3 grid(CeilDiv(OC, cp::kColumnTile), num_chunks);
    BiasGradPartialsKernel<T>
        <<<grid, cp::kColumnTile, 0, stream>>>(scratch, dout, N, OC, cp::RowsPerChunk(N));
    const cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return error;
  }
  // With N == 0 this writes zeros: dbias is overwritten, and the sum over no rows is 0.
  return cp::SumChunkPartials<T>(dbias, nullptr, scratch, num_chunks, 1, OC, stream);
}

#define OFFLOAD_INSTANTIATE_BIAS_GRAD(T) \
  template cudaError_t BiasGrad<T>(T*, float*, const T*, int, int, cudaStream_t);
OFFLOAD_INSTANTIATE_FOR_STORAGE_TYPES(OFFLOAD_INSTANTIATE_BIAS_GRAD)

}  // namespace offload
