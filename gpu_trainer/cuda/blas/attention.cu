// Attention as llm.c's train_gpt2.cu computes it: heads split out of qkv into contiguous
// (B, NH, T, hs) blocks so each (batch, head) pair is one matrix of a strided-batched product,
// softmax and its backward in fp32 one warp per row, and the heads merged back.
//
// Row-major (T, hs) per-head matrices are column-major (hs, T) ones with ld hs, which is how the
// products below are written (see matmul.cc for the general rule).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "gpu_trainer/cuda/blas/attention.h"
#include "gpu_trainer/cuda/blas/gemm.h"
#include "gpu_trainer/cuda/runtime/cuda_check.h"
#include "gpu_trainer/cuda/runtime/cuda_dtype.cuh"

namespace offload {
namespace {

constexpr int kBlock = 256;
constexpr int kWarpsPerBlock = kBlock / 32;

// Scratch regions start 256 bytes apart at least (128 elements of 2 or 4 bytes), so every
// product operand is as aligned as the scratch base.
int64_t PaddedElems(int64_t n) { return (n + 127) / 128 * 128; }

// dst (B, NH, T, hs) = the heads of src, a (B, T, *) tensor whose rows are ld elements apart and
// whose head h occupies [h*hs, (h+1)*hs) from src.
template <typename T>
__global__ void SplitHeadsKernel(T* dst, const T* src, int64_t ld, int B, int Tn, int NH, int hs) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t total = static_cast<int64_t>(B) * NH * Tn * hs;
  if (idx >= total) return;
  const int i = static_cast<int>(idx % hs);
  const int t = static_cast<int>((idx / hs) % Tn);
  const int h = static_cast<int>((idx / (static_cast<int64_t>(hs) * Tn)) % NH);
  const int64_t b = idx / (static_cast<int64_t>(hs) * Tn * NH);
  dst[idx] = src[(b * Tn + t) * ld + static_cast<int64_t>(h) * hs + i];
}

// The inverse: dst, a (B, T, *) tensor with rows ld apart, gets src (B, NH, T, hs) with head h
// in [h*hs, (h+1)*hs). Indexed by the source so reads and writes both run along hs.
template <typename T>
__global__ void MergeHeadsKernel(T* dst, const T* src, int64_t ld, int B, int Tn, int NH, int hs) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t total = static_cast<int64_t>(B) * NH * Tn * hs;
  if (idx >= total) return;
  const int i = static_cast<int>(idx % hs);
  const int t = static_cast<int>((idx / hs) % Tn);
  const int h = static_cast<int>((idx / (static_cast<int64_t>(hs) * Tn)) % NH);
  const int64_t b = idx / (static_cast<int64_t>(hs) * Tn * NH);
  dst[(b * Tn + t) * ld + static_cast<int64_t>(h) * hs + i] = src[idx];
}

// In place over att (rows, T), rows = B * NH * T, each row holding the already scaled scores of
// query t = row % T against every key: the causal softmax over keys 0..t, zeros after. One warp
// per row, fp32 inside; each lane rewrites only what it read, so in place is safe.
template <typename T>
__global__ void CausalSoftmaxKernel(T* att, int64_t rows, int Tn) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps leave together: row is uniform across a warp
  const int t = static_cast<int>(row % Tn);
  T* att_row = att + row * Tn;  // (T,)

  float maxval = -INFINITY;
  for (int t2 = lane; t2 <= t; t2 += 32) maxval = fmaxf(maxval, ToFloat(att_row[t2]));
  maxval = WarpMax(maxval);
  float sum = 0.0f;
  for (int t2 = lane; t2 <= t; t2 += 32) sum += expf(ToFloat(att_row[t2]) - maxval);
  sum = WarpSum(sum);
  const float inv_sum = 1.0f / sum;
  for (int t2 = lane; t2 < Tn; t2 += 32) {
    const float p = t2 <= t ? expf(ToFloat(att_row[t2]) - maxval) * inv_sum : 0.0f;
    att_row[t2] = FromFloat<T>(p);
  }
}

// In place over datt (rows, T) with the saved att (rows, T): dpreatt = att * (datt - sum(att *
// datt)) * scale over keys 0..t, zeros after (the products that follow read whole rows, and
// datt above the diagonal is not zero). The scale of the scores is folded in here once.
template <typename T>
__global__ void CausalSoftmaxBackwardKernel(T* datt, const T* att, int64_t rows, int Tn,
                                            float scale) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int t = static_cast<int>(row % Tn);
  T* datt_row = datt + row * Tn;      // (T,)
  const T* att_row = att + row * Tn;  // (T,)

  float dot = 0.0f;
  for (int t2 = lane; t2 <= t; t2 += 32) dot += ToFloat(att_row[t2]) * ToFloat(datt_row[t2]);
  dot = WarpSum(dot);
  for (int t2 = lane; t2 < Tn; t2 += 32) {
    const float d = t2 <= t ? ToFloat(att_row[t2]) * (ToFloat(datt_row[t2]) - dot) * scale : 0.0f;
    datt_row[t2] = FromFloat<T>(d);
  }
}

template <typename T>
absl::Status SplitHeads(T* dst, const T* src, int64_t ld, int B, int Tn, int NH, int hs,
                        cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(B) * NH * Tn * hs;
  SplitHeadsKernel<T><<<CeilDiv(total, kBlock), kBlock, 0, stream>>>(dst, src, ld, B, Tn, NH, hs);
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

template <typename T>
absl::Status MergeHeads(T* dst, const T* src, int64_t ld, int B, int Tn, int NH, int hs,
                        cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(B) * NH * Tn * hs;
  MergeHeadsKernel<T><<<CeilDiv(total, kBlock), kBlock, 0, stream>>>(dst, src, ld, B, Tn, NH, hs);
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

// One strided batch of B * NH per-head products, every operand packed (B, NH, rows, cols).
GemmSpec HeadBatchSpec(bool trans_a, bool trans_b, int m, int n, int k, const void* a, int64_t lda,
                       int64_t stride_a, const void* b, int64_t ldb, int64_t stride_b, void* c,
                       int64_t ldc, int64_t stride_c, float alpha, int batch) {
  GemmSpec spec;
  spec.trans_a = trans_a;
  spec.trans_b = trans_b;
  spec.m = m;
  spec.n = n;
  spec.k = k;
  spec.a = a;
  spec.lda = lda;
  spec.stride_a = stride_a;
  spec.b = b;
  spec.ldb = ldb;
  spec.stride_b = stride_b;
  spec.c = c;
  spec.ldc = ldc;
  spec.stride_c = stride_c;
  spec.alpha = alpha;
  spec.beta = 0.0f;
  spec.batch = batch;
  return spec;
}

absl::Status CheckShape(int B, int Tn, int C, int NH) {
  if (B <= 0 || Tn <= 0 || C <= 0 || NH <= 0 || C % NH != 0) {
    return absl::InvalidArgumentError(absl::StrCat("attention: bad shape B=", B, " T=", Tn,
                                                   " C=", C, " NH=", NH,
                                                   " (all positive, C a multiple of NH)"));
  }
  return absl::OkStatus();
}

}  // namespace

// Forward: q, k, v, y, each (B, NH, T, hs). Backward: q, k, v, dout permuted (the same four
// regions, reused for dq, dk, dv), then datt (B, NH, T, T).
int64_t AttentionScratchElems(int B, int Tn, int C, int NH) {
  const int64_t btc = PaddedElems(static_cast<int64_t>(B) * Tn * C);
  return 4 * btc + static_cast<int64_t>(B) * NH * Tn * Tn;
}

template <typename T>
absl::Status AttentionForward(CublasLt& lt, T* out, T* att, T* scratch, const T* qkv, int B, int Tn,
                              int C, int NH, cudaStream_t stream) {
  OFFLOAD_RETURN_IF_ERROR(CheckShape(B, Tn, C, NH));
  const int hs = C / NH;
  const int batch = B * NH;
  const int64_t btc = PaddedElems(static_cast<int64_t>(B) * Tn * C);
  const int64_t head = static_cast<int64_t>(Tn) * hs;  // elements of one (T, hs) head matrix
  const int64_t square = static_cast<int64_t>(Tn) * Tn;
  T* q = scratch;            // (B, NH, T, hs)
  T* k = scratch + btc;      // (B, NH, T, hs)
  T* v = scratch + 2 * btc;  // (B, NH, T, hs)
  T* y = scratch + 3 * btc;  // (B, NH, T, hs)

  const int64_t ld_qkv = 3 * static_cast<int64_t>(C);
  OFFLOAD_RETURN_IF_ERROR(SplitHeads(q, qkv, ld_qkv, B, Tn, NH, hs, stream));
  OFFLOAD_RETURN_IF_ERROR(SplitHeads(k, qkv + C, ld_qkv, B, Tn, NH, hs, stream));
  OFFLOAD_RETURN_IF_ERROR(SplitHeads(v, qkv + 2 * C, ld_qkv, B, Tn, NH, hs, stream));

  // att (T, T) = q @ k^T * scale, as att^T = k @ q^T column-major: k stored (hs, T) is
  // transposed, q stored (hs, T) is q^T already. The scale rides on alpha, so the scores are
  // rounded to T once, already scaled; the whole square is computed and the softmax masks it.
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  OFFLOAD_RETURN_IF_ERROR(Gemm<T>(lt,
                                  HeadBatchSpec(true, false, Tn, Tn, hs, k, hs, head, q, hs, head,
                                                att, Tn, square, scale, batch),
                                  stream));
  const int64_t rows = static_cast<int64_t>(batch) * Tn;
  CausalSoftmaxKernel<T><<<CeilDiv(rows, kWarpsPerBlock), kBlock, 0, stream>>>(att, rows, Tn);
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());

  // y (T, hs) = att @ v, as y^T (hs, T) = v^T (hs, T) @ att^T (T, T): both stored that way.
  OFFLOAD_RETURN_IF_ERROR(Gemm<T>(lt,
                                  HeadBatchSpec(false, false, hs, Tn, Tn, v, hs, head, att, Tn,
                                                square, y, hs, head, 1.0f, batch),
                                  stream));
  return MergeHeads(out, y, C, B, Tn, NH, hs, stream);
}

template <typename T>
absl::Status AttentionBackward(CublasLt& lt, T* dqkv, T* scratch, const T* dout, const T* qkv,
                               const T* att, int B, int Tn, int C, int NH, cudaStream_t stream) {
  OFFLOAD_RETURN_IF_ERROR(CheckShape(B, Tn, C, NH));
  const int hs = C / NH;
  const int batch = B * NH;
  const int64_t btc = PaddedElems(static_cast<int64_t>(B) * Tn * C);
  const int64_t head = static_cast<int64_t>(Tn) * hs;
  const int64_t square = static_cast<int64_t>(Tn) * Tn;
  T* q = scratch;                 // (B, NH, T, hs)
  T* k = scratch + btc;           // (B, NH, T, hs); dk once dq is done with k
  T* v = scratch + 2 * btc;       // (B, NH, T, hs); dv once datt is done with v
  T* dout_p = scratch + 3 * btc;  // (B, NH, T, hs); dq once dv is done with dout_p
  T* datt = scratch + 4 * btc;    // (B, NH, T, T), then dpreatt in place
  T* dq = dout_p;
  T* dk = k;
  T* dv = v;

  const int64_t ld_qkv = 3 * static_cast<int64_t>(C);
  OFFLOAD_RETURN_IF_ERROR(SplitHeads(q, qkv, ld_qkv, B, Tn, NH, hs, stream));
  OFFLOAD_RETURN_IF_ERROR(SplitHeads(k, qkv + C, ld_qkv, B, Tn, NH, hs, stream));
  OFFLOAD_RETURN_IF_ERROR(SplitHeads(v, qkv + 2 * C, ld_qkv, B, Tn, NH, hs, stream));
  OFFLOAD_RETURN_IF_ERROR(SplitHeads(dout_p, dout, C, B, Tn, NH, hs, stream));

  // datt (T, T) = dout_p @ v^T, as datt^T = v @ dout_p^T column-major.
  OFFLOAD_RETURN_IF_ERROR(Gemm<T>(lt,
                                  HeadBatchSpec(true, false, Tn, Tn, hs, v, hs, head, dout_p, hs,
                                                head, datt, Tn, square, 1.0f, batch),
                                  stream));
  // dv (T, hs) = att^T @ dout_p, as dv^T (hs, T) = dout_p^T (hs, T) @ att (T, T): att stored
  // column-major is att^T, hence the transpose. Writes over v, whose last reader was datt.
  OFFLOAD_RETURN_IF_ERROR(Gemm<T>(lt,
                                  HeadBatchSpec(false, true, hs, Tn, Tn, dout_p, hs, head, att, Tn,
                                                square, dv, hs, head, 1.0f, batch),
                                  stream));
  const int64_t rows = static_cast<int64_t>(batch) * Tn;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  CausalSoftmaxBackwardKernel<T>
      <<<CeilDiv(rows, kWarpsPerBlock), kBlock, 0, stream>>>(datt, att, rows, Tn, scale);
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  const T* dpreatt = datt;

  // dq (T, hs) = dpreatt @ k, as dq^T (hs, T) = k^T (hs, T) @ dpreatt^T (T, T). Writes over
  // dout_p, whose last reader was dv.
  OFFLOAD_RETURN_IF_ERROR(Gemm<T>(lt,
                                  HeadBatchSpec(false, false, hs, Tn, Tn, k, hs, head, dpreatt, Tn,
                                                square, dq, hs, head, 1.0f, batch),
                                  stream));
  // dk (T, hs) = dpreatt^T @ q, as dk^T (hs, T) = q^T (hs, T) @ dpreatt (T, T). Writes over k,
  // whose last reader was dq.
  OFFLOAD_RETURN_IF_ERROR(Gemm<T>(lt,
                                  HeadBatchSpec(false, true, hs, Tn, Tn, q, hs, head, dpreatt, Tn,
                                                square, dk, hs, head, 1.0f, batch),
                                  stream));

  OFFLOAD_RETURN_IF_ERROR(MergeHeads(dqkv, dq, ld_qkv, B, Tn, NH, hs, stream));
  OFFLOAD_RETURN_IF_ERROR(MergeHeads(dqkv + C, dk, ld_qkv, B, Tn, NH, hs, stream));
  return MergeHeads(dqkv + 2 * C, dv, ld_qkv, B, Tn, NH, hs, stream);
}

#define OFFLOAD_INSTANTIATE_ATTENTION(T)                                                           \
  template absl::Status AttentionForward<T>(CublasLt&, T*, T*, T*, const T*, int, int, int, int,   \
                                            cudaStream_t);                                         \
  template absl::Status AttentionBackward<T>(CublasLt&, T*, T*, const T*, const T*, const T*, int, \
                                             int, int, int, cudaStream_t);
OFFLOAD_INSTANTIATE_FOR_STORAGE_TYPES(OFFLOAD_INSTANTIATE_ATTENTION)
#undef OFFLOAD_INSTANTIATE_ATTENTION

}  // namespace offload
