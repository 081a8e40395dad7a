#include "gpu_trainer/cuda/cudnn/sdpa_backend_graph.h"

#include <cudnn_graph.h>

#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/status_macros.h"
#include "gpu_trainer/cuda/cudnn/cudnn_library.h"
#include "gpu_trainer/cuda/cudnn/sdpa_graph.h"

namespace offload {

CudnnDescriptor& CudnnDescriptor::operator=(CudnnDescriptor&& other) noexcept {
  if (this != &other) {
    Reset();
    lib_ = other.lib_;
    desc_ = other.desc_;
    other.desc_ = nullptr;
  }
  return *this;
}

absl::StatusOr<CudnnDescriptor> CudnnDescriptor::Create(const CudnnLibrary& lib,
                                                        cudnnBackendDescriptorType_t type) {
  CudnnDescriptor d;
  d.lib_ = &lib;
  OFFLOAD_CUDNN_RETURN_IF_ERROR(lib, lib.api().BackendCreateDescriptor(type, &d.desc_));
  return d;
}

void CudnnDescriptor::Reset() {
  if (desc_ != nullptr) lib_->api().BackendDestroyDescriptor(desc_);
  desc_ = nullptr;
}

SdpaScalars SdpaScalarValues(const SdpaLayout& layout, int64_t cudnn_version) {
  SdpaScalars s;
  s.scale = layout.scale();
  s.neg_inf = cudnn_version < 91000 ? std::numeric_limits<float>::lowest()
                                    : -std::numeric_limits<float>::infinity();
  s.one = 1.0f;
  return s;
}

namespace {

using Desc = cudnnBackendDescriptor_t;

// Sets one attribute; the failing call's text names the attribute.
#define OFFLOAD_CUDNN_SET(desc, name, type, count, values) \
  OFFLOAD_CUDNN_RETURN_IF_ERROR(lib_,                      \
                                lib_.api().BackendSetAttribute(desc, name, type, count, values))
#define OFFLOAD_CUDNN_FINALIZE(desc) \
  OFFLOAD_CUDNN_RETURN_IF_ERROR(lib_, lib_.api().BackendFinalize(desc))

// Makes the descriptors of one graph, keeping each alive in parts_ and each operation in ops_
// in the order made (the order the cuDNN frontend makes them in).
class GraphBuilder {
 public:
  explicit GraphBuilder(const CudnnLibrary& lib) : lib_(lib) {}

  // A tensor: data type, dims, strides, uid, 16-byte alignment (what the frontend declares for
  // every tensor; this model's bases meet it: SdpaUnsupportedReason), virtual (intermediates
  // that never reach memory) or passed by value (host scalars).
  absl::StatusOr<Desc> Tensor(int64_t uid, const SdpaTensor& t, cudnnDataType_t type,
                              bool is_virtual = false, bool by_value = false) {
    OFFLOAD_ASSIGN_OR_RETURN(Desc d, Make(CUDNN_BACKEND_TENSOR_DESCRIPTOR));
    const int64_t alignment = 16;
    OFFLOAD_CUDNN_SET(d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
    OFFLOAD_CUDNN_SET(d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, t.dims.data());
    OFFLOAD_CUDNN_SET(d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, t.strides.data());
    OFFLOAD_CUDNN_SET(d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    OFFLOAD_CUDNN_SET(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
    if (is_virtual) {
      const bool yes = true;
      OFFLOAD_CUDNN_SET(d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &yes);
    }
    if (by_value) {
      const bool yes = true;
      OFFLOAD_CUDNN_SET(d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &yes);
    }
    OFFLOAD_CUDNN_FINALIZE(d);
    return d;
  }
  // An intermediate, with the next virtual uid.
  absl::StatusOr<Desc> Virtual(const SdpaTensor& t, cudnnDataType_t type) {
    return Tensor(next_virtual_uid_++, t, type, /*is_virtual=*/true);
  }

  // c = a @ b over the last two dims, batched over the first two, fp32 accumulation.
  absl::Status Matmul(Desc a, Desc b, Desc c) {
    OFFLOAD_ASSIGN_OR_RETURN(Desc m, Make(CUDNN_BACKEND_MATMUL_DESCRIPTOR));
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    OFFLOAD_CUDNN_SET(m, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute);
    OFFLOAD_CUDNN_FINALIZE(m);
    OFFLOAD_ASSIGN_OR_RETURN(Desc op, Make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR));
    OFFLOAD_CUDNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a);
    OFFLOAD_CUDNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    OFFLOAD_CUDNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c);
    OFFLOAD_CUDNN_SET(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &m);
    OFFLOAD_CUDNN_FINALIZE(op);
    ops_.push_back(op);
    return absl::OkStatus();
  }

  // y = mode(x[, b[, t]]) elementwise, computing in `math`; b and t broadcast. GEN_INDEX takes
  // the axis whose index it writes.
  absl::Status Pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t math, Desc x, Desc b, Desc t,
                         Desc y, int64_t axis = -1) {
    OFFLOAD_ASSIGN_OR_RETURN(Desc pw, Make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR));
    OFFLOAD_CUDNN_SET(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    OFFLOAD_CUDNN_SET(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math);
    if (mode == CUDNN_POINTWISE_GEN_INDEX) {
      OFFLOAD_CUDNN_SET(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    }
    OFFLOAD_CUDNN_FINALIZE(pw);
    OFFLOAD_ASSIGN_OR_RETURN(Desc op, Make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR));
    OFFLOAD_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR,
                      CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw);
    OFFLOAD_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                      &x);
    if (b != nullptr) {
      OFFLOAD_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                        &b);
    }
    if (t != nullptr) {
      OFFLOAD_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                        &t);
    }
    OFFLOAD_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                      &y);
    // y = op(alpha1 x, alpha2 b): ones, as the frontend sets them.
    const float one = 1.0f;
    OFFLOAD_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one);
    OFFLOAD_CUDNN_SET(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
    OFFLOAD_CUDNN_FINALIZE(op);
    ops_.push_back(op);
    return absl::OkStatus();
  }
  absl::Status Unary(cudnnPointwiseMode_t mode, Desc x, Desc y) {
    return Pointwise(mode, CUDNN_DATA_FLOAT, x, nullptr, nullptr, y);
  }
  absl::Status Binary(cudnnPointwiseMode_t mode, Desc x, Desc b, Desc y) {
    return Pointwise(mode, CUDNN_DATA_FLOAT, x, b, nullptr, y);
  }

  // y = op over the dims where y is 1 and x is not, in fp32.
  absl::Status Reduction(cudnnReduceTensorOp_t reduce, Desc x, Desc y) {
    OFFLOAD_ASSIGN_OR_RETURN(Desc r, Make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR));
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    OFFLOAD_CUDNN_SET(r, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute);
    OFFLOAD_CUDNN_SET(r, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1,
                      &reduce);
    OFFLOAD_CUDNN_FINALIZE(r);
    OFFLOAD_ASSIGN_OR_RETURN(Desc op, Make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR));
    OFFLOAD_CUDNN_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                      &r);
    OFFLOAD_CUDNN_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                      &x);
    OFFLOAD_CUDNN_SET(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                      &y);
    OFFLOAD_CUDNN_FINALIZE(op);
    ops_.push_back(op);
    return absl::OkStatus();
  }

  // y: the elements of x under y's dims and strides (here: a transpose, by strides alone).
  absl::Status Reshape(Desc x, Desc y) {
    OFFLOAD_ASSIGN_OR_RETURN(Desc op, Make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR));
    OFFLOAD_CUDNN_SET(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    OFFLOAD_CUDNN_SET(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    OFFLOAD_CUDNN_FINALIZE(op);
    ops_.push_back(op);
    return absl::OkStatus();
  }

  absl::StatusOr<SdpaOperationGraph> Finish(cudnnHandle_t handle) {
    SdpaOperationGraph g;
    OFFLOAD_ASSIGN_OR_RETURN(
        g.graph, CudnnDescriptor::Create(lib_, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR));
    OFFLOAD_CUDNN_SET(g.graph.get(), CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                      static_cast<int64_t>(ops_.size()), ops_.data());
    if (handle != nullptr) {
      OFFLOAD_CUDNN_SET(g.graph.get(), CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1,
                        &handle);
    }
    OFFLOAD_CUDNN_FINALIZE(g.graph.get());
    g.parts = std::move(parts_);
    g.num_operations = static_cast<int>(ops_.size());
    return g;
  }

 private:
  absl::StatusOr<Desc> Make(cudnnBackendDescriptorType_t type) {
    OFFLOAD_ASSIGN_OR_RETURN(CudnnDescriptor d, CudnnDescriptor::Create(lib_, type));
    parts_.push_back(std::move(d));
    return parts_.back().get();
  }

  const CudnnLibrary& lib_;
  std::vector<CudnnDescriptor> parts_;
  std::vector<Desc> ops_;
  int64_t next_virtual_uid_ = sdpa_uid::kFirstVirtual;
};

#undef OFFLOAD_CUDNN_SET
#undef OFFLOAD_CUDNN_FINALIZE

constexpr cudnnDataType_t kF32 = CUDNN_DATA_FLOAT;

// scores with -inf (or the lowest float) where the key comes after the query: the frontend's
// top-left causal mask, a right bound of 0 (its diagonal band mask for cuDNN before 9.21). The
// row and column indices are generated as int32, compared into a boolean, and selected on.
absl::StatusOr<Desc> CausalMask(GraphBuilder& g, const SdpaLayout& s, Desc scores, Desc neg_inf) {
  OFFLOAD_ASSIGN_OR_RETURN(Desc row, g.Virtual(s.Scores(), CUDNN_DATA_INT32));
  OFFLOAD_RETURN_IF_ERROR(
      g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, kF32, scores, nullptr, nullptr, row, /*axis=*/2));
  OFFLOAD_ASSIGN_OR_RETURN(Desc col, g.Virtual(s.Scores(), CUDNN_DATA_INT32));
  OFFLOAD_RETURN_IF_ERROR(
      g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, kF32, scores, nullptr, nullptr, col, /*axis=*/3));
  OFFLOAD_ASSIGN_OR_RETURN(Desc keep, g.Virtual(s.Scores(), CUDNN_DATA_BOOLEAN));
  OFFLOAD_RETURN_IF_ERROR(
      g.Pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, nullptr, keep));
  // BINARY_SELECT: y = t ? x : b.
  OFFLOAD_ASSIGN_OR_RETURN(Desc masked, g.Virtual(s.Scores(), kF32));
  OFFLOAD_RETURN_IF_ERROR(
      g.Pointwise(CUDNN_POINTWISE_BINARY_SELECT, kF32, scores, neg_inf, keep, masked));
  return masked;
}

absl::Status BuildForward(GraphBuilder& g, const SdpaLayout& s, cudnnDataType_t io) {
  namespace uid = sdpa_uid;
  OFFLOAD_ASSIGN_OR_RETURN(Desc q, g.Tensor(uid::kQ, s.Qkv(0), io));
  OFFLOAD_ASSIGN_OR_RETURN(Desc kt, g.Tensor(uid::kK, s.QkvTransposed(1), io));
  OFFLOAD_ASSIGN_OR_RETURN(Desc v, g.Tensor(uid::kV, s.Qkv(2), io));
  OFFLOAD_ASSIGN_OR_RETURN(Desc o, g.Tensor(uid::kO, s.Out(), io));
  OFFLOAD_ASSIGN_OR_RETURN(Desc stats, g.Tensor(uid::kStats, s.Stats(), kF32));
  OFFLOAD_ASSIGN_OR_RETURN(Desc scale, g.Tensor(uid::kScale, SdpaLayout::Scalar(), kF32,
                                                /*is_virtual=*/false, /*by_value=*/true));
  OFFLOAD_ASSIGN_OR_RETURN(Desc neg_inf, g.Tensor(uid::kNegInf, SdpaLayout::Scalar(), kF32,
                                                  /*is_virtual=*/false, /*by_value=*/true));

  OFFLOAD_ASSIGN_OR_RETURN(Desc scores, g.Virtual(s.Scores(), kF32));
  OFFLOAD_RETURN_IF_ERROR(g.Matmul(q, kt, scores));
  OFFLOAD_ASSIGN_OR_RETURN(Desc scaled, g.Virtual(s.Scores(), kF32));
  OFFLOAD_RETURN_IF_ERROR(g.Binary(CUDNN_POINTWISE_MUL, scores, scale, scaled));
  OFFLOAD_ASSIGN_OR_RETURN(Desc masked, CausalMask(g, s, scaled, neg_inf));

  // The softmax with its statistics, as the frontend composes it for cuDNN before 9.21.
  OFFLOAD_ASSIGN_OR_RETURN(Desc row_max, g.Virtual(s.Stats(), kF32));
  OFFLOAD_RETURN_IF_ERROR(g.Reduction(CUDNN_REDUCE_TENSOR_MAX, masked, row_max));
  OFFLOAD_ASSIGN_OR_RETURN(Desc centered, g.Virtual(s.Scores(), kF32));
  OFFLOAD_RETURN_IF_ERROR(g.Binary(CUDNN_POINTWISE_SUB, masked, row_max, centered));
  OFFLOAD_ASSIGN_OR_RETURN(Desc exps, g.Virtual(s.Scores(), kF32));
  OFFLOAD_RETURN_IF_ERROR(g.Unary(CUDNN_POINTWISE_EXP, centered, exps));
  OFFLOAD_ASSIGN_OR_RETURN(Desc row_sum, g.Virtual(s.Stats(), kF32));
  OFFLOAD_RETURN_IF_ERROR(g.Reduction(CUDNN_REDUCE_TENSOR_ADD, exps, row_sum));
  OFFLOAD_ASSIGN_OR_RETURN(Desc log_sum, g.Virtual(s.Stats(), kF32));
  OFFLOAD_RETURN_IF_ERROR(g.Unary(CUDNN_POINTWISE_LOG, row_sum, log_sum));
  OFFLOAD_RETURN_IF_ERROR(g.Binary(CUDNN_POINTWISE_ADD, row_max, log_sum, stats));
  // P in the storage type: the engine takes the second product's A operand in the I/O type
  // (the frontend sets it so), as the reference rounds its softmax weights to T.
  OFFLOAD_ASSIGN_OR_RETURN(Desc probs, g.Virtual(s.Scores(), io));
  OFFLOAD_RETURN_IF_ERROR(g.Binary(CUDNN_POINTWISE_DIV, exps, row_sum, probs));
  return g.Matmul(probs, v, o);
}

absl::Status BuildBackward(GraphBuilder& g, const SdpaLayout& s, cudnnDataType_t io) {
  namespace uid = sdpa_uid;
  OFFLOAD_ASSIGN_OR_RETURN(Desc q, g.Tensor(uid::kQ, s.Qkv(0), io));
  OFFLOAD_ASSIGN_OR_RETURN(Desc kt, g.Tensor(uid::kK, s.QkvTransposed(1), io));
  OFFLOAD_ASSIGN_OR_RETURN(Desc vt, g.Tensor(uid::kV, s.QkvTransposed(2), io));
  OFFLOAD_ASSIGN_OR_RETURN(Desc o, g.Tensor(uid::kO, s.Out(), io));
  OFFLOAD_ASSIGN_OR_RETURN(Desc stats, g.Tensor(uid::kStats, s.Stats(), kF32));
  OFFLOAD_ASSIGN_OR_RETURN(Desc d_o, g.Tensor(uid::kDO, s.Out(), io));
  OFFLOAD_ASSIGN_OR_RETURN(Desc dq, g.Tensor(uid::kDQ, s.Qkv(0), io));
  OFFLOAD_ASSIGN_OR_RETURN(Desc dk, g.Tensor(uid::kDK, s.Qkv(1), io));
  OFFLOAD_ASSIGN_OR_RETURN(Desc dv, g.Tensor(uid::kDV, s.Qkv(2), io));
  OFFLOAD_ASSIGN_OR_RETURN(Desc scale, g.Tensor(uid::kScale, SdpaLayout::Scalar(), kF32,
                                                /*is_virtual=*/false, /*by_value=*/true));
  OFFLOAD_ASSIGN_OR_RETURN(Desc neg_inf, g.Tensor(uid::kNegInf, SdpaLayout::Scalar(), kF32,
                                                  /*is_virtual=*/false, /*by_value=*/true));
  OFFLOAD_ASSIGN_OR_RETURN(Desc one, g.Tensor(uid::kOne, SdpaLayout::Scalar(), kF32,
                                              /*is_virtual=*/false, /*by_value=*/true));
  // Not virtual: the engine stores them, in memory this code places in the workspace.
  OFFLOAD_ASSIGN_OR_RETURN(Desc softmax_sum, g.Tensor(uid::kSoftmaxSum, s.Stats(), kF32));
  OFFLOAD_ASSIGN_OR_RETURN(Desc dq_accum, g.Tensor(uid::kDqAccum, s.DqAccum(), kF32));

  // Dsum = sum_i dO * O, per row, times one (the frontend's dropout scale, 1 without dropout).
  OFFLOAD_ASSIGN_OR_RETURN(Desc do_o, g.Virtual(s.DoTimesO(), kF32));
  OFFLOAD_RETURN_IF_ERROR(g.Binary(CUDNN_POINTWISE_MUL, d_o, o, do_o));
  OFFLOAD_ASSIGN_OR_RETURN(Desc do_o_sum, g.Virtual(s.Stats(), kF32));
  OFFLOAD_RETURN_IF_ERROR(g.Reduction(CUDNN_REDUCE_TENSOR_ADD, do_o, do_o_sum));
  OFFLOAD_RETURN_IF_ERROR(g.Binary(CUDNN_POINTWISE_MUL, do_o_sum, one, softmax_sum));

  // P = exp(Q KT * scale - Stats), masked: the forward's softmax, recomputed from its stats.
  OFFLOAD_ASSIGN_OR_RETURN(Desc scores, g.Virtual(s.Scores(), kF32));
  OFFLOAD_RETURN_IF_ERROR(g.Matmul(q, kt, scores));
  OFFLOAD_ASSIGN_OR_RETURN(Desc scaled, g.Virtual(s.Scores(), kF32));
  OFFLOAD_RETURN_IF_ERROR(g.Binary(CUDNN_POINTWISE_MUL, scores, scale, scaled));
  OFFLOAD_ASSIGN_OR_RETURN(Desc centered, g.Virtual(s.Scores(), kF32));
  OFFLOAD_RETURN_IF_ERROR(g.Binary(CUDNN_POINTWISE_SUB, scaled, stats, centered));
  OFFLOAD_ASSIGN_OR_RETURN(Desc masked, CausalMask(g, s, centered, neg_inf));
  OFFLOAD_ASSIGN_OR_RETURN(Desc probs, g.Virtual(s.Scores(), kF32));
  OFFLOAD_RETURN_IF_ERROR(g.Unary(CUDNN_POINTWISE_EXP, masked, probs));

  // dV = P^T dO, P^T in the storage type.
  OFFLOAD_ASSIGN_OR_RETURN(Desc probs_t, g.Virtual(s.ScoresTransposed(), io));
  OFFLOAD_RETURN_IF_ERROR(g.Reshape(probs, probs_t));
  OFFLOAD_RETURN_IF_ERROR(g.Matmul(probs_t, d_o, dv));

  // dS = (dO VT - Dsum) * P * scale.
  OFFLOAD_ASSIGN_OR_RETURN(Desc dp, g.Virtual(s.Scores(), kF32));
  OFFLOAD_RETURN_IF_ERROR(g.Matmul(d_o, vt, dp));
  OFFLOAD_ASSIGN_OR_RETURN(Desc dp_centered, g.Virtual(s.Scores(), kF32));
  OFFLOAD_RETURN_IF_ERROR(g.Binary(CUDNN_POINTWISE_SUB, dp, softmax_sum, dp_centered));
  OFFLOAD_ASSIGN_OR_RETURN(Desc ds_unscaled, g.Virtual(s.Scores(), kF32));
  OFFLOAD_RETURN_IF_ERROR(g.Binary(CUDNN_POINTWISE_MUL, dp_centered, probs, ds_unscaled));
  OFFLOAD_ASSIGN_OR_RETURN(Desc ds, g.Virtual(s.Scores(), kF32));
  OFFLOAD_RETURN_IF_ERROR(g.Binary(CUDNN_POINTWISE_MUL, ds_unscaled, scale, ds));

  // dK = dS^T Q, dS^T in the storage type.
  OFFLOAD_ASSIGN_OR_RETURN(Desc ds_t, g.Virtual(s.ScoresTransposed(), io));
  OFFLOAD_RETURN_IF_ERROR(g.Reshape(ds, ds_t));
  OFFLOAD_RETURN_IF_ERROR(g.Matmul(ds_t, q, dk));

  // dQ = dS K: K as (B, NH, T, hs) again, a reshape of KT; accumulated in fp32, then written
  // in the storage type. The reshaped K is fp32, as the frontend's is (its reshape leaves the
  // type unset, and a virtual tensor then takes the graph's intermediate type): dQ's product has
  // both operands in fp32, the pattern the fused backward engines match.
  OFFLOAD_ASSIGN_OR_RETURN(Desc k, g.Virtual(s.Qkv(1), kF32));
  OFFLOAD_RETURN_IF_ERROR(g.Reshape(kt, k));
  OFFLOAD_RETURN_IF_ERROR(g.Matmul(ds, k, dq_accum));
  return g.Unary(CUDNN_POINTWISE_IDENTITY, dq_accum, dq);
}

}  // namespace

absl::StatusOr<SdpaOperationGraph> BuildSdpaOperationGraph(const CudnnLibrary& lib,
                                                           cudnnHandle_t handle,
                                                           const SdpaKey& key) {
  const SdpaLayout layout(key.B, key.T, key.C, key.NH);
  const cudnnDataType_t io = key.dtype == SdpaDType::kHalf ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16;
  GraphBuilder g(lib);
  if (key.direction == SdpaDirection::kForward) {
    OFFLOAD_RETURN_IF_ERROR(BuildForward(g, layout, io));
  } else {
    OFFLOAD_RETURN_IF_ERROR(BuildBackward(g, layout, io));
  }
  return g.Finish(handle);
}

}  // namespace offload
