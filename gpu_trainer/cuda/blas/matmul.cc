// Row-major products as column-major cuBLAS calls: a row-major (R, S) matrix X is the
// column-major (S, R) matrix X^T with leading dimension S, so Y = X @ W row-major is
// Y^T = W^T @ X^T column-major, with the operands swapped and no data moved.
#include "gpu_trainer/cuda/blas/matmul.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/status_macros.h"
#include "gpu_trainer/cuda/blas/gemm.h"
#include "gpu_trainer/cuda/kernels/bias_grad.h"
#include "gpu_trainer/cuda/kernels/gelu.h"
#include "gpu_trainer/cuda/runtime/cuda_check.h"

namespace offload {

namespace {

// out^T (OC, N) = weight^T (OC, C) @ inp^T (C, N) + bias: weight (C, OC) row-major already is
// weight^T column-major, and the bias runs down each column of out^T, i.e. along each row.
GemmSpec ForwardSpec(void* out, const void* inp, const void* weight, const void* bias, int N, int C,
                     int OC) {
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
  return spec;
}

}  // namespace

template <typename T>
absl::Status MatmulForward(CublasLt& lt, T* out, const T* inp, const T* weight, const T* bias,
                           int N, int C, int OC, cudaStream_t stream) {
  return Gemm<T>(lt, ForwardSpec(out, inp, weight, bias, N, C, OC), stream);
}

int64_t MatmulBackwardScratchFloats(int N, int OC) { return BiasGradScratchFloats(N, OC); }

int64_t MatmulGeluBackwardScratchFloats(int N, int C, int OC) {
  return std::max(BiasGradScratchFloats(N, C), BiasGradScratchFloats(N, OC));
}

namespace {

// dinp = dout @ weight^T, as dinp^T (C, N) = weight (C, OC) @ dout^T (OC, N): the stored
// column-major weight^T transposed.
GemmSpec DinpSpec(void* dinp, const void* dout, const void* weight, int N, int C, int OC) {
  GemmSpec spec;
  spec.trans_a = true;
  spec.m = C;
  spec.n = N;
  spec.k = OC;
  spec.a = weight;
  spec.lda = OC;
  spec.b = dout;
  spec.ldb = OC;
  spec.c = dinp;
  spec.ldc = C;
  return spec;
}

// dweight = inp^T @ dout, as dweight^T (OC, C) = dout^T (OC, N) @ inp (N, C): the stored
// column-major inp^T transposed. beta = 0: overwritten, as matmul.h promises.
GemmSpec DweightSpec(void* dweight, const void* dout, const void* inp, int N, int C, int OC) {
  GemmSpec spec;
  spec.trans_b = true;
  spec.m = OC;
  spec.n = C;
  spec.k = N;
  spec.a = dout;
  spec.lda = OC;
  spec.b = inp;
  spec.ldb = C;
  spec.c = dweight;
  spec.ldc = OC;
  return spec;
}

// Runs `fused` (a spec with a fused epilogue): true when it ran, false when cuBLASLt offers no
// algorithm for it (nothing was queued; the caller runs the unfused kernels), or the error.
template <typename T>
absl::StatusOr<bool> TryFused(CublasLt& lt, const GemmSpec& fused, cudaStream_t stream) {
  const absl::Status status = Gemm<T>(lt, fused, stream);
  if (status.ok()) return true;
  if (absl::IsUnimplemented(status)) return false;
  return status;
}

// dweight and, when given, dbias (the column sums of dout): with the BGRADA epilogue, where
// asked and offered, else the product and the bias_grad kernel.
template <typename T>
absl::Status DweightAndBias(CublasLt& lt, T* dweight, T* dbias, float* scratch, const T* dout,
                            const T* inp, int N, int C, int OC, bool fused, cudaStream_t stream) {
  GemmSpec spec = DweightSpec(dweight, dout, inp, N, C, OC);
  if (dbias != nullptr && UsesFusedEpilogues<T>(fused)) {
    // BGRADA: the bias gradient from A, reduced over k, one value per row of D. Here A is
    // dout^T (OC, N) untransposed, k = N and D's rows are the OC output features: the sum over
    // tokens of dout, which is dbias. (BGRADB would reduce op(B) = inp instead: the row-major to
    // column-major mapping puts dout in A, so A it is.)
    GemmSpec fused_spec = spec;
    fused_spec.epilogue = GemmEpilogue::kBGradA;
    fused_spec.bias_grad = dbias;
    OFFLOAD_ASSIGN_OR_RETURN(const bool ran, TryFused<T>(lt, fused_spec, stream));
    if (ran) return absl::OkStatus();
  }
  OFFLOAD_RETURN_IF_ERROR(Gemm<T>(lt, spec, stream));
  if (dbias != nullptr) {
    OFFLOAD_CUDA_RETURN_IF_ERROR(BiasGrad<T>(dbias, scratch, dout, N, OC, stream));
  }
  return absl::OkStatus();
}

}  // namespace

template <typename T>
absl::Status MatmulBackward(CublasLt& lt, T* dinp, T* dweight, T* dbias, float* scratch,
                            const T* dout, const T* inp, const T* weight, int N, int C, int OC,
                            cudaStream_t stream, bool fused) {
  OFFLOAD_RETURN_IF_ERROR(Gemm<T>(lt, DinpSpec(dinp, dout, weight, N, C, OC), stream));
  return DweightAndBias<T>(lt, dweight, dbias, scratch, dout, inp, N, C, OC, fused, stream);
}

template <typename T>
absl::Status MatmulGeluForward(CublasLt& lt, T* out, T* pre, const T* inp, const T* weight,
                               const T* bias, int N, int C, int OC, bool fused,
                               cudaStream_t stream) {
  // As MatmulForward: out^T (OC, N) = weight^T (OC, C) @ inp^T (C, N) + bias, and pre^T, the aux
  // matrix, has out^T's shape and leading dimension OC (cuBLASLt wants a multiple of 8).
  if (UsesFusedEpilogues<T>(fused) && bias != nullptr && OC % 8 == 0) {
    GemmSpec spec = ForwardSpec(out, inp, weight, bias, N, C, OC);
    spec.epilogue = GemmEpilogue::kGeluAuxBias;
    spec.aux = pre;
    spec.aux_ld = OC;
    OFFLOAD_ASSIGN_OR_RETURN(const bool ran, TryFused<T>(lt, spec, stream));
    if (ran) return absl::OkStatus();
  }
  OFFLOAD_RETURN_IF_ERROR(MatmulForward<T>(lt, pre, inp, weight, bias, N, C, OC, stream));
  OFFLOAD_CUDA_RETURN_IF_ERROR(GeluForward<T>(out, pre, int64_t{N} * OC, stream));
  return absl::OkStatus();
}

template <typename T>
absl::Status MatmulGeluBackward(CublasLt& lt, T* dpre, T* dpre_bias, T* dweight, T* dbias,
                                float* scratch, const T* dout, const T* inp, const T* pre,
                                const T* weight, int N, int C, int OC, bool fused,
                                cudaStream_t stream) {
  const GemmSpec dinp_spec = DinpSpec(dpre, dout, weight, N, C, OC);
  bool done = false;
  if (UsesFusedEpilogues<T>(fused) && dpre_bias != nullptr && C % 8 == 0) {
    // DGELU_BGRAD on dpre^T (C, N) = weight (C, OC) @ dout^T (OC, N): each element times
    // gelu'(pre) from the aux matrix (pre^T, leading dimension C, as the forward's epilogue wrote
    // it), and the row sums of the result, one per row of D = per input feature of this product
    // = per output feature of the product that made pre: that product's bias gradient.
    GemmSpec spec = dinp_spec;
    spec.epilogue = GemmEpilogue::kDGeluBGrad;
    spec.aux = const_cast<T*>(pre);  // read, not written, by the backward epilogue
    spec.aux_ld = C;
    spec.bias_grad = dpre_bias;
    OFFLOAD_ASSIGN_OR_RETURN(done, TryFused<T>(lt, spec, stream));
  }
  if (!done) {
    OFFLOAD_RETURN_IF_ERROR(Gemm<T>(lt, dinp_spec, stream));
    OFFLOAD_CUDA_RETURN_IF_ERROR(GeluBackward<T>(dpre, pre, dpre, int64_t{N} * C, stream));
    if (dpre_bias != nullptr) {
      OFFLOAD_CUDA_RETURN_IF_ERROR(BiasGrad<T>(dpre_bias, scratch, dpre, N, C, stream));
    }
  }
  return DweightAndBias<T>(lt, dweight, dbias, scratch, dout, inp, N, C, OC, fused, stream);
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

#define OFFLOAD_INSTANTIATE_MATMUL(T)                                                              \
  template absl::Status MatmulForward<T>(CublasLt&, T*, const T*, const T*, const T*, int, int,    \
                                         int, cudaStream_t);                                       \
  template absl::Status MatmulBackward<T>(CublasLt&, T*, T*, T*, float*, const T*, const T*,       \
                                          const T*, int, int, int, cudaStream_t, bool);            \
  template absl::Status MatmulGeluForward<T>(CublasLt&, T*, T*, const T*, const T*, const T*, int, \
                                             int, int, bool, cudaStream_t);                        \
  template absl::Status MatmulGeluBackward<T>(CublasLt&, T*, T*, T*, T*, float*, const T*,         \
                                              const T*, const T*, const T*, int, int, int, bool,   \
                                              cudaStream_t);                                       \
  template absl::Status TiedHeadForward<T>(CublasLt&, T*, int64_t, const T*, const T*, int, int,   \
                                           int, cudaStream_t);                                     \
  template absl::Status TiedHeadBackward<T>(CublasLt&, T*, T*, const T*, int64_t, const T*,        \
                                            const T*, int, int, int, cudaStream_t);
OFFLOAD_INSTANTIATE_MATMUL(float)
OFFLOAD_INSTANTIATE_MATMUL(__half)
OFFLOAD_INSTANTIATE_MATMUL(__nv_bfloat16)
#undef OFFLOAD_INSTANTIATE_MATMUL

}  // namespace offload
