#include "gpu_trainer/cuda/cudnn/sdpa_graph.h"

#include <cmath>
#include <cstdint>
#include <utility>

namespace offload {

const char* SdpaUnsupportedReason(int B, int T, int C, int NH) {
  if (B <= 0 || T <= 0 || C <= 0 || NH <= 0 || C % NH != 0) {
    return "a bad shape (B, T, C, NH all positive, C a multiple of NH)";
  }
  const int hs = C / NH;
  if (hs % 8 != 0) return "the head size is not a multiple of 8";
  if (hs > 128) return "the head size is above 128";
  if (C % 8 != 0)
    return "the channels are not a multiple of 8 (K and V would not be 16-byte aligned)";
  if (T < 2) return "a sequence of one token (cuDNN has no backward for s_q = s_kv = 1)";
  return nullptr;
}

SdpaLayout::SdpaLayout(int B, int T, int C, int NH)
    : B_(B), T_(T), C_(C), NH_(NH), hs_(NH > 0 ? C / NH : 0) {}

float SdpaLayout::scale() const { return 1.0f / std::sqrt(static_cast<float>(hs_)); }

SdpaTensor SdpaLayout::Qkv(int /*part*/) const {
  // Every part has the same strides; the part only moves the base (QkvOffset).
  const int64_t row = 3 * C_;  // elements between consecutive tokens of a sequence
  return SdpaTensor{{B_, NH_, T_, hs_}, {T_ * row, hs_, row, 1}};
}

SdpaTensor SdpaLayout::QkvTransposed(int part) const {
  SdpaTensor t = Qkv(part);
  std::swap(t.dims[2], t.dims[3]);
  std::swap(t.strides[2], t.strides[3]);
  return t;
}

SdpaTensor SdpaLayout::Out() const { return SdpaTensor{{B_, NH_, T_, hs_}, {T_ * C_, hs_, C_, 1}}; }

SdpaTensor SdpaLayout::Stats() const { return SdpaTensor{{B_, NH_, T_, 1}, {NH_ * T_, T_, 1, 1}}; }

SdpaTensor SdpaLayout::Scores() const {
  return SdpaTensor{{B_, NH_, T_, T_}, {NH_ * T_ * T_, T_ * T_, T_, 1}};
}

SdpaTensor SdpaLayout::ScoresTransposed() const {
  return SdpaTensor{{B_, NH_, T_, T_}, {NH_ * T_ * T_, T_ * T_, 1, T_}};
}

SdpaTensor SdpaLayout::DoTimesO() const {
  // The frontend's (b, h, s, d) strides (h s d, s d, h d, 1) for this virtual tensor: never
  // stored, so only its dims matter to cuDNN, but the fused engine's pattern matcher has been
  // tested with exactly these.
  return SdpaTensor{{B_, NH_, T_, hs_}, {NH_ * T_ * hs_, T_ * hs_, NH_ * hs_, 1}};
}

SdpaTensor SdpaLayout::DqAccum() const {
  return SdpaTensor{{B_, NH_, T_, hs_}, {NH_ * T_ * hs_, T_ * hs_, hs_, 1}};
}

SdpaTensor SdpaLayout::Scalar() { return SdpaTensor{{1, 1, 1, 1}, {1, 1, 1, 1}}; }

SdpaBackwardWorkspace SdpaLayout::BackwardWorkspace(int64_t engine_bytes) const {
  SdpaBackwardWorkspace w;
  const int64_t dq_accum_bytes = B_ * NH_ * T_ * hs_ * static_cast<int64_t>(sizeof(float));
  const int64_t softmax_sum_bytes = B_ * NH_ * T_ * static_cast<int64_t>(sizeof(float));
  w.dq_accum_offset = 0;
  w.softmax_sum_offset = SdpaAlign(dq_accum_bytes);
  w.engine_offset = w.softmax_sum_offset + SdpaAlign(softmax_sum_bytes);
  w.total_bytes = w.engine_offset + SdpaAlign(engine_bytes);
  return w;
}

}  // namespace offload
