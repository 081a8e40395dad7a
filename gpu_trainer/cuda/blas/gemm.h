// Every matrix product of the CUDA backend goes through one cuBLASLt call with fp32 compute and
// fp32 scale (CUBLAS_COMPUTE_32F: no TF32 shortcut, so the fp32 mode is a true fp32 reference),
// storage type T for A, B and C, an optional epilogue (a bias, or the fused GELU and bias-gradient
// epilogues of the MLP: GemmEpilogue), and strided batches. The product is described by a
// GemmSpec (gemm_spec.h); its plan is made once per shape and epilogue and reused.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_BLAS_GEMM_H_
#define OFFLOAD_GPU_TRAINER_CUDA_BLAS_GEMM_H_

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu_trainer/cuda/blas/gemm_spec.h"

namespace offload {

// One product's cuBLASLt descriptors, layouts and chosen algorithm (gemm.cc).
struct GemmPlan;

// A cuBLASLt handle, its workspace, and the plans of the products run through it: each shape's
// descriptors are made and its algorithm chosen once, on its first product, not on every one (a
// GPT-2 step runs about 150 products of a dozen shapes). One per stream that runs products; not
// thread-safe.
class CublasLt {
 public:
  static absl::StatusOr<std::unique_ptr<CublasLt>> Create(size_t workspace_bytes = 32 << 20);
  ~CublasLt();
  CublasLt(const CublasLt&) = delete;
  CublasLt& operator=(const CublasLt&) = delete;

  cublasLtHandle_t handle() const { return handle_; }
  void* workspace() const { return workspace_; }
  size_t workspace_bytes() const { return workspace_bytes_; }

  // Gemm's cache: the plan of `key`, or null; and a new one, kept until destruction.
  GemmPlan* FindPlan(const GemmPlanKey& key) const;
  GemmPlan* AddPlan(const GemmPlanKey& key, std::unique_ptr<GemmPlan> plan);
  // Plans made so far (heuristic queries run), for the tests and the bench.
  int64_t plans_made() const { return static_cast<int64_t>(plans_.size()); }
  // Products Gemm answered Unimplemented because cuBLASLt offers no algorithm for their fused
  // epilogue (each then ran unfused): the tests check that the fused path really ran.
  int64_t epilogues_refused() const { return epilogues_refused_; }
  void CountEpilogueRefused() { ++epilogues_refused_; }

 private:
  CublasLt() = default;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  int64_t epilogues_refused_ = 0;
  absl::flat_hash_map<GemmPlanKey, std::unique_ptr<GemmPlan>> plans_;
};

// Queues the product of `spec` on `stream`. InvalidArgument for a bad spec (CheckEpilogue's
// rules included); Unimplemented, with nothing queued, when the spec asks for a fused epilogue
// (IsFusedEpilogue) that cuBLASLt offers no algorithm for on this GPU, type and layout: the
// caller then runs the unfused kernels (matmul.cc does).
template <typename T>
absl::Status Gemm(CublasLt& lt, const GemmSpec& spec, cudaStream_t stream);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_BLAS_GEMM_H_
