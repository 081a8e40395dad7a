#include "gpu_trainer/cuda/cudnn/cudnn_attention.h"

#include <cuda_runtime.h>
#include <cudnn_graph.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "gpu_trainer/cuda/cudnn/cudnn_library.h"
#include "gpu_trainer/cuda/cudnn/sdpa_backend_graph.h"
#include "gpu_trainer/cuda/cudnn/sdpa_graph.h"
#include "gpu_trainer/cuda/runtime/cuda_check.h"

namespace offload {
namespace {

using Desc = cudnnBackendDescriptor_t;

// One direction's execution plan, with everything it was made from kept alive beside it.
struct Plan {
  SdpaOperationGraph graph;
  CudnnDescriptor engine_config;
  CudnnDescriptor plan;
  SdpaScalars scalars;          // the by-value scalars' host values, at stable addresses
  int64_t engine_bytes = 0;     // CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE
  int64_t workspace_bytes = 0;  // what this direction needs of the caller's workspace
};

std::string Describe(const SdpaKey& k) {
  return absl::StrCat(k.direction == SdpaDirection::kForward ? "forward" : "backward", " B=", k.B,
                      " T=", k.T, " C=", k.C, " NH=", k.NH,
                      k.dtype == SdpaDType::kHalf ? " fp16" : " bf16");
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

class CudnnAttention::Impl {
 public:
  Impl(const CudnnLibrary& lib, cudnnHandle_t handle, DType dtype)
      : lib_(lib), handle_(handle), dtype_(dtype) {}
  ~Impl() {
    // The plans' descriptors go before the handle they were made for, and the handle lets go
    // of the last stream it ran on, which its owner may already have destroyed.
    plans_.clear();
    lib_.api().SetStream(handle_, nullptr);
    lib_.api().Destroy(handle_);
  }

  int64_t version() const { return lib_.version(); }
  DType dtype() const { return dtype_; }
  int plans_built() const { return plans_built_; }

  SdpaKey Key(int B, int T, int C, int NH, SdpaDirection direction) const {
    return SdpaKey{
        B, T, C, NH, dtype_ == DType::kFp16 ? SdpaDType::kHalf : SdpaDType::kBfloat16, direction};
  }

  absl::StatusOr<int64_t> Prepare(int B, int T, int C, int NH) {
    const SdpaKey key = Key(B, T, C, NH, SdpaDirection::kForward);
    auto it = prepared_.find(key);
    if (it == prepared_.end()) {
      absl::StatusOr<int64_t> outcome = PrepareNew(B, T, C, NH);
      Prepared p;
      p.status = outcome.status();
      p.bytes = outcome.value_or(0);
      it = prepared_.emplace(key, std::move(p)).first;
    }
    if (!it->second.status.ok()) return it->second.status;
    return it->second.bytes;
  }

  void SetWorkspace(void* workspace, int64_t bytes) {
    workspace_ = workspace;
    workspace_bytes_ = bytes;
  }

  bool Supports(int B, int T, int C, int NH) {
    const absl::StatusOr<int64_t> need = Prepare(B, T, C, NH);
    std::string why;
    if (!need.ok()) {
      why = std::string(need.status().message());
    } else if (*need > workspace_bytes_) {
      why = absl::StrCat("it needs ", *need, " bytes of workspace and ", workspace_bytes_,
                         " were set aside at (max_batch, max_seq)");
    } else {
      return true;
    }
    if (logged_.insert(Key(B, T, C, NH, SdpaDirection::kForward)).second) {
      LOG(WARNING) << "attention: cuDNN cannot run B=" << B << " T=" << T << " C=" << C
                   << " NH=" << NH << " (" << why << "); the reference attention runs it";
    }
    return false;
  }

  absl::Status Forward(void* out, float* stats, const void* qkv, int B, int T, int C, int NH,
                       cudaStream_t stream) {
    OFFLOAD_RETURN_IF_ERROR(CheckRunnable(B, T, C, NH, {out, stats, qkv}));
    Plan& p = *plans_.at(Key(B, T, C, NH, SdpaDirection::kForward));
    const int64_t part = static_cast<int64_t>(C) * 2;  // bytes from Q to K, K to V in a row
    const char* base = static_cast<const char*>(qkv);
    namespace uid = sdpa_uid;
    const int64_t uids[] = {uid::kQ,     uid::kK,     uid::kV,     uid::kO,
                            uid::kStats, uid::kScale, uid::kNegInf};
    void* ptrs[] = {const_cast<char*>(base),
                    const_cast<char*>(base + part),
                    const_cast<char*>(base + 2 * part),
                    out,
                    stats,
                    &p.scalars.scale,
                    &p.scalars.neg_inf};
    return Execute(p, uids, ptrs, sizeof(uids) / sizeof(uids[0]), workspace_, stream);
  }

  absl::Status Backward(void* dqkv, const void* dout, const void* qkv, const void* out,
                        const float* stats, int B, int T, int C, int NH, cudaStream_t stream) {
    OFFLOAD_RETURN_IF_ERROR(CheckRunnable(B, T, C, NH, {dqkv, dout, qkv, out, stats}));
    Plan& p = *plans_.at(Key(B, T, C, NH, SdpaDirection::kBackward));
    const SdpaBackwardWorkspace w = SdpaLayout(B, T, C, NH).BackwardWorkspace(p.engine_bytes);
    char* ws = static_cast<char*>(workspace_);
    if (lib_.version() < 90600) {
      // Before 9.6 the engine accumulated dQ into memory it did not clear itself (the
      // frontend cleared it for them).
      OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
          ws + w.dq_accum_offset, 0, w.softmax_sum_offset - w.dq_accum_offset, stream));
    }
    const int64_t part = static_cast<int64_t>(C) * 2;
    const char* in = static_cast<const char*>(qkv);
    char* grad = static_cast<char*>(dqkv);
    namespace uid = sdpa_uid;
    const int64_t uids[] = {uid::kQ,      uid::kK,   uid::kV,          uid::kO,      uid::kStats,
                            uid::kDO,     uid::kDQ,  uid::kDK,         uid::kDV,     uid::kScale,
                            uid::kNegInf, uid::kOne, uid::kSoftmaxSum, uid::kDqAccum};
    void* ptrs[] = {const_cast<char*>(in),
                    const_cast<char*>(in + part),
                    const_cast<char*>(in + 2 * part),
                    const_cast<void*>(out),
                    const_cast<float*>(stats),
                    const_cast<void*>(dout),
                    grad,
                    grad + part,
                    grad + 2 * part,
                    &p.scalars.scale,
                    &p.scalars.neg_inf,
                    &p.scalars.one,
                    ws + w.softmax_sum_offset,
                    ws + w.dq_accum_offset};
    return Execute(p, uids, ptrs, sizeof(uids) / sizeof(uids[0]), ws + w.engine_offset, stream);
  }

 private:
  absl::StatusOr<int64_t> PrepareNew(int B, int T, int C, int NH) {
    if (const char* why = SdpaUnsupportedReason(B, T, C, NH)) {
      return absl::UnimplementedError(why);
    }
    if (lib_.version() == 91000 || lib_.version() == 91001) {
      // The frontend refuses these two for fused fp16/bf16 attention, forward and backward.
      return absl::UnimplementedError(
          "cuDNN 9.10.0 and 9.10.1 have known bugs in fused attention (9.10.2 or later)");
    }
    int64_t need = 0;
    for (const SdpaDirection d : {SdpaDirection::kForward, SdpaDirection::kBackward}) {
      const SdpaKey key = Key(B, T, C, NH, d);
      absl::StatusOr<std::unique_ptr<Plan>> plan = BuildPlan(key);
      if (!plan.ok()) {
        return absl::Status(plan.status().code(),
                            absl::StrCat(Describe(key), ": ", plan.status().message()));
      }
      need = std::max(need, (*plan)->workspace_bytes);
      plans_[key] = std::move(*plan);
      ++plans_built_;
    }
    return need;
  }

  // Operation graph -> engine configurations from the heuristics (mode A, then B, then the
  // fallback list) -> the first execution plan that finalizes on this device.
  absl::StatusOr<std::unique_ptr<Plan>> BuildPlan(const SdpaKey& key) {
    auto plan = std::make_unique<Plan>();
    OFFLOAD_ASSIGN_OR_RETURN(plan->graph, BuildSdpaOperationGraph(lib_, handle_, key));
    const SdpaLayout layout(key.B, key.T, key.C, key.NH);
    plan->scalars = SdpaScalarValues(layout, lib_.version());
    absl::Status last = absl::UnimplementedError("the heuristics offered no engine");
    for (const cudnnBackendHeurMode_t mode :
         {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_B, CUDNN_HEUR_MODE_FALLBACK}) {
      absl::StatusOr<std::vector<CudnnDescriptor>> configs = EngineConfigs(plan->graph, mode);
      if (!configs.ok()) {
        last = configs.status();
        continue;
      }
      for (CudnnDescriptor& config : *configs) {
        absl::StatusOr<CudnnDescriptor> exec = ExecutionPlan(config.get());
        if (!exec.ok()) {
          last = exec.status();
          continue;
        }
        int64_t count = 0;
        OFFLOAD_CUDNN_RETURN_IF_ERROR(
            lib_,
            lib_.api().BackendGetAttribute(exec->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                           CUDNN_TYPE_INT64, 1, &count, &plan->engine_bytes));
        plan->engine_config = std::move(config);
        plan->plan = std::move(*exec);
        plan->workspace_bytes = key.direction == SdpaDirection::kForward
                                    ? SdpaAlign(plan->engine_bytes)
                                    : layout.BackwardWorkspace(plan->engine_bytes).total_bytes;
        return plan;
      }
    }
    return absl::UnimplementedError(
        absl::StrCat("no cuDNN engine takes the graph (last: ", last.message(), ")"));
  }

  absl::StatusOr<std::vector<CudnnDescriptor>> EngineConfigs(const SdpaOperationGraph& graph,
                                                             cudnnBackendHeurMode_t mode) {
    OFFLOAD_ASSIGN_OR_RETURN(CudnnDescriptor heur,
                             CudnnDescriptor::Create(lib_, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR));
    Desc g = graph.graph.get();
    OFFLOAD_CUDNN_RETURN_IF_ERROR(
        lib_, lib_.api().BackendSetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH,
                                             CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &g));
    OFFLOAD_CUDNN_RETURN_IF_ERROR(
        lib_, lib_.api().BackendSetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_MODE,
                                             CUDNN_TYPE_HEUR_MODE, 1, &mode));
    OFFLOAD_CUDNN_RETURN_IF_ERROR(lib_, lib_.api().BackendFinalize(heur.get()));
    int64_t available = 0;
    OFFLOAD_CUDNN_RETURN_IF_ERROR(lib_, lib_.api().BackendGetAttribute(
                                            heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                            CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &available, nullptr));
    std::vector<CudnnDescriptor> configs;
    std::vector<Desc> raw;
    for (int64_t i = 0; i < available; ++i) {
      OFFLOAD_ASSIGN_OR_RETURN(CudnnDescriptor c,
                               CudnnDescriptor::Create(lib_, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
      raw.push_back(c.get());
      configs.push_back(std::move(c));
    }
    int64_t returned = 0;
    if (available > 0) {
      OFFLOAD_CUDNN_RETURN_IF_ERROR(
          lib_, lib_.api().BackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                               CUDNN_TYPE_BACKEND_DESCRIPTOR, available, &returned,
                                               raw.data()));
    }
    configs.resize(static_cast<size_t>(std::min(returned, available)));
    return configs;
  }

  absl::StatusOr<CudnnDescriptor> ExecutionPlan(Desc engine_config) {
    OFFLOAD_ASSIGN_OR_RETURN(
        CudnnDescriptor exec,
        CudnnDescriptor::Create(lib_, CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR));
    OFFLOAD_CUDNN_RETURN_IF_ERROR(
        lib_, lib_.api().BackendSetAttribute(exec.get(), CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
                                             CUDNN_TYPE_HANDLE, 1, &handle_));
    OFFLOAD_CUDNN_RETURN_IF_ERROR(
        lib_, lib_.api().BackendSetAttribute(exec.get(), CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                                             CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &engine_config));
    OFFLOAD_CUDNN_RETURN_IF_ERROR(lib_, lib_.api().BackendFinalize(exec.get()));
    return exec;
  }

  // Both plans exist, the workspace holds them, and every tensor's base is as aligned as the
  // graphs declare (16 bytes).
  absl::Status CheckRunnable(int B, int T, int C, int NH, std::initializer_list<const void*> ptrs) {
    if (!Supports(B, T, C, NH)) {
      return absl::FailedPreconditionError(
          absl::StrCat("CudnnAttention: no usable plan for B=", B, " T=", T, " C=", C, " NH=", NH));
    }
    for (const void* p : ptrs) {
      if (p == nullptr || !Aligned16(p)) {
        return absl::InvalidArgumentError(
            "CudnnAttention: every tensor must be non-null and 16-byte aligned");
      }
    }
    return absl::OkStatus();
  }

  absl::Status Execute(const Plan& p, const int64_t* uids, void* const* ptrs, int n,
                       void* workspace, cudaStream_t stream) {
    OFFLOAD_CUDNN_RETURN_IF_ERROR(lib_, lib_.api().SetStream(handle_, stream));
    OFFLOAD_ASSIGN_OR_RETURN(CudnnDescriptor pack,
                             CudnnDescriptor::Create(lib_, CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR));
    OFFLOAD_CUDNN_RETURN_IF_ERROR(
        lib_, lib_.api().BackendSetAttribute(pack.get(), CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
                                             CUDNN_TYPE_INT64, n, uids));
    OFFLOAD_CUDNN_RETURN_IF_ERROR(
        lib_, lib_.api().BackendSetAttribute(pack.get(), CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
                                             CUDNN_TYPE_VOID_PTR, n, ptrs));
    OFFLOAD_CUDNN_RETURN_IF_ERROR(
        lib_, lib_.api().BackendSetAttribute(pack.get(), CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
                                             CUDNN_TYPE_VOID_PTR, 1, &workspace));
    OFFLOAD_CUDNN_RETURN_IF_ERROR(lib_, lib_.api().BackendFinalize(pack.get()));
    OFFLOAD_CUDNN_RETURN_IF_ERROR(lib_,
                                  lib_.api().BackendExecute(handle_, p.plan.get(), pack.get()));
    return absl::OkStatus();
  }

  const CudnnLibrary& lib_;
  cudnnHandle_t handle_;
  const DType dtype_;
  absl::flat_hash_map<SdpaKey, std::unique_ptr<Plan>> plans_;
  // Prepare's outcome per shape, under the shape's forward key.
  struct Prepared {
    absl::Status status;
    int64_t bytes = 0;
  };
  absl::flat_hash_map<SdpaKey, Prepared> prepared_;
  absl::flat_hash_set<SdpaKey> logged_;  // shapes whose "cannot run" line has been written
  void* workspace_ = nullptr;
  int64_t workspace_bytes_ = 0;
  int plans_built_ = 0;
};

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(DType dtype) {
  if (dtype != DType::kFp16 && dtype != DType::kBf16) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuDNN's fused attention takes fp16 or bf16, not ", DTypeName(dtype)));
  }
  OFFLOAD_ASSIGN_OR_RETURN(const CudnnLibrary* lib, CudnnLibrary::Shared());
  cudnnHandle_t handle = nullptr;
  OFFLOAD_CUDNN_RETURN_IF_ERROR(*lib, lib->api().Create(&handle));
  return std::unique_ptr<CudnnAttention>(
      new CudnnAttention(std::make_unique<Impl>(*lib, handle, dtype)));
}

CudnnAttention::CudnnAttention(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudnnAttention::~CudnnAttention() = default;

int64_t CudnnAttention::version() const { return impl_->version(); }
DType CudnnAttention::dtype() const { return impl_->dtype(); }
absl::StatusOr<int64_t> CudnnAttention::Prepare(int B, int T, int C, int NH) {
  return impl_->Prepare(B, T, C, NH);
}
void CudnnAttention::SetWorkspace(void* workspace, int64_t bytes) {
  impl_->SetWorkspace(workspace, bytes);
}
bool CudnnAttention::Supports(int B, int T, int C, int NH) { return impl_->Supports(B, T, C, NH); }
absl::Status CudnnAttention::Forward(void* out, float* stats, const void* qkv, int B, int T, int C,
                                     int NH, cudaStream_t stream) {
  return impl_->Forward(out, stats, qkv, B, T, C, NH, stream);
}
absl::Status CudnnAttention::Backward(void* dqkv, const void* dout, const void* qkv,
                                      const void* out, const float* stats, int B, int T, int C,
                                      int NH, cudaStream_t stream) {
  return impl_->Backward(dqkv, dout, qkv, out, stats, B, T, C, NH, stream);
}
int CudnnAttention::plans_built() const { return impl_->plans_built(); }

}  // namespace offload
