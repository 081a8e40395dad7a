// The arithmetic of the fused attention graphs, on any machine: every strided view addresses
// exactly the elements the reference attention (blas/attention.cu) reads and writes through its
// permutes, the transposed views are the same elements, the key tells every field apart, and the
// support rules and workspace layout say what they promise.
#include "gpu_trainer/cuda/cudnn/sdpa_graph.h"

#include <cmath>
#include <cstdint>
#include <set>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

struct Shape {
  int B, T, C, NH;
};

// Odd T, hs 16 and 64, more than one batch and head.
constexpr Shape kShapes[] = {{3, 17, 48, 3}, {2, 37, 128, 2}, {1, 5, 64, 1}};

// attention.cu's SplitHeadsKernel: element (b, h, t, i) of part `part` (Q 0, K 1, V 2) read from
// qkv (B, T, 3C). MergeHeadsKernel writes out's (b, t, h hs + i) and dqkv's alike.
int64_t ReferenceQkvIndex(const Shape& s, int part, int b, int h, int t, int i) {
  const int hs = s.C / s.NH;
  const int64_t ld = 3 * int64_t{s.C};
  return (int64_t{b} * s.T + t) * ld + int64_t{h} * hs + i + part * int64_t{s.C};
}
int64_t ReferenceOutIndex(const Shape& s, int b, int h, int t, int i) {
  const int hs = s.C / s.NH;
  return (int64_t{b} * s.T + t) * s.C + int64_t{h} * hs + i;
}

TEST(SdpaGraph, QkvViewsAddressWhatTheReferencePermuteReads) {
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(::testing::Message() << "B=" << s.B << " T=" << s.T << " C=" << s.C);
    ASSERT_EQ(SdpaUnsupportedReason(s.B, s.T, s.C, s.NH), nullptr);
    const SdpaLayout layout(s.B, s.T, s.C, s.NH);
    const int hs = s.C / s.NH;
    // Every element of qkv is addressed by exactly one (part, b, h, t, i): the three views
    // tile the buffer, none overlaps another or itself.
    std::vector<int> hits(static_cast<size_t>(s.B) * s.T * 3 * s.C, 0);
    for (int part = 0; part < 3; ++part) {
      const SdpaTensor v = layout.Qkv(part);
      EXPECT_EQ(v.dims, (std::array<int64_t, 4>{s.B, s.NH, s.T, hs}));
      EXPECT_EQ(v.strides,
                (std::array<int64_t, 4>{int64_t{s.T} * 3 * s.C, hs, 3 * int64_t{s.C}, 1}));
      const SdpaTensor vt = layout.QkvTransposed(part);
      for (int b = 0; b < s.B; ++b) {
        for (int h = 0; h < s.NH; ++h) {
          for (int t = 0; t < s.T; ++t) {
            for (int i = 0; i < hs; ++i) {
              const int64_t got = layout.QkvOffset(part) + v.Offset(b, h, t, i);
              ASSERT_EQ(got, ReferenceQkvIndex(s, part, b, h, t, i))
                  << "part " << part << " (" << b << ", " << h << ", " << t << ", " << i << ")";
              // The transposed view's (b, h, i, t) is the same element.
              ASSERT_EQ(layout.QkvOffset(part) + vt.Offset(b, h, i, t), got);
              ++hits[got];
            }
          }
        }
      }
    }
    for (size_t e = 0; e < hits.size(); ++e) ASSERT_EQ(hits[e], 1) << "qkv element " << e;
  }
}

TEST(SdpaGraph, OutViewAddressesWhatTheReferenceMergeWrites) {
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(::testing::Message() << "B=" << s.B << " T=" << s.T << " C=" << s.C);
    const SdpaLayout layout(s.B, s.T, s.C, s.NH);
    const int hs = s.C / s.NH;
    const SdpaTensor o = layout.Out();
    EXPECT_EQ(o.dims, (std::array<int64_t, 4>{s.B, s.NH, s.T, hs}));
    EXPECT_EQ(o.strides, (std::array<int64_t, 4>{int64_t{s.T} * s.C, hs, s.C, 1}));
    std::vector<int> hits(static_cast<size_t>(s.B) * s.T * s.C, 0);
    for (int b = 0; b < s.B; ++b) {
      for (int h = 0; h < s.NH; ++h) {
        for (int t = 0; t < s.T; ++t) {
          for (int i = 0; i < hs; ++i) {
            const int64_t got = o.Offset(b, h, t, i);
            ASSERT_EQ(got, ReferenceOutIndex(s, b, h, t, i));
            ++hits[got];
          }
        }
      }
    }
    for (size_t e = 0; e < hits.size(); ++e) ASSERT_EQ(hits[e], 1) << "out element " << e;
  }
}

TEST(SdpaGraph, StatsScoresAndAccumulatorAreContiguous) {
  const Shape s = kShapes[0];
  const SdpaLayout layout(s.B, s.T, s.C, s.NH);
  const int64_t B = s.B, T = s.T, NH = s.NH, hs = s.C / s.NH;
  EXPECT_EQ(layout.Stats().dims, (std::array<int64_t, 4>{B, NH, T, 1}));
  EXPECT_EQ(layout.Stats().strides, (std::array<int64_t, 4>{NH * T, T, 1, 1}));
  EXPECT_EQ(layout.Scores().dims, (std::array<int64_t, 4>{B, NH, T, T}));
  EXPECT_EQ(layout.Scores().strides, (std::array<int64_t, 4>{NH * T * T, T * T, T, 1}));
  // The transposed scores are the same elements: (b, h, j, t) of one is (b, h, t, j) of the
  // other.
  EXPECT_EQ(layout.ScoresTransposed().Offset(1, 2, 3, 4), layout.Scores().Offset(1, 2, 4, 3));
  EXPECT_EQ(layout.DqAccum().strides, (std::array<int64_t, 4>{NH * T * hs, T * hs, hs, 1}));
  EXPECT_EQ(layout.DoTimesO().dims, (std::array<int64_t, 4>{B, NH, T, hs}));
  EXPECT_EQ(SdpaLayout::Scalar().NumElements(), 1);
  // The row statistics of element (b, h, t) sit at (b NH + h) T + t: the order the reference's
  // (B, NH, T, T) softmax keeps its rows in.
  EXPECT_EQ(layout.Stats().Offset(2, 1, 5, 0), (2 * NH + 1) * T + 5);
}

TEST(SdpaGraph, ScaleIsOneOverTheSquareRootOfTheHeadSize) {
  EXPECT_FLOAT_EQ(SdpaLayout(1, 8, 48, 3).scale(), 0.25f);     // hs 16
  EXPECT_FLOAT_EQ(SdpaLayout(1, 8, 768, 12).scale(), 0.125f);  // hs 64
  EXPECT_FLOAT_EQ(SdpaLayout(1, 8, 96, 3).scale(), 1.0f / std::sqrt(32.0f));
}

TEST(SdpaGraph, UniqueIdsAreDistinctAndBelowTheVirtualOnes) {
  namespace uid = sdpa_uid;
  const std::vector<int64_t> ids = {
      uid::kQ,  uid::kK,  uid::kV,     uid::kO,      uid::kStats, uid::kDO,         uid::kDQ,
      uid::kDK, uid::kDV, uid::kScale, uid::kNegInf, uid::kOne,   uid::kSoftmaxSum, uid::kDqAccum};
  const std::set<int64_t> distinct(ids.begin(), ids.end());
  EXPECT_EQ(distinct.size(), ids.size());
  for (int64_t id : ids) {
    EXPECT_GT(id, 0);
    EXPECT_LT(id, uid::kFirstVirtual);
  }
}

TEST(SdpaGraph, KeyTellsEveryFieldApart) {
  const SdpaKey base{4, 1024, 768, 12, SdpaDType::kBfloat16, SdpaDirection::kForward};
  std::vector<SdpaKey> keys = {base};
  SdpaKey k = base;
  k.B = 2;
  keys.push_back(k);
  k = base;
  k.T = 512;
  keys.push_back(k);
  k = base;
  k.C = 1024;
  keys.push_back(k);
  k = base;
  k.NH = 16;
  keys.push_back(k);
  k = base;
  k.dtype = SdpaDType::kHalf;
  keys.push_back(k);
  k = base;
  k.direction = SdpaDirection::kBackward;
  keys.push_back(k);
  absl::flat_hash_map<SdpaKey, int> plans;
  for (size_t i = 0; i < keys.size(); ++i) {
    for (size_t j = 0; j < keys.size(); ++j) {
      EXPECT_EQ(keys[i] == keys[j], i == j) << i << " vs " << j;
      EXPECT_EQ(keys[i] != keys[j], i != j) << i << " vs " << j;
    }
    plans[keys[i]] = static_cast<int>(i);
  }
  EXPECT_EQ(plans.size(), keys.size());
  // Equal keys hash equally and find the same plan.
  const SdpaKey again{4, 1024, 768, 12, SdpaDType::kBfloat16, SdpaDirection::kForward};
  EXPECT_EQ(absl::Hash<SdpaKey>()(again), absl::Hash<SdpaKey>()(base));
  EXPECT_EQ(plans.at(again), 0);
}

TEST(SdpaGraph, SupportFollowsTheFusedEnginesLimits) {
  EXPECT_EQ(SdpaUnsupportedReason(4, 1024, 768, 12), nullptr);  // GPT-2 small, hs 64
  EXPECT_EQ(SdpaUnsupportedReason(3, 17, 48, 3), nullptr);      // hs 16, odd T
  EXPECT_EQ(SdpaUnsupportedReason(1, 2, 1024, 8), nullptr);     // hs 128, T 2
  EXPECT_NE(SdpaUnsupportedReason(1, 16, 96, 8), nullptr);      // hs 12
  EXPECT_NE(SdpaUnsupportedReason(1, 16, 2048, 8), nullptr);    // hs 256
  EXPECT_NE(SdpaUnsupportedReason(2, 1, 768, 12), nullptr);     // T 1: no backward
  EXPECT_NE(SdpaUnsupportedReason(1, 16, 50, 3), nullptr);      // C not a multiple of NH
  EXPECT_NE(SdpaUnsupportedReason(0, 16, 768, 12), nullptr);
}

TEST(SdpaGraph, BackwardWorkspaceRegionsAreAlignedAndDisjoint) {
  const Shape s = kShapes[0];
  const SdpaLayout layout(s.B, s.T, s.C, s.NH);
  const int64_t dq_bytes = int64_t{s.B} * s.T * s.C * 4;  // (B, NH, T, hs) fp32
  const int64_t sum_bytes = int64_t{s.B} * s.NH * s.T * 4;
  for (const int64_t engine : {int64_t{0}, int64_t{1}, int64_t{1} << 20}) {
    const SdpaBackwardWorkspace w = layout.BackwardWorkspace(engine);
    EXPECT_EQ(w.dq_accum_offset, 0);
    EXPECT_GE(w.softmax_sum_offset, dq_bytes);
    EXPECT_GE(w.engine_offset, w.softmax_sum_offset + sum_bytes);
    EXPECT_GE(w.total_bytes, w.engine_offset + engine);
    for (const int64_t offset : {w.softmax_sum_offset, w.engine_offset, w.total_bytes}) {
      EXPECT_EQ(offset % 256, 0) << offset;
    }
  }
}

TEST(SdpaGraph, StatsLayersStayAligned) {
  // 3 x 3 x 17 = 153 floats a layer: padded so that layer l's block starts 256-byte aligned.
  EXPECT_EQ(SdpaStatsLayerFloats(3, 3, 17), 192);
  EXPECT_EQ(SdpaStatsLayerFloats(1, 1, 64), 64);
  EXPECT_GE(SdpaStatsLayerFloats(4, 12, 1024), 4 * 12 * 1024);
  // Monotone in the batch shape, so a carve at (max_batch, max_seq) holds any smaller batch's
  // stack.
  EXPECT_LE(SdpaStatsLayerFloats(2, 3, 17), SdpaStatsLayerFloats(3, 3, 17));
}

}  // namespace
}  // namespace offload
