// The sampler's determinism, checkpoint restore, window layout, and validation batches.
#include "gpu_trainer/data/batch_sampler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

namespace offload {
namespace {

using ::testing::HasSubstr;

constexpr int B = 4;
constexpr int T = 8;

// Token i has value i, so a token's value is its position in the span.
std::vector<uint16_t> Iota(int n) {
  std::vector<uint16_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

struct Batch {
  std::vector<int32_t> inputs = std::vector<int32_t>(B * T);
  std::vector<int32_t> targets = std::vector<int32_t>(B * T);
  bool operator==(const Batch& o) const { return inputs == o.inputs && targets == o.targets; }
};

Batch Draw(BatchSampler& s) {
  Batch b;
  s.Next(b.inputs.data(), b.targets.data());
  return b;
}

TEST(BatchSamplerTest, SameSeedSameBatchesOtherSeedOther) {
  std::vector<uint16_t> tokens = Iota(1000);
  TokenSpan span{tokens.data(), 1000};
  BatchSampler a(span, B, T, 42), b(span, B, T, 42), c(span, B, T, 43);
  for (int i = 0; i < 5; ++i) {
    Batch x = Draw(a);
    EXPECT_EQ(x, Draw(b));
    EXPECT_FALSE(x == Draw(c));
  }
}

TEST(BatchSamplerTest, WindowsAreContiguousShiftedAndInsideTheSpan) {
  std::vector<uint16_t> tokens = Iota(40);
  TokenSpan span{tokens.data(), 20};  // only the first 20 tokens are the span
  BatchSampler s(span, B, T, 7);
  std::vector<bool> seen(20 - T, false);
  for (int i = 0; i < 200; ++i) {
    Batch x = Draw(s);
    for (int b = 0; b < B; ++b) {
      const int o = x.inputs[b * T];
      ASSERT_GE(o, 0);
      ASSERT_LE(o + T, 19);  // the target of the last position is still in the span
      seen[o] = true;
      for (int t = 0; t < T; ++t) {
        EXPECT_EQ(x.inputs[b * T + t], o + t);
        EXPECT_EQ(x.targets[b * T + t], o + t + 1);
      }
    }
  }
  // 800 draws over 12 offsets: every one, the last included, must show up.
  for (int o = 0; o < 20 - T; ++o) EXPECT_TRUE(seen[o]) << "offset " << o;
}

TEST(BatchSamplerTest, RestoreReplaysTheSameBatches) {
  std::vector<uint16_t> tokens = Iota(5000);
  TokenSpan span{tokens.data(), 5000};
  BatchSampler a(span, B, T, 123);
  for (int i = 0; i < 7; ++i) Draw(a);
  const v1::DataPosition saved = a.Position();
  EXPECT_EQ(saved.batches_drawn(), 7u);
  std::vector<Batch> after;
  for (int i = 0; i < 5; ++i) after.push_back(Draw(a));

  BatchSampler fresh(span, B, T, 123);
  ASSERT_TRUE(fresh.Restore(saved).ok());
  for (int i = 0; i < 5; ++i) EXPECT_EQ(Draw(fresh), after[i]) << "batch " << i;
  EXPECT_EQ(fresh.Position().batches_drawn(), 12u);
}

TEST(BatchSamplerTest, RestoreRejectsAPositionOfAnotherStream) {
  std::vector<uint16_t> tokens = Iota(5000);
  TokenSpan span{tokens.data(), 5000};
  BatchSampler a(span, B, T, 1);
  for (int i = 0; i < 3; ++i) Draw(a);
  BatchSampler other_seed(span, B, T, 2);
  absl::Status s = other_seed.Restore(a.Position());
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("seed 2"));
  BatchSampler other_batch(span, B + 1, T, 1);
  EXPECT_FALSE(other_batch.Restore(a.Position()).ok());
  // A refused restore leaves the sampler where it was.
  BatchSampler untouched(span, B, T, 2);
  EXPECT_EQ(Draw(other_seed), Draw(untouched));
}

TEST(ValidationBatchTest, ConsecutiveWindowsDeterministicAndWrapping) {
  std::vector<uint16_t> tokens = Iota(100);
  TokenSpan span{tokens.data(), 100};
  // (100 - 1) / 8 = 12 windows, 3 batches of 4.
  EXPECT_EQ(NumValidationBatches(span, B, T), 3);
  Batch x, y;
  for (int64_t index = 0; index < 4; ++index) {
    ValidationBatch(span, B, T, index, x.inputs.data(), x.targets.data());
    ValidationBatch(span, B, T, index, y.inputs.data(), y.targets.data());
    EXPECT_EQ(x, y);
    for (int b = 0; b < B; ++b) {
      const int w = static_cast<int>((index * B + b) % 12);  // index 3 wraps to windows 0..3
      for (int t = 0; t < T; ++t) {
        EXPECT_EQ(x.inputs[b * T + t], w * T + t);
        EXPECT_EQ(x.targets[b * T + t], w * T + t + 1);
      }
    }
  }
  // Fewer windows than a batch still makes one (wrapping) batch.
  TokenSpan small{tokens.data(), T + 1};
  EXPECT_EQ(NumValidationBatches(small, B, T), 1);
  ValidationBatch(small, B, T, 0, x.inputs.data(), x.targets.data());
  EXPECT_EQ(x.inputs[3 * T], 0);
}

}  // namespace
}  // namespace offload
