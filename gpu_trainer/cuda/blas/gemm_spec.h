// What a matrix product of the CUDA backend is, and what of it decides its cuBLASLt plan
// (descriptors, layouts and the algorithm the heuristic picks): everything but the pointers,
// plus how aligned the pointers are. Host-only (no CUDA headers), so the plan's key is tested on
// any machine (gemm_spec_test.cc); gemm.h runs the products.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_BLAS_GEMM_SPEC_H_
#define OFFLOAD_GPU_TRAINER_CUDA_BLAS_GEMM_SPEC_H_

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <utility>

namespace offload {

// What cuBLASLt does to the product before it is stored (cublasLtEpilogue_t), for the fused
// products of the GPT-2 MLP (matmul.h). Column-major terms: D is (m, n), "rows" are its m.
//   kDefault      D = alpha op(A) op(B) + beta C; with a non-null bias it is kBias.
//   kBias         D = alpha op(A) op(B) + beta C + bias (m,) added to every column.
//   kGeluAuxBias  P = op(A) op(B) + bias; aux = P (rounded to T), D = gelu(P) (tanh form).
//   kDGeluBGrad   G = op(A) op(B); D = gelu'(aux) * G; bias_grad (m,) = the row sums of D.
//   kBGradA       D = op(A) op(B); bias_grad (m,) = the row sums of op(A) (over k).
// The epilogues after kBias take alpha = 1, beta = 0 and a single matrix (CheckEpilogue).
enum class GemmEpilogue : int {
  kDefault = 0,
  kBias = 1,
  kGeluAuxBias = 2,
  kDGeluBGrad = 3,
  kBGradA = 4,
};

inline const char* GemmEpilogueName(GemmEpilogue e) {
  switch (e) {
    case GemmEpilogue::kDefault:
      return "default";
    case GemmEpilogue::kBias:
      return "bias";
    case GemmEpilogue::kGeluAuxBias:
      return "gelu_aux_bias";
    case GemmEpilogue::kDGeluBGrad:
      return "dgelu_bgrad";
    case GemmEpilogue::kBGradA:
      return "bgrada";
  }
  return "?";
}

// C = alpha * op(A) @ op(B) + beta * C (+ bias), column-major as cuBLAS defines it: op(A) is
// (m, k), op(B) is (k, n), C is (m, n). A row-major (R, S) matrix is a column-major (S, R) one,
// which is how the row-major wrappers of matmul.h and attention.cu call Gemm.
struct GemmSpec {
  bool trans_a = false;
  bool trans_b = false;
  int m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* c = nullptr;
  int64_t ldc = 0;
  const void* bias = nullptr;  // (m,) in T, added to every column; nullptr for none
  float alpha = 1.0f;
  float beta = 0.0f;
  int batch = 1;  // strided batches: matrix i at a + i * stride_a elements, etc.
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  // A fused epilogue (GemmEpilogue above); kDefault with a bias is kBias.
  GemmEpilogue epilogue = GemmEpilogue::kDefault;
  void* bias_grad = nullptr;  // (m,) in T: written by kDGeluBGrad and kBGradA
  void* aux = nullptr;        // (m, n) in T, leading dimension aux_ld: the pre-GELU values,
  int64_t aux_ld = 0;         // written by kGeluAuxBias, read by kDGeluBGrad
};

// The epilogue a spec runs: its own, or kBias for a plain product given a bias.
inline GemmEpilogue EffectiveEpilogue(const GemmSpec& s) {
  if (s.epilogue == GemmEpilogue::kDefault && s.bias != nullptr) return GemmEpilogue::kBias;
  return s.epilogue;
}

// The epilogues cuBLASLt may decline for a shape, type or layout (no algorithm from its
// heuristic): Gemm then returns Unimplemented and the caller runs the unfused kernels.
inline bool IsFusedEpilogue(GemmEpilogue e) {
  return e == GemmEpilogue::kGeluAuxBias || e == GemmEpilogue::kDGeluBGrad ||
         e == GemmEpilogue::kBGradA;
}

// Why `s`'s epilogue cannot run (a static string), or nullptr when it can. cublasLt.h: the GELU
// aux matrix's leading dimension must be a multiple of 8 and at least the rows of D; aux and
// the bias gradient have D's type (the default of their data type attributes). Beyond that, this
// backend's own limits: one matrix, alpha 1 and beta 0 (the GELU of alpha AB + beta C is no
// product of the model), and neither input nor output pointers that the epilogue does not use.
inline const char* CheckEpilogue(const GemmSpec& s) {
  const GemmEpilogue e = EffectiveEpilogue(s);
  if (e == GemmEpilogue::kDefault || e == GemmEpilogue::kBias) {
    if (s.bias_grad != nullptr || s.aux != nullptr) return "bias_grad or aux without an epilogue";
    return nullptr;
  }
  if (s.batch != 1) return "a fused epilogue needs batch == 1";
  if (s.alpha != 1.0f || s.beta != 0.0f) return "a fused epilogue needs alpha == 1, beta == 0";
  const bool gelu = e == GemmEpilogue::kGeluAuxBias || e == GemmEpilogue::kDGeluBGrad;
  if (gelu) {
    if (s.aux == nullptr) return "the GELU epilogues need the aux matrix";
    if (s.aux_ld < s.m || s.aux_ld % 8 != 0) {
      return "aux_ld must be >= m and a multiple of 8 (cublasLt.h)";
    }
  } else if (s.aux != nullptr) {
    return "aux given to an epilogue without GELU";
  }
  if (e == GemmEpilogue::kGeluAuxBias) {
    if (s.bias == nullptr) return "kGeluAuxBias needs the bias";
    if (s.bias_grad != nullptr) return "kGeluAuxBias writes no bias gradient";
  } else {
    if (s.bias_grad == nullptr) return "the gradient epilogues need bias_grad";
    if (s.bias != nullptr) return "the gradient epilogues add no bias";
  }
  return nullptr;
}

// The largest power of two (up to 256, cuBLASLt's default assumption) dividing the address of
// every matrix of the batch. The heuristic assumes 256-byte aligned operands unless told
// otherwise, and the attention products start at offsets into scratch and strided batches whose
// stride need not be a multiple of 256 bytes.
inline uint32_t AlignmentBytes(const void* p, int64_t stride_elems, size_t elem_bytes, int batch) {
  uint64_t bits = reinterpret_cast<uintptr_t>(p);
  if (batch > 1) bits |= static_cast<uint64_t>(stride_elems) * elem_bytes;
  uint32_t alignment = 256;
  while (alignment > 1 && (bits & (alignment - 1)) != 0) alignment >>= 1;
  return alignment;
}

// Products with equal keys share one plan: the same storage type, shapes, leading dimensions,
// batching, epilogue (with its aux leading dimension) and operand alignments, the bias's and
// aux's included: the heuristic reads their pointers to learn how aligned they are. The
// pointers, alpha and beta are given to each call (the bias, bias gradient and aux pointers are
// set on the plan's descriptor per call).
struct GemmPlanKey {
  int type = 0;  // the storage type's cudaDataType_t
  bool trans_a = false, trans_b = false;
  int m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  int batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;  // 0 unless batch > 1
  GemmEpilogue epilogue = GemmEpilogue::kDefault;    // EffectiveEpilogue
  int64_t aux_ld = 0;                                // 0 without aux
  uint32_t align_a = 0, align_b = 0, align_c = 0;
  uint32_t align_bias = 0, align_aux = 0;  // 0 without them

  auto Tie() const {
    return std::tie(type, trans_a, trans_b, m, n, k, lda, ldb, ldc, batch, stride_a, stride_b,
                    stride_c, epilogue, aux_ld, align_a, align_b, align_c, align_bias, align_aux);
  }
  friend bool operator==(const GemmPlanKey& x, const GemmPlanKey& y) { return x.Tie() == y.Tie(); }
  template <typename H>
  friend H AbslHashValue(H h, const GemmPlanKey& key) {
    return H::combine(std::move(h), key.Tie());
  }
};

// The key of `spec` with elements of elem_bytes bytes of cudaDataType_t `type`.
inline GemmPlanKey MakeGemmPlanKey(const GemmSpec& spec, int type, size_t elem_bytes) {
  GemmPlanKey key;
  key.type = type;
  key.trans_a = spec.trans_a;
  key.trans_b = spec.trans_b;
  key.m = spec.m;
  key.n = spec.n;
  key.k = spec.k;
  key.lda = spec.lda;
  key.ldb = spec.ldb;
  key.ldc = spec.ldc;
  key.batch = spec.batch;
  // A single matrix's layout has no stride: its value does not change the plan.
  if (spec.batch > 1) {
    key.stride_a = spec.stride_a;
    key.stride_b = spec.stride_b;
    key.stride_c = spec.stride_c;
  }
  key.epilogue = EffectiveEpilogue(spec);
  // The bias vector in or the bias gradient out: one pointer attribute, one alignment.
  const void* bias = spec.bias != nullptr ? spec.bias : spec.bias_grad;
  if (bias != nullptr) key.align_bias = AlignmentBytes(bias, 0, elem_bytes, 1);
  if (spec.aux != nullptr) {
    key.aux_ld = spec.aux_ld;
    key.align_aux = AlignmentBytes(spec.aux, 0, elem_bytes, 1);
  }
  key.align_a = AlignmentBytes(spec.a, spec.stride_a, elem_bytes, spec.batch);
  key.align_b = AlignmentBytes(spec.b, spec.stride_b, elem_bytes, spec.batch);
  key.align_c = AlignmentBytes(spec.c, spec.stride_c, elem_bytes, spec.batch);
  return key;
}

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_BLAS_GEMM_SPEC_H_
