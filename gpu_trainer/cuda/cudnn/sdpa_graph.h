// The arithmetic of cuDNN's fused causal attention graphs for this model's layouts: the dims and
// strides of every tensor, the unique ids the variant pack names them by, the softmax scale, the
// backward's fp32 regions in the workspace, and the key a plan is cached under. Host-only (no
// CUDA or cuDNN headers), so it is tested on any machine (sdpa_graph_test.cc); the descriptors
// are made from it in sdpa_backend_graph.h and run in cudnn_attention.h.
//
// cuDNN reads Q, K and V where the model's QKV product left them, and writes O where the output
// projection reads it, so nothing is permuted: the views below are strided windows into
//   qkv  (B, T, 3C)  Q in channels [0, C), K in [C, 2C), V in [2C, 3C), head h at [h hs, (h+1) hs)
//   atty (B, T, C)   head h at [h hs, (h+1) hs)
// with hs = C / NH. Each is a 4-d (B, NH, T, hs) view whose element (b, h, t, i) sits at
// b s0 + h s1 + t s2 + i s3 elements from the view's base (the buffer plus a channel offset).
#ifndef OFFLOAD_GPU_TRAINER_CUDA_CUDNN_SDPA_GRAPH_H_
#define OFFLOAD_GPU_TRAINER_CUDA_CUDNN_SDPA_GRAPH_H_

#include <array>
#include <cstdint>
#include <utility>

namespace offload {

enum class SdpaDirection : int { kForward = 0, kBackward = 1 };
// The 16-bit storage types cuDNN's fused attention takes; fp32 has no fused engine.
enum class SdpaDType : int { kHalf = 0, kBfloat16 = 1 };

// What a cached execution plan is for: everything that changes the graph. The pointers are not
// part of it (they go in the variant pack at each call), nor the layer.
struct SdpaKey {
  int B = 0;
  int T = 0;
  int C = 0;
  int NH = 0;
  SdpaDType dtype = SdpaDType::kBfloat16;
  SdpaDirection direction = SdpaDirection::kForward;

  friend bool operator==(const SdpaKey& a, const SdpaKey& b) {
    return a.B == b.B && a.T == b.T && a.C == b.C && a.NH == b.NH && a.dtype == b.dtype &&
           a.direction == b.direction;
  }
  friend bool operator!=(const SdpaKey& a, const SdpaKey& b) { return !(a == b); }
  template <typename H>
  friend H AbslHashValue(H h, const SdpaKey& k) {
    return H::combine(std::move(h), k.B, k.T, k.C, k.NH, static_cast<int>(k.dtype),
                      static_cast<int>(k.direction));
  }
};

// A 4-d strided view as cuDNN's tensor descriptor takes it.
struct SdpaTensor {
  std::array<int64_t, 4> dims{};
  std::array<int64_t, 4> strides{};

  // Elements from the view's base to element (i0, i1, i2, i3).
  int64_t Offset(int64_t i0, int64_t i1, int64_t i2, int64_t i3) const {
    return i0 * strides[0] + i1 * strides[1] + i2 * strides[2] + i3 * strides[3];
  }
  int64_t NumElements() const { return dims[0] * dims[1] * dims[2] * dims[3]; }
  friend bool operator==(const SdpaTensor& a, const SdpaTensor& b) {
    return a.dims == b.dims && a.strides == b.strides;
  }
};

// The unique ids of the graphs' non-virtual tensors, what the variant pack names pointers by.
// Virtual tensors (the scores and everything between the products) take ids from
// kFirstVirtual up, in the order the graph makes them.
namespace sdpa_uid {
inline constexpr int64_t kQ = 1;
inline constexpr int64_t kK = 2;
inline constexpr int64_t kV = 3;
inline constexpr int64_t kO = 4;
inline constexpr int64_t kStats = 5;
inline constexpr int64_t kDO = 6;
inline constexpr int64_t kDQ = 7;
inline constexpr int64_t kDK = 8;
inline constexpr int64_t kDV = 9;
// fp32 scalars passed by value (a host pointer in the variant pack).
inline constexpr int64_t kScale = 10;
inline constexpr int64_t kNegInf = 11;  // what the causal mask puts above the diagonal
inline constexpr int64_t kOne = 12;     // backward: sum(dO * O) times one (no dropout)
// Backward's fp32 intermediates that are not virtual: cuDNN wants memory for them, which this
// code places in the workspace ahead of the engine's own (SdpaBackwardWorkspace).
inline constexpr int64_t kSoftmaxSum = 13;  // (B, NH, T, 1) sum over i of dO * O
inline constexpr int64_t kDqAccum = 14;     // (B, NH, T, hs) dQ accumulated in fp32
inline constexpr int64_t kFirstVirtual = 100;
}  // namespace sdpa_uid

// Why cuDNN's fused causal attention cannot run (B, T, C, NH) over this model's layouts (a
// static string), or nullptr when it can. The limits are those the cuDNN frontend checks before
// it builds the same graphs (its sdpa_support_surface.h, cuDNN 9): a head size that is a
// multiple of 8 (this code also keeps it at most 128, the range every cuDNN 9 release supports
// on Hopper and Ampere, forward and backward), no backward for s_q = s_kv = 1, and 16-byte
// aligned bases, which K's and V's (C and 2C 16-bit elements into a row) are when C is a
// multiple of 8.
const char* SdpaUnsupportedReason(int B, int T, int C, int NH);

// Bytes rounded up to 256, the alignment of every region this code places in a workspace.
inline int64_t SdpaAlign(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// fp32 statistics one layer saves, padded to 64 floats (256 bytes) so that every layer's block
// of a (L, ...) stack starts as aligned as the stack (cuDNN asks 16 bytes of each tensor).
inline int64_t SdpaStatsLayerFloats(int B, int NH, int T) {
  return (int64_t{B} * NH * T + 63) / 64 * 64;
}

// Backward's workspace: the fp32 dQ accumulator, then the per-row sum of dO * O, then what the
// engine itself asked (CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE), each 256-byte aligned.
struct SdpaBackwardWorkspace {
  int64_t dq_accum_offset = 0;
  int64_t softmax_sum_offset = 0;
  int64_t engine_offset = 0;
  int64_t total_bytes = 0;
};

class SdpaLayout {
 public:
  // Assumes SdpaUnsupportedReason(B, T, C, NH) == nullptr.
  SdpaLayout(int B, int T, int C, int NH);

  int64_t B() const { return B_; }
  int64_t T() const { return T_; }
  int64_t C() const { return C_; }
  int64_t NH() const { return NH_; }
  int64_t hs() const { return hs_; }

  // The softmax's scale, 1 / sqrt(hs): what the reference folds into its first product.
  float scale() const;

  // Q (part 0), K (1) or V (2), and dQ, dK, dV in dqkv alike: (B, NH, T, hs) into a (B, T, 3C)
  // buffer, strides (T 3C, hs, 3C, 1), based QkvOffset(part) elements into it.
  SdpaTensor Qkv(int part) const;
  static int64_t QkvOffset(int part, int64_t C) { return part * C; }
  int64_t QkvOffset(int part) const { return QkvOffset(part, C_); }
  // K or V seen transposed, (B, NH, hs, T): the same elements, the last two strides swapped.
  // cuDNN's products take their second operand this way (KT for Q KT, VT for dO VT).
  SdpaTensor QkvTransposed(int part) const;
  // O, and dO alike: (B, NH, T, hs) into a (B, T, C) buffer, strides (T C, hs, C, 1).
  SdpaTensor Out() const;
  // The softmax statistics, max + log(sum(exp)) of each row: (B, NH, T, 1) fp32, contiguous.
  // The per-row reductions inside the graphs have this shape too.
  SdpaTensor Stats() const;
  // The scores and everything elementwise after them: (B, NH, T, T), row-major.
  SdpaTensor Scores() const;
  // The same (B, NH, T, T) elements seen as their transposes, for the products that take P^T
  // and dS^T (dV = P^T dO, dK = dS^T Q).
  SdpaTensor ScoresTransposed() const;
  // dO * O before its row sum, as the cuDNN frontend shapes that virtual tensor.
  SdpaTensor DoTimesO() const;
  // The fp32 dQ accumulator, (B, NH, T, hs) contiguous.
  SdpaTensor DqAccum() const;
  // A by-value scalar: one element, broadcast against the 4-d operands.
  static SdpaTensor Scalar();

  // Where backward's regions go in a workspace of which the engine asks engine_bytes.
  SdpaBackwardWorkspace BackwardWorkspace(int64_t engine_bytes) const;

 private:
  int64_t B_, T_, C_, NH_, hs_;
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_CUDNN_SDPA_GRAPH_H_
