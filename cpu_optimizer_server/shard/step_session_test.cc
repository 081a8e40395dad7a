// The update during backward (StepSession::UpdateEarly; ARCHITECTURE.md sections 4.3 and 16): for
// fp16 and bf16 jobs with two parameter groups, early updates of parts of a range followed by a
// commit give, bit for bit, what the plain commit gives, whatever the commit decides (the same
// arguments, a skip, another lr, multiplier or t, a second micro-batch, no commit at all); the
// shard declines, changing nothing, where it cannot or should not update early; and a malformed
// update is refused with nothing changed. Before the commit an early update changes only the
// range's staging copy, never the range's state.
#include "cpu_optimizer_server/shard/step_session.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/testing/test_util.h"
#include "cpu_optimizer_server/shard/shard_store.h"
#include "cpu_optimizer_server/shard/shard_test_util.h"
#include "cpu_optimizer_server/shard/state_loader.h"

namespace offload {
namespace {

// A range of several waves (one tile each) ending in a partial tile.
constexpr int64_t kOffset = 1000;
constexpr int64_t kLength = 3 * kTileElements + 4321;
// Range-relative: the groups' cut, inside the second tile and off any SIMD vector.
constexpr int64_t kCut = kTileElements + 5003;

// An early update of range-relative [begin, begin + n) with bias-correction step t (0: the
// range's next).
struct Early {
  int64_t begin;
  int64_t n;
  uint64_t t = 0;
};

// The fp32 state of a range, bit for bit.
struct State {
  std::vector<float> p, m, v;
  bool operator==(const State& o) const {
    return std::memcmp(p.data(), o.p.data(), p.size() * 4) == 0 &&
           std::memcmp(m.data(), o.m.data(), m.size() * 4) == 0 &&
           std::memcmp(v.data(), o.v.data(), v.size() * 4) == 0;
  }
  // Whether range-relative [b, e) of all three tensors equals o's.
  bool Same(const State& o, int64_t b, int64_t e) const {
    const size_t bytes = (e - b) * 4;
    return std::memcmp(p.data() + b, o.p.data() + b, bytes) == 0 &&
           std::memcmp(m.data() + b, o.m.data() + b, bytes) == 0 &&
           std::memcmp(v.data() + b, o.v.data() + b, bytes) == 0;
  }
};

// The 16-bit weights and gradients, and the moments' storage (JobConfig::state_dtype).
struct Dtypes {
  DType param;
  DType state;
};

// (n,) moments of either storage, widened to fp32 (exactly: bf16 is fp32's high half).
std::vector<float> Widened(const void* moment, DType dtype, int64_t n) {
  if (dtype == DType::kFp32) {
    const float* f = static_cast<const float*>(moment);
    return std::vector<float>(f, f + n);
  }
  std::vector<float> out(n);
  const uint16_t* h = static_cast<const uint16_t*>(moment);
  for (int64_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(h[i]);
  return out;
}

class UpdateEarlyTest : public ::testing::TestWithParam<Dtypes> {
 protected:
  UpdateEarlyTest() : pool_(ThreadPool::Options{2, false}) {
    store_ = MakeStore(int64_t{64} << 20);
    seed_ = std::random_device()();
    rng_.seed(seed_);
    weights_ = RandomFloats(kLength, 1.0f);
  }

  std::unique_ptr<ShardStore> MakeStore(int64_t memory_limit, DiskTier* disk = nullptr) {
    ShardOptions options;
    options.memory_limit_bytes = memory_limit;
    options.wave_elements = kTileElements;
    options.state_on_disk = disk != nullptr;
    return std::make_unique<ShardStore>(options, &pool_, BestSimdPath(), disk);
  }

  // Group A: AdamW with decay; group B: Adam without decay, other betas and eps, no bias
  // correction. They reach beyond the range on both sides.
  static JobConfig Config(const std::string& id) {
    AdamHyperParams a, b;
    a.lr = 1e-2f;
    a.weight_decay = 0.1f;
    b.lr = 3e-3f;
    b.beta1 = 0.8f;
    b.beta2 = 0.99f;
    b.eps = 1e-6f;
    b.weight_decay = 0.0f;
    b.adamw = false;
    b.bias_correction = false;
    JobConfig c;
    c.job_id = id;
    c.ranges = {{kOffset, kLength}};
    c.adam = a;
    c.groups = {ParamGroupSpec{0, kOffset + kCut, a},
                ParamGroupSpec{kOffset + kCut, int64_t{1} << 20, b}};
    c.param_dtype = GetParam().param;
    c.state_dtype = GetParam().state;
    return c;
  }

  void CreateLoaded(ShardStore* store, const std::string& id) {
    ASSERT_TRUE(store->CreateJob(Config(id)).ok()) << id;
    auto loader = StateLoader::Start(store, id);
    ASSERT_TRUE(loader.ok()) << loader.status();
    ASSERT_TRUE((*loader)
                    ->AddChunk(StateTensor::kMasterWeights, kOffset, DType::kFp32,
                               Bytes(weights_.data(), kLength * 4))
                    .ok());
    ASSERT_TRUE((*loader)->Apply().ok());
  }
  void CreateLoaded(const std::string& id) { CreateLoaded(store_.get(), id); }

  static RangeState& RangeOf(ShardStore* store, const std::string& id) {
    return *(*store->FindJob(id))->ranges[0];
  }
  RangeState& RangeOf(const std::string& id) { return RangeOf(store_.get(), id); }
  static State Read(const RangeState& r) {
    return State{std::vector<float>(r.param, r.param + kLength),
                 Widened(r.exp_avg, r.state_dtype, kLength),
                 Widened(r.exp_avg_sq, r.state_dtype, kLength)};
  }
  State Read(const std::string& id) { return Read(RangeOf(id)); }
  // The range's staging copy, where early updates write (RangeState::staging_storage).
  State ReadStaged(const std::string& id) {
    const RangeState& r = RangeOf(id);
    return State{std::vector<float>(r.staging_param(), r.staging_param() + kLength),
                 Widened(r.staging_exp_avg(), r.state_dtype, kLength),
                 Widened(r.staging_exp_avg_sq(), r.state_dtype, kLength)};
  }
  uint64_t AdamStep(const std::string& id) {
    std::lock_guard<std::mutex> lock(RangeOf(id).mu);
    return RangeOf(id).adam_step;
  }

  std::vector<float> RandomFloats(int64_t n, float scale) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng_);
    return v;
  }
  // (kLength,) gradients in the job's 16-bit type.
  std::vector<uint16_t> Grads() {
    std::vector<uint16_t> g(kLength);
    for (int64_t i = 0; i < kLength; ++i) {
      const float f = RandomFloats(1, 0.5f)[0];
      g[i] = GetParam().param == DType::kFp16 ? FloatToFp16(f) : FloatToBf16(f);
    }
    return g;
  }

  // Sends g's range-relative [b, e) to `session`, as a view when `view` (g outlives the step).
  static absl::Status Send(StepSession* session, const std::vector<uint16_t>& g, int64_t b,
                           int64_t e, bool view = false, bool accumulate = false) {
    if (view) {
      return session->AddGradientsView(kOffset + b, GetParam().param, g.data() + b, e - b);
    }
    return session->AddGradients(kOffset + b, GetParam().param, accumulate,
                                 Bytes(g.data() + b, (e - b) * 2));
  }
  // args for an early update of `e`: the commit's lrs and multiplier, and e.t as a range step.
  static StepCommitArgs EarlyArgs(const StepCommitArgs& like, const Early& e) {
    StepCommitArgs args = like;
    args.skip = false;
    args.range_steps.clear();
    if (e.t > 0) args.range_steps.push_back(RangeStep{kOffset + e.begin, e.n, e.t});
    return args;
  }
  static absl::StatusOr<bool> Update(StepSession* session, const StepCommitArgs& like,
                                     const Early& e) {
    return session->UpdateEarly(EarlyArgs(like, e), kOffset + e.begin, e.n);
  }
  // Whether Update applied e (a failure if it was refused).
  static bool Applied(StepSession* session, const StepCommitArgs& like, const Early& e) {
    absl::StatusOr<bool> r = Update(session, like, e);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() && *r;
  }

  // One plain step of job `id`: all of g in two chunks, then the commit.
  absl::StatusOr<StepOutcome> Plain(const std::string& id, uint64_t step,
                                    const std::vector<uint16_t>& g, const StepCommitArgs& args,
                                    VectorSink* sink) {
    OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<StepSession> session,
                             StepSession::Open(store_.get(), id, 0, step));
    OFFLOAD_RETURN_IF_ERROR(Send(session.get(), g, 7777, kLength));
    OFFLOAD_RETURN_IF_ERROR(Send(session.get(), g, 0, 7777));
    return session->Commit(args, sink);
  }

  // One step of job `id` as backward would send it: g in chunks cut at `cuts` (range-relative,
  // from the end of the range backwards, one of them a view), each early update as soon as all
  // its gradients are in, with the arguments of `early_like`; then the commit with `args`.
  absl::StatusOr<StepOutcome> WithEarly(const std::string& id, uint64_t step,
                                        const std::vector<uint16_t>& g,
                                        const std::vector<Early>& early,
                                        const StepCommitArgs& early_like,
                                        const StepCommitArgs& args, VectorSink* sink) {
    OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<StepSession> session,
                             StepSession::Open(store_.get(), id, 0, step));
    const State before = Read(id);
    IntervalSet sent;
    std::vector<bool> done(early.size(), false);
    const int64_t cuts[] = {kLength, 40000, 22000, 12000, 3001, 0};
    for (size_t k = 0; k + 1 < sizeof(cuts) / sizeof(cuts[0]); ++k) {
      OFFLOAD_RETURN_IF_ERROR(Send(session.get(), g, cuts[k + 1], cuts[k], /*view=*/k == 2));
      sent.Insert(cuts[k + 1], cuts[k]);
      for (size_t i = 0; i < early.size(); ++i) {
        if (done[i] || sent.FirstGap(early[i].begin, early[i].begin + early[i].n)) continue;
        OFFLOAD_ASSIGN_OR_RETURN(bool applied, Update(session.get(), early_like, early[i]));
        if (!applied) return absl::InternalError("an early update was declined");
        done[i] = true;
      }
    }
    // The early updates did run before the commit, into the staging copy: the range's state is
    // as it was.
    if (!(Read(id) == before)) {
      return absl::InternalError("an early update changed the range's state before the commit");
    }
    if (!early.empty()) {
      const State staged = ReadStaged(id);
      bool inside_changed = false;
      for (const Early& e : early) inside_changed |= !staged.Same(before, e.begin, e.begin + e.n);
      if (!inside_changed) return absl::InternalError("no early update changed anything");
    }
    return session->Commit(args, sink);
  }

  // Expects jobs "early" and "plain" to hold the same state, and the two sinks the same output.
  void ExpectSame(const VectorSink& early, const VectorSink& plain, const std::string& what) {
    EXPECT_TRUE(Read("early") == Read("plain")) << what << " seed " << seed_;
    EXPECT_EQ(std::memcmp(early.out().data(), plain.out().data(), kLength * 2), 0)
        << what << " seed " << seed_;
  }

  static StepCommitArgs Args(uint64_t step, bool skip = false) {
    return StepCommitArgs{step, 0, 0.5f, skip, {1e-2 / step, 4e-3 + 1e-4 * step}, {}};
  }

  ThreadPool pool_;
  std::unique_ptr<ShardStore> store_;
  uint32_t seed_;
  std::mt19937 rng_;
  std::vector<float> weights_;
};

// Several parts across a tile, a wave, the group cut and the range's end, one with its own t:
// the commit repeating the arguments keeps them all, and the bits are the plain commit's.
TEST_P(UpdateEarlyTest, SameArgumentsStandBitForBit) {
  CreateLoaded("early");
  CreateLoaded("plain");
  for (uint64_t step = 1; step <= 4; ++step) {
    const std::vector<uint16_t> g = Grads();
    StepCommitArgs args = Args(step);
    std::vector<Early> early = {{kLength - 7777, 7777},
                                {kCut - 100, 2101},
                                {kTileElements - 9, 3000},
                                {17, 4000},
                                {5000, 333}};
    if (step >= 2) {
      // From step 2 on the commit gives part of the range its own t, and so does the update.
      early.push_back(Early{6000, 501, step - 1});
      args.range_steps = {RangeStep{kOffset + 6000, 501, step - 1}};
    }
    uint64_t n = 0;
    for (const Early& e : early) n += e.n;
    VectorSink a(kOffset, kLength), b(kOffset, kLength);
    absl::StatusOr<StepOutcome> outcome = WithEarly("early", step, g, early, args, args, &a);
    ASSERT_TRUE(outcome.ok()) << outcome.status();
    EXPECT_TRUE(outcome->applied);
    EXPECT_EQ(outcome->adam_step, step);
    EXPECT_EQ(outcome->early_updated, n);
    EXPECT_EQ(outcome->early_rolled_back, 0u);
    absl::StatusOr<StepOutcome> plain = Plain("plain", step, g, args, &b);
    ASSERT_TRUE(plain.ok()) << plain.status();
    EXPECT_EQ(plain->early_updated, 0u);
    ExpectSame(a, b, "step " + std::to_string(step));
  }
  // One early update of the whole range: the commit only converts.
  const std::vector<uint16_t> g = Grads();
  VectorSink a(kOffset, kLength), b(kOffset, kLength);
  absl::StatusOr<StepOutcome> outcome =
      WithEarly("early", 5, g, {{0, kLength}}, Args(5), Args(5), &a);
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_EQ(outcome->early_updated, static_cast<uint64_t>(kLength));
  ASSERT_TRUE(Plain("plain", 5, g, Args(5), &b).ok());
  ExpectSame(a, b, "the whole range");
  // The staging copy is laid out as the state: as many bytes again, 12 or 8 an element.
  const int64_t stride = (kLength + 15) / 16 * 16;
  EXPECT_EQ((*store_->FindJob("early"))->state_bytes(),
            2 * stride * StateBytesPerElement(GetParam().state));
}

// An overflow: the commit skips, and every early update is dropped.
TEST_P(UpdateEarlyTest, SkipDropsEverything) {
  CreateLoaded("early");
  CreateLoaded("plain");
  VectorSink warm_a(kOffset, kLength), warm_b(kOffset, kLength);
  const std::vector<uint16_t> g1 = Grads();
  ASSERT_TRUE(Plain("early", 1, g1, Args(1), &warm_a).ok());
  ASSERT_TRUE(Plain("plain", 1, g1, Args(1), &warm_b).ok());
  const State before = Read("early");
  const std::vector<Early> early = {{0, 5000}, {kCut - 10, 20}, {kLength - 100, 100}};
  VectorSink a(kOffset, kLength), b(kOffset, kLength);
  const std::vector<uint16_t> g = Grads();
  absl::StatusOr<StepOutcome> outcome =
      WithEarly("early", 2, g, early, Args(2), Args(2, /*skip=*/true), &a);
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_TRUE(outcome->skipped);
  EXPECT_EQ(outcome->adam_step, 1u);
  EXPECT_EQ(outcome->skipped_steps, 1u);
  EXPECT_EQ(outcome->early_updated, 0u);
  EXPECT_EQ(outcome->early_rolled_back, 5120u);
  EXPECT_EQ(a.sends(), 0);
  EXPECT_TRUE(Read("early") == before) << "seed " << seed_;
  ASSERT_TRUE(Plain("plain", 2, g, Args(2, true), &b).ok());
  // And the next step's t is the plain job's.
  const std::vector<uint16_t> g3 = Grads();
  VectorSink a3(kOffset, kLength), b3(kOffset, kLength);
  outcome = WithEarly("early", 3, g3, early, Args(3), Args(3), &a3);
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_EQ(outcome->adam_step, 2u);
  ASSERT_TRUE(Plain("plain", 3, g3, Args(3), &b3).ok());
  ExpectSame(a3, b3, "after the skip");
}

// The commit decides other arguments than the early updates took: each case equals the plain
// commit with the commit's arguments, bit for bit.
TEST_P(UpdateEarlyTest, OtherArgumentsAreUndoneAndRedone) {
  CreateLoaded("early");
  CreateLoaded("plain");
  // Warm-up steps first, so that t 1 is not the range's t and the moments are not zero.
  for (uint64_t step = 1; step <= 2; ++step) {
    const std::vector<uint16_t> g = Grads();
    VectorSink a(kOffset, kLength), b(kOffset, kLength);
    ASSERT_TRUE(Plain("early", step, g, Args(step), &a).ok());
    ASSERT_TRUE(Plain("plain", step, g, Args(step), &b).ok());
  }
  // 8000 elements in three parts, one across the group cut.
  const std::vector<Early> parts = {{100, 4000}, {kCut - 500, 1000}, {kLength - 3000, 3000}};
  struct Case {
    const char* what;
    StepCommitArgs early_like;  // the arguments the early updates take (step set below)
    StepCommitArgs commit;
    uint64_t early_updated;
    uint64_t rolled_back;
    std::vector<Early> early;
  };
  auto with = [](auto change) {
    StepCommitArgs args = Args(1);
    change(args);
    return args;
  };
  const StepCommitArgs same = Args(1);
  const std::vector<Case> cases = {
      {"another lr for group 1", same,
       with([](StepCommitArgs& a) { a.group_lr[1] = std::nextafter(a.group_lr[1], 1.0); }), 0, 8000,
       parts},
      {"one lr for both groups, not theirs", same, with([](StepCommitArgs& a) {
         a.group_lr.clear();
         a.lr = 2e-3;
       }),
       0, 8000, parts},
      {"one lr for both groups, as group lrs", with([](StepCommitArgs& a) {
         a.group_lr = {2e-3, 2e-3};
       }),
       with([](StepCommitArgs& a) {
         a.group_lr.clear();
         a.lr = 2e-3;
       }),
       8000, 0, parts},
      {"another multiplier", same, with([](StepCommitArgs& a) { a.grad_multiplier = 0.25f; }), 0,
       8000, parts},
      {"t 1 inside a part", same, with([](StepCommitArgs& a) {
         a.range_steps = {RangeStep{kOffset + 1000, 10, 1}};
       }),
       4000, 4000, parts},
      {"t 0 over the end of a part", same, with([](StepCommitArgs& a) {
         a.range_steps = {RangeStep{kOffset + kCut + 400, 2000, 0}};
       }),
       7000, 1000, parts},
      {"a range step beside the parts", same, with([](StepCommitArgs& a) {
         a.range_steps = {RangeStep{kOffset + 4100, 50, 1}};
       }),
       8000, 0, parts},
      {"an early t the commit does not give",
       same,
       same,
       5000,
       3000,
       {{100, 4000}, {kCut - 500, 1000}, {kLength - 3000, 3000, 2}}},
      {"an early t the commit gives",
       same,
       with([](StepCommitArgs& a) {
         a.range_steps = {RangeStep{kOffset + kLength - 3000, 3000, 2}};
       }),
       8000,
       0,
       {{100, 4000}, {kCut - 500, 1000}, {kLength - 3000, 3000, 2}}},
  };
  uint64_t step = 3;
  for (const Case& c : cases) {
    const std::vector<uint16_t> g = Grads();
    StepCommitArgs early_like = c.early_like, commit = c.commit;
    early_like.step = commit.step = step;
    VectorSink a(kOffset, kLength), b(kOffset, kLength);
    absl::StatusOr<StepOutcome> outcome =
        WithEarly("early", step, g, c.early, early_like, commit, &a);
    ASSERT_TRUE(outcome.ok()) << c.what << ": " << outcome.status();
    EXPECT_TRUE(outcome->applied) << c.what;
    EXPECT_EQ(outcome->early_updated, c.early_updated) << c.what;
    EXPECT_EQ(outcome->early_rolled_back, c.rolled_back) << c.what;
    ASSERT_TRUE(Plain("plain", step, g, commit, &b).ok()) << c.what;
    ExpectSame(a, b, c.what);
    ++step;
  }
}

// A stream that ends without a commit leaves the range as it was, and the step then works.
TEST_P(UpdateEarlyTest, EndingWithoutCommitLeavesTheState) {
  CreateLoaded("early");
  CreateLoaded("plain");
  const std::vector<uint16_t> g1 = Grads();
  VectorSink warm_a(kOffset, kLength), warm_b(kOffset, kLength);
  ASSERT_TRUE(Plain("early", 1, g1, Args(1), &warm_a).ok());
  ASSERT_TRUE(Plain("plain", 1, g1, Args(1), &warm_b).ok());
  const State before = Read("early");
  const int64_t used = store_->budget()->used();
  const std::vector<uint16_t> g = Grads();
  {
    auto session = StepSession::Open(store_.get(), "early", 0, 2);
    ASSERT_TRUE(session.ok()) << session.status();
    ASSERT_TRUE(Send(session->get(), g, 0, kLength).ok());
    for (const Early& e : std::vector<Early>{{0, 100}, {kCut, 9000}, {kLength - 5, 5}}) {
      EXPECT_TRUE(Applied(session->get(), Args(2), e));
    }
    EXPECT_TRUE(Read("early") == before);
    // The staging copy is accounted, all of it, whatever part is updated.
    EXPECT_GE(store_->budget()->used(),
              used + StateBytesPerElement(GetParam().state) * RangeOf("early").stride());
  }
  EXPECT_TRUE(Read("early") == before) << "seed " << seed_;
  // The range keeps its staging copy for the next steps; the gradients held are released.
  EXPECT_EQ(store_->budget()->used(),
            used + StateBytesPerElement(GetParam().state) * RangeOf("early").stride());
  VectorSink a(kOffset, kLength), b(kOffset, kLength);
  absl::StatusOr<StepOutcome> outcome =
      WithEarly("early", 2, g, {{0, kLength / 2}}, Args(2), Args(2), &a);
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_EQ(outcome->early_rolled_back, 0u);
  ASSERT_TRUE(Plain("plain", 2, g, Args(2), &b).ok());
  ExpectSame(a, b, "after the abandoned stream");
  EXPECT_EQ(store_->budget()->used(), used + StateBytesPerElement(GetParam().state) *
                                                 RangeOf("early").stride());  // nothing more
}

// A second micro-batch after early updates: they are dropped when it is added, and the commit is
// the plain accumulated one.
TEST_P(UpdateEarlyTest, SecondMicroBatchDropsTheFirstsUpdates) {
  CreateLoaded("early");
  CreateLoaded("plain");
  const std::vector<uint16_t> g = Grads(), h = Grads();
  const State before = Read("early");
  VectorSink a(kOffset, kLength), b(kOffset, kLength);
  {
    auto session = StepSession::Open(store_.get(), "early", 0, 1);
    ASSERT_TRUE(session.ok()) << session.status();
    ASSERT_TRUE(Send(session->get(), g, 0, 30000).ok());
    ASSERT_TRUE(Send(session->get(), g, 30000, kLength, /*view=*/true).ok());
    ASSERT_TRUE(Applied(session->get(), Args(1), {10, 20000}));
    ASSERT_TRUE(Applied(session->get(), Args(1), {30000, 5000}));
    ASSERT_TRUE(Read("early") == before);
    ASSERT_TRUE(Send(session->get(), h, 0, kLength, false, /*accumulate=*/true).ok());
    EXPECT_TRUE(Read("early") == before);
    // Accumulating: declined, nothing changed.
    absl::StatusOr<bool> declined = Update(session->get(), Args(1), {0, 100});
    ASSERT_TRUE(declined.ok()) << declined.status();
    EXPECT_FALSE(*declined);
    EXPECT_TRUE(Read("early") == before);
    absl::StatusOr<StepOutcome> outcome = (*session)->Commit(Args(1), &a);
    ASSERT_TRUE(outcome.ok()) << outcome.status();
    EXPECT_EQ(outcome->early_updated, 0u);
    EXPECT_EQ(outcome->early_rolled_back, 25000u);
  }
  auto session = StepSession::Open(store_.get(), "plain", 0, 1);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE(Send(session->get(), g, 0, kLength).ok());
  ASSERT_TRUE(Send(session->get(), h, 0, kLength, false, true).ok());
  ASSERT_TRUE((*session)->Commit(Args(1), &b).ok());
  ExpectSame(a, b, "two micro-batches");
}

// Declines: true only where the update was applied, and nothing changes where it was not.
TEST_P(UpdateEarlyTest, DeclinesChangeNothing) {
  CreateLoaded("early");
  const std::vector<uint16_t> g = Grads();
  VectorSink sink(kOffset, kLength);
  ASSERT_TRUE(Plain("early", 1, g, Args(1), &sink).ok());
  const State before = Read("early");
  auto expect_declined = [&](StepSession* session, const StepCommitArgs& like, const Early& e,
                             const char* what) {
    const int64_t used = store_->budget()->used();
    absl::StatusOr<bool> r = Update(session, like, e);
    ASSERT_TRUE(r.ok()) << what << ": " << r.status();
    EXPECT_FALSE(*r) << what;
    EXPECT_EQ(store_->budget()->used(), used) << what;
  };
  {
    // A replay: declined, though it holds no gradients.
    auto replay = StepSession::Open(store_.get(), "early", 0, 1);
    ASSERT_TRUE(replay.ok()) << replay.status();
    ASSERT_TRUE(Send(replay->get(), g, 0, kLength).ok());
    expect_declined(replay->get(), Args(1), {0, 1000}, "a replay");
    EXPECT_TRUE(Read("early") == before);
  }
  {
    // An inf or NaN received: the step will be skipped.
    auto session = StepSession::Open(store_.get(), "early", 0, 2);
    ASSERT_TRUE(session.ok()) << session.status();
    std::vector<uint16_t> bad = Grads();
    bad[kLength - 1] = GetParam().param == DType::kFp16 ? 0x7c00 : 0x7f80;  // +inf
    ASSERT_TRUE(Send(session->get(), bad, 0, kLength).ok());
    expect_declined(session->get(), Args(2), {0, 1000}, "a non-finite gradient");
    EXPECT_TRUE(Read("early") == before);
  }
  {
    // Other arguments than the first early update's: the second is declined.
    auto session = StepSession::Open(store_.get(), "early", 0, 2);
    ASSERT_TRUE(session.ok()) << session.status();
    ASSERT_TRUE(Send(session->get(), g, 0, kLength).ok());
    ASSERT_TRUE(Applied(session->get(), Args(2), {0, 1000}));
    const State after_first = Read("early");
    StepCommitArgs other = Args(2);
    other.grad_multiplier = 1.0f;
    expect_declined(session->get(), other, {2000, 1000}, "another multiplier");
    other = Args(2);
    other.group_lr[0] = 0;
    expect_declined(session->get(), other, {2000, 1000}, "another lr");
    EXPECT_TRUE(Read("early") == after_first);
    // The same set again is applied.
    EXPECT_TRUE(Applied(session->get(), Args(2), {2000, 1000}));
  }
  EXPECT_TRUE(Read("early") == before);
}

// No memory for the staging copy: declined, and the commit updates those elements as usual.
TEST_P(UpdateEarlyTest, NoMemoryForTheCopyDeclines) {
  // Room for the state, then for the load's chunk (released when applied) and, after it, the
  // step's gradients (half of that), but not for the range's staging copy (12 or 8 bytes an
  // element of the range, whatever part is updated first).
  absl::StatusOr<int64_t> state_bytes = MakeStore(int64_t{64} << 20)->CreateJob(Config("probe"));
  ASSERT_TRUE(state_bytes.ok()) << state_bytes.status();
  std::unique_ptr<ShardStore> small = MakeStore(*state_bytes + kLength * 4);
  CreateLoaded(small.get(), "early");
  ASSERT_NO_FATAL_FAILURE(CreateLoaded("plain"));
  const State before = Read(RangeOf(small.get(), "early"));
  const std::vector<uint16_t> g = Grads();
  auto session = StepSession::Open(small.get(), "early", 0, 1);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE(Send(session->get(), g, 0, kLength).ok());
  absl::StatusOr<bool> r = Update(session->get(), Args(1), {0, kLength});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(*r);
  EXPECT_TRUE(Read(RangeOf(small.get(), "early")) == before);
  r = Update(session->get(), Args(1), {0, 1000});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(*r);  // a smaller part needs the same copy
  VectorSink a(kOffset, kLength), b(kOffset, kLength);
  absl::StatusOr<StepOutcome> outcome = (*session)->Commit(Args(1), &a);
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_EQ(outcome->early_updated, 0u);
  ASSERT_TRUE(Plain("plain", 1, g, Args(1), &b).ok());
  EXPECT_TRUE(Read(RangeOf(small.get(), "early")) == Read("plain")) << "seed " << seed_;
  EXPECT_EQ(a.out(), b.out());
}

// A range on the disk tier: an early update is declined (its state is only streamed at the
// commit), and its steps give the bits the same steps give in memory, bf16 moments included (the
// state files hold them in the memory's storage).
TEST_P(UpdateEarlyTest, DiskTierDeclinesAndStepsAsInMemory) {
  TempDir dir;
  DiskTierOptions d;
  d.state_dir = dir.path() + "/state";
  d.wave_elements = kTileElements;
  d.memory_bytes = 3 * kStateTensors * kTileElements * 4;
  absl::StatusOr<std::unique_ptr<DiskTier>> disk = DiskTier::Open(d);
  ASSERT_TRUE(disk.ok()) << disk.status();
  std::unique_ptr<ShardStore> on_disk = MakeStore(int64_t{64} << 20, disk->get());
  CreateLoaded(on_disk.get(), "early");
  ASSERT_NE(RangeOf(on_disk.get(), "early").file, nullptr);
  EXPECT_EQ(RangeOf(on_disk.get(), "early").file->moments(), GetParam().state);
  ASSERT_NO_FATAL_FAILURE(CreateLoaded("plain"));
  for (uint64_t step = 1; step <= 3; ++step) {
    const std::vector<uint16_t> g = Grads();
    auto session = StepSession::Open(on_disk.get(), "early", 0, step);
    ASSERT_TRUE(session.ok()) << session.status();
    ASSERT_TRUE(Send(session->get(), g, 0, kLength).ok());
    absl::StatusOr<bool> r = Update(session->get(), Args(step), {0, 1000});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE(*r);
    VectorSink a(kOffset, kLength), b(kOffset, kLength);
    absl::StatusOr<StepOutcome> outcome = (*session)->Commit(Args(step), &a);
    ASSERT_TRUE(outcome.ok()) << outcome.status();
    EXPECT_EQ(outcome->early_updated, 0u);
    ASSERT_TRUE(Plain("plain", step, g, Args(step), &b).ok());
    EXPECT_EQ(a.out(), b.out()) << "step " << step << " seed " << seed_;
  }
  // The state as a checkpoint reads it (fp32, bf16 widened): the memory job's, bit for bit.
  State read;
  std::vector<float>* tensors[] = {&read.p, &read.m, &read.v};
  const StateTensor kinds[] = {StateTensor::kMasterWeights, StateTensor::kExpAvg,
                               StateTensor::kExpAvgSq};
  for (int t = 0; t < 3; ++t) {
    tensors[t]->resize(kLength);
    ASSERT_TRUE(on_disk
                    ->ReadState("early", kinds[t], DType::kFp32, kOffset, kLength, 5000,
                                [&](int64_t offset, int64_t, const std::string& chunk) {
                                  std::memcpy(tensors[t]->data() + (offset - kOffset), chunk.data(),
                                              chunk.size());
                                  return true;
                                })
                    .ok());
  }
  EXPECT_TRUE(read == Read("plain")) << "seed " << seed_;
}

// Malformed updates are refused, each with nothing changed, and the stream can still commit.
TEST_P(UpdateEarlyTest, MalformedUpdatesAreRefusedWithNothingChanged) {
  CreateLoaded("early");
  CreateLoaded("plain");
  const std::vector<uint16_t> g = Grads();
  auto session = StepSession::Open(store_.get(), "early", 0, 1);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE(Send(session->get(), g, 0, 30000).ok());
  ASSERT_TRUE(Applied(session->get(), Args(1), {1000, 2000}));
  const State state = Read("early");
  const int64_t used = store_->budget()->used();
  struct Case {
    const char* what;
    StepCommitArgs args;
    int64_t offset;  // flat
    int64_t n;
    absl::StatusCode code;
    const char* names;
  };
  StepCommitArgs wrong_step = Args(1);
  wrong_step.step = 2;
  StepCommitArgs skip = Args(1, true);
  StepCommitArgs nan_lr = Args(1);
  nan_lr.group_lr[1] = std::nan("");
  StepCommitArgs zero_multiplier = Args(1);
  zero_multiplier.grad_multiplier = 0;
  StepCommitArgs t_too_big = Args(1);
  t_too_big.range_steps = {RangeStep{kOffset + 100, 10, 2}};
  const std::vector<Case> cases = {
      {"no gradient yet", Args(1), kOffset + 29000, 2000, absl::StatusCode::kFailedPrecondition,
       "no gradient for element 31000"},
      {"overlapping an early update", Args(1), kOffset + 2999, 10,
       absl::StatusCode::kInvalidArgument, "overlaps [2000, 4000)"},
      {"the same part again", Args(1), kOffset + 1000, 2000, absl::StatusCode::kInvalidArgument,
       "overlaps"},
      {"before the range", Args(1), kOffset - 1, 10, absl::StatusCode::kOutOfRange, "range 0"},
      {"past the range", Args(1), kOffset + kLength - 5, 10, absl::StatusCode::kOutOfRange,
       "not a non-empty part"},
      {"empty", Args(1), kOffset + 10, 0, absl::StatusCode::kOutOfRange, "not a non-empty part"},
      {"another step", wrong_step, kOffset + 5000, 10, absl::StatusCode::kFailedPrecondition,
       "update.step is 2"},
      {"a skip", skip, kOffset + 5000, 10, absl::StatusCode::kInvalidArgument, "cannot skip"},
      {"a NaN lr", nan_lr, kOffset + 5000, 10, absl::StatusCode::kInvalidArgument,
       "update.group_lr[1]"},
      {"a zero multiplier", zero_multiplier, kOffset + 5000, 10, absl::StatusCode::kInvalidArgument,
       "update.grad_multiplier"},
      {"t past adam_step + 1", t_too_big, kOffset + 100, 10, absl::StatusCode::kInvalidArgument,
       "has t 2"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<bool> r = (*session)->UpdateEarly(c.args, c.offset, c.n);
    EXPECT_EQ(r.status().code(), c.code) << c.what << ": " << r.status();
    EXPECT_NE(r.status().message().find(c.names), std::string::npos)
        << c.what << ": " << r.status();
    EXPECT_TRUE(Read("early") == state) << c.what;
    EXPECT_EQ(store_->budget()->used(), used) << c.what;
  }
  ASSERT_TRUE(Send(session->get(), g, 30000, kLength).ok());
  VectorSink a(kOffset, kLength), b(kOffset, kLength);
  absl::StatusOr<StepOutcome> outcome = (*session)->Commit(Args(1), &a);
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_EQ(outcome->early_updated, 2000u);
  absl::StatusOr<bool> late = (*session)->UpdateEarly(Args(1), kOffset + 5000, 10);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition) << late.status();
  ASSERT_TRUE(Plain("plain", 1, g, Args(1), &b).ok());
  ExpectSame(a, b, "after the refusals");
}

// The state a job holds, 12 or 8 bytes an element; its moments read as fp32 (bf16 ones widened
// exactly) and loaded into a new job give the same state and the same next step, bit for bit: a
// checkpoint of either storage restores exactly.
TEST_P(UpdateEarlyTest, StateBytesAndMomentsReadAndLoadBackExactly) {
  absl::StatusOr<int64_t> bytes = store_->CreateJob(Config("sized"));
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  const int64_t stride = (kLength + 15) / 16 * 16;  // whole 64-byte lines of fp32
  EXPECT_EQ(*bytes, stride * (GetParam().state == DType::kBf16 ? 8 : 12));
  CreateLoaded("saved");
  CreateLoaded("plain");
  for (uint64_t step = 1; step <= 3; ++step) {
    const std::vector<uint16_t> g = Grads();
    VectorSink a(kOffset, kLength), b(kOffset, kLength);
    ASSERT_TRUE(Plain("saved", step, g, Args(step), &a).ok());
    ASSERT_TRUE(Plain("plain", step, g, Args(step), &b).ok());
  }
  ASSERT_TRUE(store_->CreateJob(Config("restored")).ok());
  auto loader = StateLoader::Start(store_.get(), "restored");
  ASSERT_TRUE(loader.ok()) << loader.status();
  const State saved = Read("saved");
  const std::vector<float>* tensors[] = {&saved.p, &saved.m, &saved.v};
  const StateTensor kinds[] = {StateTensor::kMasterWeights, StateTensor::kExpAvg,
                               StateTensor::kExpAvgSq};
  for (int t = 0; t < 3; ++t) {
    std::string read;
    ASSERT_TRUE(store_
                    ->ReadState("saved", kinds[t], DType::kFp32, kOffset, kLength, 5000,
                                [&read](int64_t, int64_t, const std::string& chunk) {
                                  read += chunk;
                                  return true;
                                })
                    .ok());
    ASSERT_EQ(read, Bytes(tensors[t]->data(), kLength * 4)) << "tensor " << t;
    ASSERT_TRUE((*loader)->AddChunk(kinds[t], kOffset, DType::kFp32, read).ok());
  }
  ASSERT_TRUE((*loader)->SetSteps(3, 3).ok());
  ASSERT_TRUE((*loader)->Apply().ok());
  EXPECT_TRUE(Read("restored") == saved);
  const std::vector<uint16_t> g = Grads();
  VectorSink a(kOffset, kLength), b(kOffset, kLength);
  ASSERT_TRUE(Plain("restored", 4, g, Args(4), &a).ok());
  ASSERT_TRUE(Plain("plain", 4, g, Args(4), &b).ok());
  EXPECT_TRUE(Read("restored") == Read("plain")) << "seed " << seed_;
  EXPECT_EQ(a.out(), b.out());
}

// bf16 moments: every early update and its undo, through the staging copy, as with fp32 ones
// (stochastic rounding: the early update and the commit round an element alike).
INSTANTIATE_TEST_SUITE_P(Dtypes, UpdateEarlyTest,
                         ::testing::Values(Dtypes{DType::kFp16, DType::kFp32},
                                           Dtypes{DType::kBf16, DType::kFp32},
                                           Dtypes{DType::kBf16, DType::kBf16}),
                         [](const ::testing::TestParamInfo<Dtypes>& info) {
                           return absl::StrCat(DTypeName(info.param.param), "_state_",
                                               DTypeName(info.param.state));
                         });

}  // namespace
}  // namespace offload
