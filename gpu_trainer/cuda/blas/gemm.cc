#include "gpu_trainer/cuda/blas/gemm.h"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "gpu_trainer/cuda/runtime/cuda_check.h"

namespace offload {
namespace {

template <typename T>
constexpr cudaDataType_t CudaDataType() {
  if constexpr (std::is_same_v<T, float>) {
    return CUDA_R_32F;
  } else if constexpr (std::is_same_v<T, __half>) {
    return CUDA_R_16F;
  } else {
    static_assert(std::is_same_v<T, __nv_bfloat16>, "storage types are float, __half, bf16");
    return CUDA_R_16BF;
  }
}

template <typename T>
constexpr const char* TypeName() {
  if constexpr (std::is_same_v<T, float>) {
    return "fp32";
  } else if constexpr (std::is_same_v<T, __half>) {
    return "fp16";
  } else {
    return "bf16";
  }
}

// Every number of the product, for error messages: a failing call deep in a layer is only
// debuggable if the message says which product it was.
template <typename T>
std::string Describe(const GemmSpec& s) {
  return absl::StrFormat(
      "%s gemm op(A)%s (%d x %d) @ op(B)%s (%d x %d) -> C (%d x %d), lda=%d ldb=%d ldc=%d, "
      "batch=%d strides a=%d b=%d c=%d, alpha=%g beta=%g, bias=%s, epilogue %s (aux_ld=%d)",
      TypeName<T>(), s.trans_a ? "=A^T" : "=A", s.m, s.k, s.trans_b ? "=B^T" : "=B", s.k, s.n, s.m,
      s.n, s.lda, s.ldb, s.ldc, s.batch, s.stride_a, s.stride_b, s.stride_c, s.alpha, s.beta,
      s.bias != nullptr ? "yes" : "no", GemmEpilogueName(EffectiveEpilogue(s)), s.aux_ld);
}

}  // namespace

// Owns the descriptors of one product, so every early return destroys them, and the algorithm
// the heuristic chose for them.
struct GemmPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;

  cublasLtMatmulAlgo_t algo = {};
  // False when cuBLASLt has no algorithm for the plan's fused epilogue: kept, so that every later
  // product of the key is answered Unimplemented at once instead of asking the heuristic again.
  bool supported = true;
  const char* refusal = "";  // why not, for the message: a cublasStatus_t's name

  GemmPlan() = default;
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;
  ~GemmPlan() {
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
  }
};

namespace {

absl::Status MakeLayout(cublasLtMatrixLayout_t* layout, cudaDataType_t type, int64_t rows,
                        int64_t cols, int64_t ld, int batch, int64_t stride) {
  OFFLOAD_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(
      layout, type, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld));
  if (batch > 1) {
    const int32_t count = batch;
    OFFLOAD_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutSetAttribute(
        *layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    OFFLOAD_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutSetAttribute(
        *layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  }
  return absl::OkStatus();
}

absl::Status CheckSpec(const GemmSpec& s) {
  // Stored shapes, column-major: A is (k, m) when transposed, else (m, k); B likewise.
  const int64_t a_rows = s.trans_a ? s.k : s.m;
  const int64_t b_rows = s.trans_b ? s.n : s.k;
  if (s.m < 0 || s.n < 0 || s.k <= 0 || s.batch < 1)
    return absl::InvalidArgumentError("m, n must be >= 0 and k, batch >= 1");
  if (s.a == nullptr || s.b == nullptr || s.c == nullptr) {
    return absl::InvalidArgumentError("null matrix pointer");
  }
  if (s.lda < std::max<int64_t>(1, a_rows) || s.ldb < std::max<int64_t>(1, b_rows) ||
      s.ldc < std::max<int64_t>(1, s.m)) {
    return absl::InvalidArgumentError("leading dimension smaller than the stored rows");
  }
  if (s.batch > 1 && (s.stride_a < 0 || s.stride_b < 0 || s.stride_c < 0)) {
    return absl::InvalidArgumentError("negative batch stride");
  }
  if (const char* why = CheckEpilogue(s); why != nullptr) return absl::InvalidArgumentError(why);
  return absl::OkStatus();
}

// The epilogue's pointers on the plan's descriptor: before the heuristic (which reads them for
// their alignment only) and again before every product.
absl::Status SetEpiloguePointers(cublasLtMatmulDesc_t op, const GemmSpec& spec) {
  const GemmEpilogue epilogue = EffectiveEpilogue(spec);
  if (epilogue == GemmEpilogue::kDefault) return absl::OkStatus();
  // One attribute holds the bias going in (forward) or its gradient coming out (backward).
  const void* bias = spec.bias != nullptr ? spec.bias : spec.bias_grad;
  OFFLOAD_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  if (spec.aux != nullptr) {
    OFFLOAD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
        op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &spec.aux, sizeof(spec.aux)));
  }
  return absl::OkStatus();
}

cublasLtEpilogue_t CublasEpilogue(GemmEpilogue e) {
  switch (e) {
    case GemmEpilogue::kDefault:
      return CUBLASLT_EPILOGUE_DEFAULT;
    case GemmEpilogue::kBias:
      return CUBLASLT_EPILOGUE_BIAS;
    case GemmEpilogue::kGeluAuxBias:
      return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case GemmEpilogue::kDGeluBGrad:
      return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    case GemmEpilogue::kBGradA:
      return CUBLASLT_EPILOGUE_BGRADA;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CublasLt>> CublasLt::Create(size_t workspace_bytes) {
  // The destructor releases whatever was acquired if a later step fails.
  std::unique_ptr<CublasLt> lt(new CublasLt());
  OFFLOAD_CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&lt->handle_));
  if (workspace_bytes > 0) {
    const cudaError_t error = cudaMalloc(&lt->workspace_, workspace_bytes);
    if (error != cudaSuccess) {
      cudaGetLastError();  // an allocation failure is not sticky; start later calls clean
      lt->workspace_ = nullptr;
      return CudaErrorStatus(error, "cudaMalloc(cuBLASLt workspace)", __FILE__, __LINE__);
    }
  }
  lt->workspace_bytes_ = workspace_bytes;
  return lt;
}

CublasLt::~CublasLt() {
  plans_.clear();  // their descriptors before the handle they were made for
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

GemmPlan* CublasLt::FindPlan(const GemmPlanKey& key) const {
  auto it = plans_.find(key);
  return it == plans_.end() ? nullptr : it->second.get();
}

GemmPlan* CublasLt::AddPlan(const GemmPlanKey& key, std::unique_ptr<GemmPlan> plan) {
  return (plans_[key] = std::move(plan)).get();
}

namespace {

// The descriptors and the heuristic's algorithm for every product of `key` (spec is one of
// them; its pointers matter only through the key's alignments).
template <typename T>
absl::StatusOr<std::unique_ptr<GemmPlan>> MakePlan(CublasLt& lt, const GemmSpec& spec,
                                                   const GemmPlanKey& key) {
  constexpr cudaDataType_t kType = CudaDataType<T>();
  auto plan = std::make_unique<GemmPlan>();
  GemmPlan& d = *plan;
  // fp32 accumulation and fp32 alpha/beta for every storage type; CUBLAS_COMPUTE_32F (not
  // _FAST_TF32) keeps fp32 inputs off the TF32 tensor cores.
  OFFLOAD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_a = spec.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t trans_b = spec.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  OFFLOAD_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  OFFLOAD_CUBLAS_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  // The epilogues (gemm_spec.h). cublasLt.h's rules, which CheckEpilogue has checked: the bias
  // and the bias gradient have D's type outside the int8 and fp8 kernels, and so has the GELU
  // aux matrix (EPILOGUE_AUX_DATA_TYPE left at its default, -1: D's type; setting it is only
  // for fp8); the aux leading dimension is a multiple of 8, at least m.
  if (key.epilogue != GemmEpilogue::kDefault) {
    const cublasLtEpilogue_t epilogue = CublasEpilogue(key.epilogue);
    OFFLOAD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
        d.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    // The pointers are set again before every product (Gemm); these are for the heuristic.
    OFFLOAD_RETURN_IF_ERROR(SetEpiloguePointers(d.op, spec));
  }
  if (key.epilogue == GemmEpilogue::kBias || key.epilogue == GemmEpilogue::kGeluAuxBias) {
    // The bias going in has the type of D, which is T here (the default, -1, means the same;
    // said explicitly so it never depends on it).
    const int32_t bias_type = kType;
    OFFLOAD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
        d.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
  }
  if (key.aux_ld > 0) {
    const int64_t aux_ld = key.aux_ld;
    OFFLOAD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
        d.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)));
  }

  // Stored (column-major) shapes: op(A) is (m, k), so A is (k, m) when transposed.
  OFFLOAD_RETURN_IF_ERROR(MakeLayout(&d.a, kType, spec.trans_a ? spec.k : spec.m,
                                     spec.trans_a ? spec.m : spec.k, spec.lda, spec.batch,
                                     spec.stride_a));
  OFFLOAD_RETURN_IF_ERROR(MakeLayout(&d.b, kType, spec.trans_b ? spec.n : spec.k,
                                     spec.trans_b ? spec.k : spec.n, spec.ldb, spec.batch,
                                     spec.stride_b));
  // C and D are the same matrix.
  OFFLOAD_RETURN_IF_ERROR(
      MakeLayout(&d.c, kType, spec.m, spec.n, spec.ldc, spec.batch, spec.stride_c));

  OFFLOAD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&d.pref));
  const uint64_t workspace_bytes = lt.workspace_bytes();
  OFFLOAD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof(workspace_bytes)));
  OFFLOAD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_a, sizeof(key.align_a)));
  OFFLOAD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_b, sizeof(key.align_b)));
  OFFLOAD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align_c, sizeof(key.align_c)));
  OFFLOAD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align_c, sizeof(key.align_c)));

  // First ask for algorithms whose split-K partial sums stay in fp32 (or that do not split):
  // the in-place and output-type schemes round every partial sum to T, so a 16-bit output
  // would be rounded more than once. Only if none exists, take any scheme.
  const uint32_t kSchemeMasks[] = {CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE,
                                   CUBLASLT_REDUCTION_SCHEME_MASK};
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  cublasStatus_t heuristic_status = CUBLAS_STATUS_SUCCESS;
  for (const uint32_t mask : kSchemeMasks) {
    OFFLOAD_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
        d.pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, sizeof(mask)));
    found = 0;
    heuristic_status = cublasLtMatmulAlgoGetHeuristic(lt.handle(), d.op, d.a, d.b, d.c, d.c, d.pref,
                                                      1, &heuristic, &found);
    if (heuristic_status == CUBLAS_STATUS_SUCCESS && found > 0) break;
  }
  if ((heuristic_status != CUBLAS_STATUS_SUCCESS || found == 0) && IsFusedEpilogue(key.epilogue)) {
    // Not every type and layout has kernels for every epilogue: the caller runs the unfused
    // kernels instead. The plan is kept, marked, so the heuristic is asked once per key.
    plan->supported = false;
    plan->refusal = heuristic_status != CUBLAS_STATUS_SUCCESS
                        ? cublasGetStatusName(heuristic_status)
                        : "no algorithm found";
    // Once per key: a run that meant to fuse should be able to tell that it did not.
    std::fprintf(stderr,
                 "offload gemm: cuBLASLt offers no algorithm (%s) for %s; unfused instead\n",
                 plan->refusal, Describe<T>(spec).c_str());
    return plan;
  }
  if (heuristic_status != CUBLAS_STATUS_SUCCESS || found == 0) {
    return absl::InternalError(absl::StrFormat(
        "cuBLASLt found no algorithm (%s) for %s; alignments a=%u b=%u c=%u bytes, workspace %u "
        "bytes",
        cublasGetStatusName(heuristic_status), Describe<T>(spec), key.align_a, key.align_b,
        key.align_c, workspace_bytes));
  }
  d.algo = heuristic.algo;
  return plan;
}

// What a product whose fused epilogue cuBLASLt does not offer returns.
template <typename T>
absl::Status EpilogueUnsupported(const GemmSpec& spec, const char* why) {
  return absl::UnimplementedError(absl::StrCat("cuBLASLt offers no algorithm (", why, ") for the ",
                                               GemmEpilogueName(EffectiveEpilogue(spec)),
                                               " epilogue of ", Describe<T>(spec)));
}

}  // namespace

template <typename T>
absl::Status Gemm(CublasLt& lt, const GemmSpec& spec, cudaStream_t stream) {
  if (absl::Status s = CheckSpec(spec); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(s.message(), ": ", Describe<T>(spec)));
  }
  if (spec.m == 0 || spec.n == 0) return absl::OkStatus();
  const GemmPlanKey key = MakeGemmPlanKey(spec, CudaDataType<T>(), sizeof(T));
  GemmPlan* plan = lt.FindPlan(key);
  if (plan == nullptr) {
    OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<GemmPlan> made, MakePlan<T>(lt, spec, key));
    plan = lt.AddPlan(key, std::move(made));
  }
  if (!plan->supported) {
    lt.CountEpilogueRefused();
    return EpilogueUnsupported<T>(spec, plan->refusal);
  }
  OFFLOAD_RETURN_IF_ERROR(SetEpiloguePointers(plan->op, spec));
  const float alpha = spec.alpha;
  const float beta = spec.beta;
  const cublasStatus_t status = cublasLtMatmul(
      lt.handle(), plan->op, &alpha, spec.a, plan->a, spec.b, plan->b, &beta, spec.c, plan->c,
      spec.c, plan->c, &plan->algo, lt.workspace(), lt.workspace_bytes(), stream);
  if ((status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE) &&
      IsFusedEpilogue(key.epilogue)) {
    // Refused before anything ran: as if the heuristic had found nothing. cuBLASLt answers an
    // epilogue combination it does not take with either status, depending on the version.
    plan->supported = false;
    plan->refusal = status == CUBLAS_STATUS_NOT_SUPPORTED
                        ? "cublasLtMatmul refused the heuristic's algorithm: "
                          "CUBLAS_STATUS_NOT_SUPPORTED"
                        : "cublasLtMatmul refused the heuristic's algorithm: "
                          "CUBLAS_STATUS_INVALID_VALUE";
    lt.CountEpilogueRefused();
    return EpilogueUnsupported<T>(spec, plan->refusal);
  }
  if (status != CUBLAS_STATUS_SUCCESS) {
    const absl::Status s = CublasErrorStatus(status, "cublasLtMatmul", __FILE__, __LINE__);
    return absl::Status(s.code(), absl::StrCat(s.message(), " for ", Describe<T>(spec)));
  }
  return absl::OkStatus();
}

#define OFFLOAD_INSTANTIATE_GEMM(T) \
  template absl::Status Gemm<T>(CublasLt & lt, const GemmSpec& spec, cudaStream_t stream);
OFFLOAD_INSTANTIATE_GEMM(float)
OFFLOAD_INSTANTIATE_GEMM(__half)
OFFLOAD_INSTANTIATE_GEMM(__nv_bfloat16)
#undef OFFLOAD_INSTANTIATE_GEMM

}  // namespace offload
