// LayerNorm on the GPU. Rows are independent, so forward and the dinp part of backward give one
// warp to each row (GPT-2's C is a few hundred to a few thousand: a row stays in L1 between the
// passes over it). dweight and dbias reduce over rows, through column_partials.cuh's fixed
// two-pass scheme so they are deterministic.
#include <cstdint>

#include "gpu_trainer/cuda/kernels/column_partials.cuh"
#include "gpu_trainer/cuda/kernels/layernorm.h"
#include "gpu_trainer/cuda/kernels/vector_access.h"
#include "gpu_trainer/cuda/runtime/cuda_dtype.cuh"

namespace offload {
namespace {

constexpr float kEps = 1e-5f;
constexpr int kWarpsPerBlock = 4;

// The rows below are read and written in 16-byte vectors where the row's pointers (and weight
// and bias) are aligned, one element at a time otherwise and for each row's tail
// (vector_access.h). Lane l takes vectors l, l + 32, ..., so each lane's partial sums run over
// other elements, in another order, than with one element per lane per step: the row
// statistics may differ from the scalar kernel's in their last bits (fp32 sums; the parity tests'
// tolerances are far wider); the per-element arithmetic is unchanged.

// One warp per row; mean and the biased variance in two passes, as the CPU reference.
template <typename T>
__global__ void LayerNormForwardKernel(T* out, float* mean, float* rstd, const T* inp,
                                       const T* weight, const T* bias, int N, int C) {
  namespace va = vector_access;
  using Vec = Packed128<T>;
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= N) return;  // uniform over the warp, so the shuffles below see all 32 lanes
  const T* x = inp + int64_t{row} * C;  // (C,)
  T* out_row = out + int64_t{row} * C;  // (C,)
  // The same for every lane of the warp (one row), so the lanes never diverge on it.
  const va::VectorSplit split =
      va::SplitVectors(C, Vec::kSize,
                       va::IsAligned16(x) && va::IsAligned16(out_row) && va::IsAligned16(weight) &&
                           va::IsAligned16(bias));
  const va::Stride lanes = va::LaneStride(lane, 32);
  float sum = 0.0f;
  va::ForEachShare(
      split, C, lanes,
      [&](int64_t c) {
        const Vec xv = Vec::Load(x + c);
#pragma unroll
        for (int j = 0; j < Vec::kSize; ++j) sum += ToFloat(xv[j]);
      },
      [&](int64_t c) { sum += ToFloat(x[c]); });
  const float m = WarpSum(sum) / C;
  float sum_sq = 0.0f;
  va::ForEachShare(
      split, C, lanes,
      [&](int64_t c) {
        const Vec xv = Vec::Load(x + c);
#pragma unroll
        for (int j = 0; j < Vec::kSize; ++j) {
          const float shifted = ToFloat(xv[j]) - m;
          sum_sq += shifted * shifted;
        }
      },
      [&](int64_t c) {
        const float shifted = ToFloat(x[c]) - m;
        sum_sq += shifted * shifted;
      });
  const float v = WarpSum(sum_sq) / C;
  const float s = 1.0f / sqrtf(v + kEps);
  va::ForEachShare(
      split, C, lanes,
      [&](int64_t c) {
        const Vec xv = Vec::Load(x + c);
        const Vec wv = Vec::Load(weight + c);
        const Vec bv = Vec::Load(bias + c);
        Vec o;
#pragma unroll
        for (int j = 0; j < Vec::kSize; ++j) {
          o[j] = FromFloat<T>((s * (ToFloat(xv[j]) - m)) * ToFloat(wv[j]) + ToFloat(bv[j]));
        }
        o.Store(out_row + c);
      },
      [&](int64_t c) {
        out_row[c] =
            FromFloat<T>((s * (ToFloat(x[c]) - m)) * ToFloat(weight[c]) + ToFloat(bias[c]));
      });
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

// One warp per row: the two row means of the LayerNorm Jacobian, then dinp +=.
template <typename T>
__global__ void LayerNormBackwardDinpKernel(T* dinp, const T* dout, const T* inp, const T* weight,
                                            const float* mean, const float* rstd, int N, int C) {
  namespace va = vector_access;
  using Vec = Packed128<T>;
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= N) return;                         // uniform over the warp
  const T* dout_row = dout + int64_t{row} * C;  // (C,)
  const T* inp_row = inp + int64_t{row} * C;    // (C,)
  T* dinp_row = dinp + int64_t{row} * C;        // (C,)
  const float m = mean[row];
  const float s = rstd[row];
  const va::VectorSplit split =
      va::SplitVectors(C, Vec::kSize,
                       va::IsAligned16(dout_row) && va::IsAligned16(inp_row) &&
                           va::IsAligned16(dinp_row) && va::IsAligned16(weight));
  const va::Stride lanes = va::LaneStride(lane, 32);
  float dnorm_sum = 0.0f;
  float dnorm_norm_sum = 0.0f;
  auto accumulate = [&](float x, float w, float d) {
    const float norm = (x - m) * s;
    const float dnorm = w * d;
    dnorm_sum += dnorm;
    dnorm_norm_sum += dnorm * norm;
  };
  va::ForEachShare(
      split, C, lanes,
      [&](int64_t c) {
        const Vec xv = Vec::Load(inp_row + c);
        const Vec wv = Vec::Load(weight + c);
        const Vec dv = Vec::Load(dout_row + c);
#pragma unroll
        for (int j = 0; j < Vec::kSize; ++j) {
          accumulate(ToFloat(xv[j]), ToFloat(wv[j]), ToFloat(dv[j]));
        }
      },
      [&](int64_t c) {
        accumulate(ToFloat(inp_row[c]), ToFloat(weight[c]), ToFloat(dout_row[c]));
      });
  const float dnorm_mean = WarpSum(dnorm_sum) / C;
  const float dnorm_norm_mean = WarpSum(dnorm_norm_sum) / C;
  auto updated = [&](float dinp_old, float x, float w, float d) {
    const float norm = (x - m) * s;
    const float dnorm = w * d;
    return FromFloat<T>(dinp_old + (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s);
  };
  va::ForEachShare(
      split, C, lanes,
      [&](int64_t c) {
        const Vec xv = Vec::Load(inp_row + c);
        const Vec wv = Vec::Load(weight + c);
        const Vec dv = Vec::Load(dout_row + c);
        Vec g = Vec::Load(dinp_row + c);
#pragma unroll
        for (int j = 0; j < Vec::kSize; ++j) {
          g[j] = updated(ToFloat(g[j]), ToFloat(xv[j]), ToFloat(wv[j]), ToFloat(dv[j]));
        }
        g.Store(dinp_row + c);
      },
      [&](int64_t c) {
        dinp_row[c] = updated(ToFloat(dinp_row[c]), ToFloat(inp_row[c]), ToFloat(weight[c]),
                              ToFloat(dout_row[c]));
      });
}

// grid (column tiles, row chunks); partials (num_chunks, 2, C): dweight's sums, then dbias's.
template <typename T>
__global__ void LayerNormBackwardPartialsKernel(float* partials, const T* dout, const T* inp,
                                                const float* mean, const float* rstd, int N, int C,
                                                int rows_per_chunk) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int chunk = blockIdx.y;
  const int row_begin = chunk * rows_per_chunk;
  const int row_end = min(N, row_begin + rows_per_chunk);
  float dweight = 0.0f;
  float dbias = 0.0f;
  for (int row = row_begin; row < row_end; ++row) {
    const int64_t i = int64_t{row} * C + c;
    const float d = ToFloat(dout[i]);
    const float norm = (ToFloat(inp[i]) - mean[row]) * rstd[row];
    dbias += d;
    dweight += norm * d;
  }
  float* chunk_partials = partials + int64_t{chunk} * 2 * C;  // (2, C)
  chunk_partials[c] = dweight;
  chunk_partials[C + c] = dbias;
}

}  // namespace

template <typename T>
cudaError_t LayerNormForward(T* out, float* mean, float* rstd, const T* inp, const T* weight,
                             const T* bias, int N, int C, cudaStream_t stream) {
  if (N == 0 || C == 0) return cudaSuccess;
  LayerNormForwardKernel<T><<<CeilDiv(N, kWarpsPerBlock), kWarpsPerBlock * 32, 0, stream>>>(
      out, mean, rstd, inp, weight, bias, N, C);
  return cudaGetLastError();
}

int64_t LayerNormBackwardScratchFloats(int N, int C) {
  return int64_t{column_partials::NumRowChunks(N)} * 2 * C;
}

template <typename T>
cudaError_t LayerNormBackward(T* dinp, T* dweight, T* dbias, float* scratch, const T* dout,
                              const T* inp, const T* weight, const float* mean, const float* rstd,
                              int N, int C, cudaStream_t stream) {
  namespace cp = column_partials;
  if (C == 0) return cudaSuccess;
  const int num_chunks = cp::NumRowChunks(N);
  if (N > 0) {
    LayerNormBackwardDinpKernel<T><<<CeilDiv(N, kWarpsPerBlock), kWarpsPerBlock * 32, 0, stream>>>(
        dinp, dout, inp, weight, mean, rstd, N, C);
    cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return error;
    const dim3 grid(CeilDiv(C, cp::kColumnTile), num_chunks);
    LayerNormBackwardPartialsKernel<T><<<grid, cp::kColumnTile, 0, stream>>>(
        scratch, dout, inp, mean, rstd, N, C, cp::RowsPerChunk(N));
    error = cudaGetLastError();
    if (error != cudaSuccess) return error;
  }
  // With N == 0 this writes zeros: dweight and dbias are overwritten.
  return cp::SumChunkPartials<T>(dweight, dbias, scratch, num_chunks, 2, C, stream);
}

#define OFFLOAD_INSTANTIATE_LAYERNORM(T)                                                          \
  template cudaError_t LayerNormForward<T>(T*, float*, float*, const T*, const T*, const T*, int, \
                                           int, cudaStream_t);                                    \
  template cudaError_t LayerNormBackward<T>(T*, T*, T*, float*, const T*, const T*, const T*,     \
                                            const float*, const float*, int, int, cudaStream_t);
OFFLOAD_INSTANTIATE_FOR_STORAGE_TYPES(OFFLOAD_INSTANTIATE_LAYERNORM)

}  // namespace offload
