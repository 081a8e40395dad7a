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
};

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
// batching, bias epilogue and operand alignments. The pointers, alpha and beta are given to each
// call (the bias pointer is set on the plan's descriptor per call).
struct GemmPlanKey {
  int type = 0;  // the storage type's cudaDataType_t
  bool trans_a = false, trans_b = false;
  int m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  int batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;  // 0 unless batch > 1
  bool bias = false;
  uint32_t align_a = 0, align_b = 0, align_c = 0;

  auto Tie() const {
    return std::tie(type, trans_a, trans_b, m, n, k, lda, ldb, ldc, batch, stride_a, stride_b,
                    stride_c, bias, align_a, align_b, align_c);
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
  key.bias = spec.bias != nullptr;
  key.align_a = AlignmentBytes(spec.a, spec.stride_a, elem_bytes, spec.batch);
  key.align_b = AlignmentBytes(spec.b, spec.stride_b, elem_bytes, spec.batch);
  key.align_c = AlignmentBytes(spec.c, spec.stride_c, elem_bytes, spec.batch);
  return key;
}

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_BLAS_GEMM_SPEC_H_
