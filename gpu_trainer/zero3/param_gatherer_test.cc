// ZeRO-3's parameter source: gathered units are exactly the owners' 16-bit weights, the model
// computes the same bits from them as from one flat buffer for any number of ranks and any
// window, the window is what is allocated, and failures surface as errors.
#include "gpu_trainer/zero3/param_gatherer.h"

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gpu_trainer/collectives/gloo_test_util.h"
#include "gpu_trainer/collectives/local_collectives.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

using ::testing::HasSubstr;

const Gpt2Config kModel{64, 16, 3, 2, 16};
constexpr int kB = 2;
constexpr int kT = 8;

// The whole model's 16-bit weights (padded,): GPT-2's initialisation rounded to `dtype`.
std::vector<uint16_t> Weights(DType dtype, int64_t padded) {
  std::vector<float> master(padded, 0.0f);
  InitGpt2Params(kModel, 7, master.data());
  std::vector<uint16_t> w16(padded, 0);
  ConvertFromFloat(master.data(), padded, dtype, w16.data());
  return w16;
}

int64_t Padded(int W) { return (Gpt2NumParams(kModel) + W - 1) / W * W; }

struct PassResult {
  float loss = 0;
  std::vector<float> grads;  // (num_params,)
};

// One forward and backward of the test batch with the weights from `params`.
PassResult Pass(Gpt2ParamSource& params) {
  auto model = Gpt2Cpu::Create(kModel, kB, kT, CpuKernelSet::kFast);
  EXPECT_TRUE(model.ok()) << model.status();
  std::vector<int32_t> inputs(kB * kT), targets(kB * kT);  // (B, T)
  for (int i = 0; i < kB * kT; ++i) {
    inputs[i] = (i * 7 + 3) % kModel.vocab_size;
    targets[i] = (i * 5 + 1) % kModel.vocab_size;
  }
  PassResult r;
  absl::StatusOr<float> loss = (*model)->Forward(params, inputs.data(), targets.data(), kB, kT);
  EXPECT_TRUE(loss.ok()) << loss.status();
  r.loss = loss.value_or(0);
  r.grads.assign(Gpt2NumParams(kModel), 0.0f);
  FlatGpt2Grads grads(kModel, r.grads.data(), nullptr);
  EXPECT_TRUE((*model)->Backward(params, 1.0f, grads).ok());
  return r;
}

// The reference: the same weights upcast into one flat buffer.
PassResult FlatPass(const std::vector<uint16_t>& w16, DType dtype) {
  std::vector<float> w32(w16.size());
  for (size_t i = 0; i < w16.size(); ++i) {
    w32[i] = dtype == DType::kFp16 ? Fp16ToFloat(w16[i]) : Bf16ToFloat(w16[i]);
  }
  FlatGpt2Params flat(kModel, w32.data());
  return Pass(flat);
}

ParamGathererOptions Options(DType dtype, int W, int rank, int window) {
  ParamGathererOptions o;
  o.model = kModel;
  o.dtype = dtype;
  o.padded_length = Padded(W);
  o.rank = rank;
  o.world_size = W;
  o.window_layers = window;
  return o;
}

class GatherTest : public ::testing::TestWithParam<std::tuple<int, int, DType>> {};

TEST_P(GatherTest, SameBitsAsOneFlatBuffer) {
  // Not a structured binding: the lambda below captures these, which C++17 allows only for
  // variables.
  int W, window;
  DType dtype;
  std::tie(W, window, dtype) = GetParam();
  const std::vector<uint16_t> full = Weights(dtype, Padded(W));
  const PassResult want = FlatPass(full, dtype);
  const int64_t P = Padded(W) / W;
  RunOnGlooRanks(W, absl::Seconds(20), [&](int rank, Collectives& c) {
    std::vector<uint16_t> mine(full.begin() + rank * P, full.begin() + (rank + 1) * P);  // (P,)
    WeightMeter meter;
    auto g = ParamGatherer::Create(Options(dtype, W, rank, window), &c, mine.data(), &meter);
    ASSERT_TRUE(g.ok()) << g.status();
    for (int round = 0; round < 2; ++round) {  // again after Invalidate: gathered afresh
      const PassResult got = Pass(**g);
      EXPECT_EQ(got.loss, want.loss) << "rank " << rank;
      EXPECT_EQ(0, std::memcmp(got.grads.data(), want.grads.data(), got.grads.size() * 4))
          << "rank " << rank << " round " << round;
      (*g)->Invalidate();
    }
    // The window is all it allocates: the embeddings, ln_f and `window` blocks, 2 bytes each.
    const int64_t units = Gpt2UnitRange(kModel, 0).size() +
                          Gpt2UnitRange(kModel, kModel.num_layers + 1).size() +
                          std::min(window, kModel.num_layers) * Gpt2UnitRange(kModel, 1).size();
    EXPECT_EQ(meter.peak(), 2 * units);
    EXPECT_EQ((*g)->window_bytes16(), 2 * units);
    EXPECT_EQ((*g)->window_bytes32(), 4 * units);
  });
}

INSTANTIATE_TEST_SUITE_P(RanksWindows, GatherTest,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values(1, 2),
                                            ::testing::Values(DType::kFp16, DType::kBf16)));

TEST(ParamGathererTest, EachUnitIsItsOwnersBits) {
  const int W = 3;
  const std::vector<uint16_t> full = Weights(DType::kBf16, Padded(W));
  const int64_t P = Padded(W) / W;
  RunOnGlooRanks(W, absl::Seconds(20), [&](int rank, Collectives& c) {
    std::vector<uint16_t> mine(full.begin() + rank * P, full.begin() + (rank + 1) * P);
    auto g = ParamGatherer::Create(Options(DType::kBf16, W, rank, 1), &c, mine.data(), nullptr);
    ASSERT_TRUE(g.ok()) << g.status();
    for (int u = 0; u < Gpt2NumUnits(kModel); ++u) {
      const ParamRange range = Gpt2UnitRange(kModel, u);
      absl::StatusOr<const float*> w = (*g)->Acquire(u);
      ASSERT_TRUE(w.ok()) << w.status();
      for (int64_t i = 0; i < range.size(); ++i) {
        ASSERT_EQ((*w)[i], Bf16ToFloat(full[range.begin + i])) << "unit " << u << " at " << i;
      }
      (*g)->Release(u);
    }
  });
}

TEST(ParamGathererTest, AFullWindowAndBadUnitsAreRefused) {
  std::unique_ptr<Collectives> c = SingleRankCollectives();
  const std::vector<uint16_t> full = Weights(DType::kFp16, Padded(1));
  auto g = ParamGatherer::Create(Options(DType::kFp16, 1, 0, 1), c.get(), full.data(), nullptr);
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_TRUE((*g)->Acquire(1).ok());
  absl::StatusOr<const float*> second = (*g)->Acquire(2);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(), HasSubstr("window"));
  (*g)->Release(1);
  EXPECT_TRUE((*g)->Acquire(2).ok());  // the slot is free again
  EXPECT_EQ((*g)->Acquire(-1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*g)->Acquire(Gpt2NumUnits(kModel)).status().code(),
            absl::StatusCode::kInvalidArgument);

  ParamGathererOptions bad = Options(DType::kFp16, 1, 0, 0);
  EXPECT_THAT(ParamGatherer::Create(bad, c.get(), full.data(), nullptr).status().message(),
              HasSubstr("at least 1 layer"));
  bad = Options(DType::kFp16, 2, 0, 1);  // two ranks, but the collectives have one
  EXPECT_EQ(ParamGatherer::Create(bad, c.get(), full.data(), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A prefetched unit keeps its slot until it is acquired, however soon its gather finishes: which
// slot a later unit gets must not depend on timing, or ranks would gather different units.
TEST(ParamGathererTest, APrefetchedSlotWaitsForItsAcquire) {
  std::unique_ptr<Collectives> c = SingleRankCollectives();
  const std::vector<uint16_t> full = Weights(DType::kFp16, Padded(1));
  auto g = ParamGatherer::Create(Options(DType::kFp16, 1, 0, 1), c.get(), full.data(), nullptr);
  ASSERT_TRUE(g.ok()) << g.status();
  (*g)->Prefetch(2);
  (*g)->Invalidate();  // waits for the gather; the prefetch is forgotten with it
  (*g)->Prefetch(2);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // long done: a copy of one block
  EXPECT_EQ((*g)->Acquire(1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*g)->Acquire(2).ok());
  (*g)->Release(2);
  EXPECT_TRUE((*g)->Acquire(1).ok());  // released: the slot may be reused now
  EXPECT_EQ((*g)->gathers(), 3);
}

// Collectives whose gathers fail: a peer that died.
class DeadPeer final : public Collectives {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string Describe() const override { return "dead"; }
  absl::Status ReduceScatter(const float*, float*, const std::vector<int64_t>&) override {
    return Dead();
  }
  absl::Status AllGather16(const uint16_t*, uint16_t*, int64_t) override { return Dead(); }
  absl::Status AllGatherV16(const uint16_t*, uint16_t*, const std::vector<int64_t>&) override {
    return Dead();
  }
  absl::Status AllReduce(double*, int, ReduceOp) override { return Dead(); }
  absl::Status BroadcastWithin(void*, int64_t, int, absl::Duration) override { return Dead(); }
  absl::Status Barrier() override { return Dead(); }
  absl::StatusOr<std::unique_ptr<Collectives>> Fork(absl::string_view) override { return Dead(); }

 private:
  static absl::Status Dead() { return absl::UnavailableError("peer 1 closed the connection"); }
};

TEST(ParamGathererTest, AFailedGatherFailsEveryLaterAcquire) {
  DeadPeer dead;
  const std::vector<uint16_t> full = Weights(DType::kFp16, Padded(1));
  auto g = ParamGatherer::Create(Options(DType::kFp16, 1, 0, 2), &dead, full.data(), nullptr);
  ASSERT_TRUE(g.ok()) << g.status();
  (*g)->Prefetch(1);
  EXPECT_EQ((*g)->Acquire(0).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*g)->Acquire(1).status().code(), absl::StatusCode::kUnavailable);
  auto model = Gpt2Cpu::Create(kModel, kB, kT, CpuKernelSet::kFast);
  ASSERT_TRUE(model.ok());
  std::vector<int32_t> tokens(kB * kT, 1);
  absl::StatusOr<float> loss = (*model)->Forward(**g, tokens.data(), tokens.data(), kB, kT);
  EXPECT_EQ(loss.status().code(), absl::StatusCode::kUnavailable);
  std::vector<float> grads(Gpt2NumParams(kModel));
  // A forward that failed part way leaves nothing to differentiate.
  FlatGpt2Grads sink(kModel, grads.data(), nullptr);
  EXPECT_EQ((*model)->Backward(**g, 1.0f, sink).code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace offload
