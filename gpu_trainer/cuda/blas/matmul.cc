// Row-major products as column-major cuBLAS calls: a row-major (R, S) matrix X is the
// column-major (S, R) matrix X^T with leading dimension S, so Y = X @ W row-major is
// Y^T = W^T @ X^T column-major, with the operands swapped and no data moved.
#include "gpu_trainer/cuda/blas/matmul.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "base/status_macros.h"
#include "gpu_trainer/cuda/blas/gemm.h"
#include "gpu_trainer/cuda/kernels/bias_grad.h"
#include "gpu_trainer/cuda/runtime/cuda_check.h"

namespace offload {

template <typename T>
absl::Status MatmulForward(CublasLt& lt, T* out, const T* inp, const T* weight, const T* bias,
                           int N, int C, int OC, cudaStream_t stream) {
  // out^T (OC, N) = weight^T (OC, C) @ inp^T (C, N) + bias: weight (C, OC) row-major already is
  // weight^T column-major, and the bias runs down each column of out^T, i.e. along each row.
  GemmSpec spec;
  spec.m = OC;
  spec.n = N;
  spec.k = C;
  spec.a = weight;
  spec.lda = OC;
  spec.b = inp;
  spec.ldb = C;
  spec.c = out;
  spec.ldc = OC;
  spec.bias = bias;
  return Gemm<T>(lt, spec, stream);
}

int64_t MatmulBackwardScratchFloats(int N, int OC) { return BiasGradScratchFloats(N, OC); }

template <typename T>
absl::Status MatmulBackward(CublasLt& lt, T* dinp, T* dweight, T* dbias, float* scratch,
                            const T* dout, const T* inp, const T* weight, int N, int C, int OC,
                            cudaStream_t stream) {
  // dinp = dout @ weight^T, as dinp^T (C, N) = weight (C, OC) @ dout^T (OC, N): the stored
  // column-major weight^T transposed.
  GemmSpec dinp_spec;
  dinp_spec.trans_a = true;
  dinp_spec.m = C;
  dinp_spec.n = N;
  dinp_spec.k = OC;
  dinp_spec.a = weight;
  dinp_spec.lda = OC;
  dinp_spec.b = dout;
  dinp_spec.ldb = OC;
  dinp_spec.c = dinp;
  dinp_spec.ldc = C;
  OFFLOAD_RETURN_IF_ERROR(Gemm<T>(lt, dinp_spec, stream));

  // dweight = inp^T @ dout, as dweight^T (OC, C) = dout^T (OC, N) @ inp (N, C): the stored
  // column-major inp^T transposed. beta = 0: overwritten, as matmul.h promises.
  GemmSpec dweight_spec;
  dweight_spec.trans_b = true;
  dweight_spec.m = OC;
  dweight_spec.n = C;
  dweight_spec.k = N;
  dweight_spec.a = dout;
  dweight_spec.lda = OC;
  dweight_spec.b = inp;
  dweight_spec.ldb = C;
  dweight_spec.c = dweight;
  dweight_spec.ldc = OC;
  OFFLOAD_RETURN_IF_ERROR(Gemm<T>(lt, dweight_spec, stream));

  if (dbias != nullptr) {
    OFFLOAD_CUDA_RETURN_IF_ERROR(BiasGrad<T>(dbias, scratch, dout, N, OC, stream));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status TiedHeadForward(CublasLt& lt, T* logits, int64_t ld_logits, const T* inp, const T* wte,
                             int N, int C, int V, cudaStream_t stream) {
  // logits^T (V, N) = wte (V, C) @ inp^T (C, N); wte (V, C) row-major is wte^T column-major,
  // hence the transpose. Columns of logits^T are ld_logits apart, so the padding is skipped.
  GemmSpec spec;
  spec.trans_a = true;
  spec.m = V;
  spec.n = N;
  spec.k = C;
  spec.a = wte;
  spec.lda = C;
  spec.b = inp;
  spec.ldb = C;
  spec.c = logits;
  spec.ldc = ld_logits;
  return Gemm<T>(lt, spec, stream);
}

template <typename T>
absl::Status TiedHeadBackward(CublasLt& lt, T* dinp, T* dwte, const T* dlogits, int64_t ld_logits,
                              const T* inp, const T* wte, int N, int C, int V,
                              cudaStream_t stream) {
  // dinp = dlogits @ wte, as dinp^T (C, N) = wte^T (C, V) @ dlogits^T (V, N); k = V, so the
  // padding columns [V, ld_logits) are never read.
  GemmSpec dinp_spec;
  dinp_spec.m = C;
  dinp_spec.n = N;
  dinp_spec.k = V;
  dinp_spec.a = wte;
  dinp_spec.lda = C;
  dinp_spec.b = dlogits;
  dinp_spec.ldb = ld_logits;
  dinp_spec.c = dinp;
  dinp_spec.ldc = C;
  OFFLOAD_RETURN_IF_ERROR(Gemm<T>(lt, dinp_spec, stream));

  // dwte = dlogits^T @ inp, as dwte^T (C, V) = inp^T (C, N) @ dlogits (N, V): the stored
  // column-major dlogits^T transposed. Overwritten; the encoder backward adds its share later.
  GemmSpec dwte_spec;
  dwte_spec.trans_b = true;
  dwte_spec.m = C;
  dwte_spec.n = V;
  dwte_spec.k = N;
  dwte_spec.a = inp;
  dwte_spec.lda = C;
  dwte_spec.b = dlogits;
  dwte_spec.ldb = ld_logits;
  dwte_spec.c = dwte;
  dwte_spec.ldc = C;
  return Gemm<T>(lt, dwte_spec, stream);
}

#define OFFLOAD_INSTANTIATE_MATMUL(T)                                                            \
  template absl::Status MatmulForward<T>(CublasLt&, T*, const T*, const T*, const T*, int, int,  \
                                         int, cudaStream_t);                                     \
  template absl::Status MatmulBackward<T>(CublasLt&, T*, T*, T*, float*, const T*, const T*,     \
                                          const T*, int, int, int, cudaStream_t);                \
  template absl::Status TiedHeadForward<T>(CublasLt&, T*, int64_t, const T*, const T*, int, int, \
                                           int, cudaStream_t);                                   \
  template absl::Status TiedHeadBackward<T>(CublasLt&, T*, T*, const T*, int64_t, const T*,      \
                                            const T*, int, int, int, cudaStream_t);
OFFLOAD_INSTANTIATE_MATMUL(float)
OFFLOAD_INSTANTIATE_MATMUL(__half)
OFFLOAD_INSTANTIATE_MATMUL(__nv_bfloat16)
#undef OFFLOAD_INSTANTIATE_MATMUL

}  // namespace offload
