// One step-exchange suite for every data plane (step_transport.h): the same cases run against
// gRPC, shared memory and UCX (over TCP and over shared memory), so the planes cannot drift
// apart. Every parameter the shard sends back is compared bit for bit with the Adam kernel run
// on a local copy of the state; every refused exchange must leave the shard's whole state
// (fp32 tensors and step counters) unchanged.
//
// The error of a refused exchange may surface at OpenStep, at SendGradients or at Commit,
// depending on when a plane learns of it (gRPC writes are buffered; the shared-memory plane may
// check a chunk before it touches the segment). The suite takes the first error of the three,
// and expects the codes of the gRPC Step method (optimizer_service_test.cc): OUT_OF_RANGE for a
// chunk outside the range, INVALID_ARGUMENT for an overlapping one, FAILED_PRECONDITION for a
// step that is not next.
#include <dirent.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/metrics/metrics.h"
#include "base/thread_pool.h"
#include "cpu_optimizer_server/grpc/optimizer_service.h"
#include "cpu_optimizer_server/grpc/shard_client.h"
#include "cpu_optimizer_server/shard/server_metrics.h"
#include "cpu_optimizer_server/shard/shard_store.h"
#include "cpu_optimizer_server/shard/wire_convert.h"
#include "cpu_optimizer_server/shm/shm_transport.h"
#include "cpu_optimizer_server/stall/step_timeout.h"
#include "cpu_optimizer_server/tools/range_driver.h"
#include "cpu_optimizer_server/transport/step_transport.h"
#ifdef OFFLOAD_HAVE_UCX
#include "cpu_optimizer_server/ucx/ucx_transport.h"
#endif

namespace offload {
namespace {

constexpr char kJob[] = "xchg-job";
// Two ranges whose lengths are not multiples of a tile, a wave or a 64 KiB chunk.
constexpr int64_t kLen0 = 70001;  // range 0: [0, kLen0)
constexpr int64_t kLen1 = 33333;  // range 1: [kLen0, kLen0 + kLen1)
constexpr int64_t kTotal = kLen0 + kLen1;
constexpr int64_t kOffsets[2] = {0, kLen0};
constexpr int64_t kLengths[2] = {kLen0, kLen1};
constexpr float kLr = 1e-3f;
// Small chunks and slots, so one range takes several of each on every plane.
constexpr int64_t kChunkBytes = 64 << 10;
constexpr uint16_t kSentinel = 0xabcd;  // fills a parameter buffer nothing should write

// One SendGradients call: flat elements [offset, offset + n) of `data`.
struct Chunk {
  int64_t offset;
  int64_t n;
  const void* data;
  DType dtype;
  bool accumulate = false;
};

// The /dev/shm entries a segment of this process's shard could leave behind. Only this process's:
// ctest runs other test processes beside this one, whose segments come and go meanwhile.
std::set<std::string> ShmEntries() {
  std::set<std::string> names;
  const std::string prefix = absl::StrCat("offload-", getpid(), "-");
  if (DIR* dir = opendir("/dev/shm")) {
    while (dirent* e = readdir(dir)) {
      if (absl::StartsWith(e->d_name, prefix)) names.insert(e->d_name);
    }
    closedir(dir);
  }
  return names;
}

// The parameter: a plane, and for UCX the UCX_TLS it runs under ("" leaves UCX to choose).
struct Plane {
  std::string name;  // test name suffix
  std::string kind;  // grpc, shm or ucx
  std::string ucx_tls;
};

// gtest prints a failing case's parameter by name, not as bytes.
void PrintTo(const Plane& plane, std::ostream* os) { *os << plane.name; }

class StepExchangeTest : public ::testing::TestWithParam<Plane> {
 protected:
  void SetUp() override {
    const Plane& plane = GetParam();
    shm_before_ = ShmEntries();
    // UCX reads UCX_TLS when a context is created: the server's context at Start, the trainer's
    // in CreateUcxTransport. Both live in this process, so one setenv covers both.
    if (!plane.ucx_tls.empty()) {
      const char* old = std::getenv("UCX_TLS");
      had_ucx_tls_ = old != nullptr;
      if (had_ucx_tls_) old_ucx_tls_ = old;
      setenv("UCX_TLS", plane.ucx_tls.c_str(), 1);
    }
    pool_ = std::make_unique<ThreadPool>(ThreadPool::Options{2, false});
    ShardOptions options;
    options.memory_limit_bytes = int64_t{256} << 20;
    options.wave_elements = 2 * kTileElements;  // several waves per range
    store_ = std::make_unique<ShardStore>(options, pool_.get(), BestSimdPath());
    ServerOptions server_options;
    server_options.listen_address = "127.0.0.1:0";
    server_options.max_message_bytes = int64_t{8} << 20;
    server_options.enable_shm = plane.kind == "shm";
    server_options.enable_ucx = plane.kind == "ucx";
    auto server = OptimizerServer::Start(server_options, store_.get());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    Connect(ClientOptions().step_timeout_floor);
    if (HasFatalFailure()) return;

    seed_ = std::random_device()();
    rng_.seed(seed_);
    AdamHyperParams adam;
    adam.lr = kLr;
    adam.weight_decay = 0.01f;
    hp_ = adam;
    ASSERT_TRUE(client_
                    ->CreateJob(MakeCreateJobRequest(kJob, {{0, kLen0}, {kLen0, kLen1}}, adam,
                                                     DType::kBf16))
                    .ok());
    ref_p_ = Random(kTotal, 1.0f);
    ref_m_.assign(kTotal, 0.0f);
    ref_v_.assign(kTotal, 0.0f);
    ASSERT_TRUE(
        client_->LoadState(kJob, v1::STATE_TENSOR_MASTER_WEIGHTS, 0, ref_p_.data(), kTotal).ok());
  }

  // The trainer's side: a client and the plane's transport on it, in place of any before.
  void Connect(absl::Duration step_timeout_floor) {
    const Plane& plane = GetParam();
    owned_transport_.reset();
    transport_ = nullptr;
    client_.reset();
    ClientOptions client_options;
    client_options.step_timeout_floor = step_timeout_floor;
    client_options.address = "127.0.0.1:" + std::to_string(server_->port());
    client_options.chunk_bytes = kChunkBytes;
    client_options.max_message_bytes = int64_t{8} << 20;
    auto client = ShardClient::Connect(client_options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);

    if (plane.kind == "grpc") {
      transport_ = client_.get();
    } else if (plane.kind == "shm") {
      ASSERT_TRUE(ProbeShm(client_.get()).ok()) << ProbeShm(client_.get());
      ShmOptions shm;
      shm.chunk_slot_bytes = kChunkBytes;
      auto t = CreateShmTransport(client_.get(), shm);
      ASSERT_TRUE(t.ok()) << t.status();
      owned_transport_ = *std::move(t);
      transport_ = owned_transport_.get();
#ifdef OFFLOAD_HAVE_UCX
    } else if (plane.kind == "ucx") {
      absl::Status probe = ProbeUcx(client_.get());
      ASSERT_TRUE(probe.ok()) << probe;
      UcxOptions ucx;
      ucx.chunk_bytes = kChunkBytes;
      auto t = CreateUcxTransport(client_.get(), ucx);
      ASSERT_TRUE(t.ok()) << t.status();
      owned_transport_ = *std::move(t);
      transport_ = owned_transport_.get();
#endif
    }
    ASSERT_NE(transport_, nullptr) << "no transport " << plane.kind;
    EXPECT_EQ(transport_->name(), plane.kind);
  }

  void TearDown() override {
    // Trainer side first, then the server: the order a trainer's exit and a shard's would take.
    owned_transport_.reset();
    transport_ = nullptr;
    client_.reset();
    server_.reset();
    store_.reset();
    pool_.reset();
    if (!GetParam().ucx_tls.empty()) {
      if (had_ucx_tls_) {
        setenv("UCX_TLS", old_ucx_tls_.c_str(), 1);
      } else {
        unsetenv("UCX_TLS");
      }
    }
    // The shard unlinks a segment's name once the trainer has mapped it, so none may remain.
    for (const std::string& name : ShmEntries()) {
      EXPECT_TRUE(shm_before_.count(name)) << "/dev/shm/" << name << " left behind";
    }
  }

  std::vector<float> Random(int64_t n, float scale) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng_);
    return v;
  }

  std::vector<uint16_t> Bf16Grads(int64_t n) {
    std::vector<float> g = Random(n, 0.1f);
    std::vector<uint16_t> h(n);
    for (int64_t i = 0; i < n; ++i) h[i] = FloatToBf16(g[i]);
    return h;
  }

  // All of range r's gradients (length,) in one chunk.
  static std::vector<Chunk> Whole(int r, const void* g, DType dtype = DType::kBf16) {
    return {Chunk{kOffsets[r], kLengths[r], g, dtype}};
  }

  // One step exchange of range r through the transport under test: OpenStep, the chunks in the
  // order given, Commit into *params (range length,). Returns the first error of the three.
  absl::StatusOr<v1::StepResult> Exchange(int r, uint64_t step, const std::vector<Chunk>& chunks,
                                          std::vector<uint16_t>* params, bool skip = false,
                                          double lr = kLr, float grad_multiplier = 1.0f,
                                          absl::Span<const double> group_lr = {},
                                          absl::Span<const RangeStep> range_steps = {}) {
    params->assign(kLengths[r], kSentinel);
    auto stream = transport_->OpenStep(kJob, r, kOffsets[r], kLengths[r], step);
    if (!stream.ok()) return stream.status();
    for (const Chunk& c : chunks) {
      absl::Status s = (*stream)->SendGradients(c.offset, c.data, c.dtype, c.n, c.accumulate);
      if (!s.ok()) return s;
    }
    return (*stream)->Commit(lr, grad_multiplier, skip, params->data(), group_lr, range_steps);
  }

  // Exchange, retried while the range's lease is still held (ABORTED) by a stream the shard
  // has not yet seen end: abandoning is asynchronous on every plane.
  absl::StatusOr<v1::StepResult> ExchangeAfterAbandon(int r, uint64_t step,
                                                      const std::vector<Chunk>& chunks,
                                                      std::vector<uint16_t>* params) {
    absl::StatusOr<v1::StepResult> result;
    for (int attempt = 0; attempt < 250; ++attempt) {
      result = Exchange(r, step, chunks, params);
      if (result.status().code() != absl::StatusCode::kAborted) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return result;
  }

  // The same update on the local copy of range r's state: the next Adam step of that range.
  // Returns the 16-bit parameters (length,) the shard must send.
  std::vector<uint16_t> Reference(int r, const void* grads, DType dtype, float lr = kLr,
                                  float grad_multiplier = 1.0f) {
    const int64_t o = kOffsets[r], n = kLengths[r];
    std::vector<uint16_t> out(n);
    AdamSpan span{
        grads,        dtype, ref_p_.data() + o, ref_m_.data() + o, ref_v_.data() + o, out.data(),
        DType::kBf16, n};
    const int64_t t = static_cast<int64_t>(++ref_adam_step_[r]);
    GetAdamKernel(BestSimdPath())(ComputeAdamStepScalars(hp_, lr, t, grad_multiplier), span);
    return out;
  }

  // The shard's fp32 master weights (kTotal,), read over gRPC.
  std::vector<float> MasterWeights() {
    std::vector<float> w(kTotal);
    EXPECT_TRUE(
        client_->ReadState(kJob, v1::STATE_TENSOR_MASTER_WEIGHTS, DType::kFp32, 0, kTotal, w.data())
            .ok());
    return w;
  }

  v1::RangeStatus RangeStatusOf(int r) {
    auto describe = client_->DescribeShard();
    EXPECT_TRUE(describe.ok()) << describe.status();
    if (!describe.ok() || describe->jobs_size() != 1) return {};
    return describe->jobs(0).ranges(r);
  }

  // The whole fp32 state plus the step counters, as a client sees it.
  std::string StateFingerprint() {
    std::string all;
    for (v1::StateTensor t :
         {v1::STATE_TENSOR_MASTER_WEIGHTS, v1::STATE_TENSOR_EXP_AVG, v1::STATE_TENSOR_EXP_AVG_SQ}) {
      std::string bytes(kTotal * 4, '\0');
      EXPECT_TRUE(client_->ReadState(kJob, t, DType::kFp32, 0, kTotal, bytes.data()).ok());
      all += bytes;
    }
    auto describe = client_->DescribeShard();
    EXPECT_TRUE(describe.ok());
    if (describe.ok()) {
      for (const v1::JobStatus& j : describe->jobs()) {
        for (const v1::RangeStatus& s : j.ranges()) all += s.SerializeAsString();
      }
    }
    return all;
  }

  // Where a mismatch is, for a readable failure.
  static std::string FirstDifference(const std::vector<uint16_t>& got,
                                     const std::vector<uint16_t>& want) {
    if (got.size() != want.size()) {
      return "sizes " + std::to_string(got.size()) + " vs " + std::to_string(want.size());
    }
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i] != want[i]) {
        return "element " + std::to_string(i) + ": " + std::to_string(got[i]) + " vs " +
               std::to_string(want[i]);
      }
    }
    return "none";
  }

  // Destroyed in reverse: the transport, the client, the server, the store, the pool.
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<ShardStore> store_;
  std::unique_ptr<OptimizerServer> server_;
  std::unique_ptr<ShardClient> client_;
  std::unique_ptr<StepTransport> owned_transport_;  // shm and ucx; gRPC is the client itself
  StepTransport* transport_ = nullptr;

  std::set<std::string> shm_before_;
  bool had_ucx_tls_ = false;
  std::string old_ucx_tls_;
  uint32_t seed_ = 0;
  std::mt19937 rng_;
  AdamHyperParams hp_;
  std::vector<float> ref_p_, ref_m_, ref_v_;  // (kTotal,) the local copy of the shard's state
  uint64_t ref_adam_step_[2] = {0, 0};
};

TEST_P(StepExchangeTest, FullStepMatchesTheKernel) {
  std::vector<uint16_t> g0 = Bf16Grads(kLen0), g1 = Bf16Grads(kLen1), p0, p1;
  auto r0 = Exchange(0, 1, Whole(0, g0.data()), &p0);
  ASSERT_TRUE(r0.ok()) << r0.status();
  auto r1 = Exchange(1, 1, Whole(1, g1.data()), &p1);
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_EQ(r0->step(), 1u);
  EXPECT_TRUE(r0->applied());
  EXPECT_FALSE(r0->replayed());
  EXPECT_FALSE(r0->skipped());
  EXPECT_EQ(r0->adam_step(), 1u);
  EXPECT_TRUE(r1->applied());
  const std::vector<uint16_t> e0 = Reference(0, g0.data(), DType::kBf16);
  const std::vector<uint16_t> e1 = Reference(1, g1.data(), DType::kBf16);
  EXPECT_TRUE(p0 == e0) << FirstDifference(p0, e0) << " seed " << seed_;
  EXPECT_TRUE(p1 == e1) << FirstDifference(p1, e1) << " seed " << seed_;
  EXPECT_TRUE(MasterWeights() == ref_p_) << "seed " << seed_;
}

TEST_P(StepExchangeTest, Fp32GradientsMatchTheKernel) {
  // fp32 gradients cannot be read in place as 16-bit ones: the shared-memory plane carries them
  // through its chunk slots, the others as ordinary chunks.
  std::vector<float> g = Random(kLen0, 0.1f);
  std::vector<uint16_t> p;
  auto r = Exchange(0, 1, Whole(0, g.data(), DType::kFp32), &p);
  ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<uint16_t> e = Reference(0, g.data(), DType::kFp32);
  EXPECT_TRUE(p == e) << FirstDifference(p, e) << " seed " << seed_;
}

TEST_P(StepExchangeTest, ConsecutiveStepsMatchTheKernel) {
  for (uint64_t step = 1; step <= 4; ++step) {
    const float lr = kLr * static_cast<float>(step);
    const float gm = step % 2 ? 1.0f : 0.5f;  // loss scaling comes and goes
    for (int r = 0; r < 2; ++r) {
      std::vector<uint16_t> g = Bf16Grads(kLengths[r]), p;
      auto result = Exchange(r, step, Whole(r, g.data()), &p, false, lr, gm);
      ASSERT_TRUE(result.ok()) << "step " << step << " range " << r << ": " << result.status();
      EXPECT_EQ(result->step(), step);
      EXPECT_EQ(result->adam_step(), step);
      const std::vector<uint16_t> e = Reference(r, g.data(), DType::kBf16, lr, gm);
      ASSERT_TRUE(p == e) << "step " << step << " range " << r << ": " << FirstDifference(p, e)
                          << " seed " << seed_;
    }
  }
  EXPECT_TRUE(MasterWeights() == ref_p_) << "seed " << seed_;
  EXPECT_EQ(RangeStatusOf(0).completed_step(), 4u);
  EXPECT_EQ(RangeStatusOf(1).adam_step(), 4u);
}

TEST_P(StepExchangeTest, ChunksOutOfOrderMatchTheKernel) {
  std::vector<uint16_t> g = Bf16Grads(kLen0), p;
  // Five uneven pieces (none a whole number of 64 KiB chunks), sent in a scrambled order.
  const int64_t cuts[] = {0, 1, 40000, 40001, 65537, kLen0};
  std::vector<Chunk> pieces;
  for (int i : {3, 0, 4, 2, 1}) {
    pieces.push_back(Chunk{cuts[i], cuts[i + 1] - cuts[i], g.data() + cuts[i], DType::kBf16});
  }
  auto r = Exchange(0, 1, pieces, &p);
  ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<uint16_t> e = Reference(0, g.data(), DType::kBf16);
  EXPECT_TRUE(p == e) << FirstDifference(p, e) << " seed " << seed_;
  // Range 1 in reverse halves: flat offsets, not range-relative ones.
  std::vector<uint16_t> g1 = Bf16Grads(kLen1), p1;
  const int64_t cut = 20000;
  auto r1 = Exchange(1, 1,
                     {Chunk{kLen0 + cut, kLen1 - cut, g1.data() + cut, DType::kBf16},
                      Chunk{kLen0, cut, g1.data(), DType::kBf16}},
                     &p1);
  ASSERT_TRUE(r1.ok()) << r1.status();
  const std::vector<uint16_t> e1 = Reference(1, g1.data(), DType::kBf16);
  EXPECT_TRUE(p1 == e1) << FirstDifference(p1, e1) << " seed " << seed_;
}

TEST_P(StepExchangeTest, ReplayOfACommittedStepReturnsTheSameParameters) {
  std::vector<uint16_t> g = Bf16Grads(kLen0), first, again;
  auto r = Exchange(0, 1, Whole(0, g.data()), &first);
  ASSERT_TRUE(r.ok()) << r.status();
  const std::string state = StateFingerprint();
  // A replay after a lost reply: no gradients at all.
  auto replay = Exchange(0, 1, {}, &again);
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_TRUE(replay->replayed());
  EXPECT_FALSE(replay->applied());
  EXPECT_EQ(replay->step(), 1u);
  EXPECT_EQ(replay->adam_step(), 1u);
  EXPECT_TRUE(again == first) << FirstDifference(again, first);
  EXPECT_EQ(StateFingerprint(), state);
  // A replay that resends (different) gradients: they are validated and ignored.
  std::vector<uint16_t> other = Bf16Grads(kLen0);
  replay = Exchange(0, 1, Whole(0, other.data()), &again);
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_TRUE(replay->replayed());
  EXPECT_TRUE(again == first) << FirstDifference(again, first);
  EXPECT_EQ(StateFingerprint(), state);
  // And the next step still follows on from the first.
  Reference(0, g.data(), DType::kBf16);
  std::vector<uint16_t> g2 = Bf16Grads(kLen0), p2;
  auto r2 = Exchange(0, 2, Whole(0, g2.data()), &p2);
  ASSERT_TRUE(r2.ok()) << r2.status();
  const std::vector<uint16_t> e2 = Reference(0, g2.data(), DType::kBf16);
  EXPECT_TRUE(p2 == e2) << FirstDifference(p2, e2) << " seed " << seed_;
}

TEST_P(StepExchangeTest, WrongStepIsFailedPreconditionAndChangesNothing) {
  std::vector<uint16_t> g = Bf16Grads(kLen0), p;
  std::string state = StateFingerprint();
  for (uint64_t step : {0, 2, 3}) {
    auto r = Exchange(0, step, Whole(0, g.data()), &p);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition)
        << "step " << step << ": " << r.status();
    EXPECT_FALSE(r.status().message().empty());
    EXPECT_EQ(StateFingerprint(), state) << "step " << step;
  }
  auto r1 = ExchangeAfterAbandon(0, 1, Whole(0, g.data()), &p);
  ASSERT_TRUE(r1.ok()) << r1.status();
  const std::vector<uint16_t> e = Reference(0, g.data(), DType::kBf16);
  EXPECT_TRUE(p == e) << FirstDifference(p, e);
  state = StateFingerprint();
  // Behind and ahead of a committed step; 1 itself is a replay, not an error.
  for (uint64_t step : {0, 3, 7}) {
    auto r = Exchange(0, step, Whole(0, g.data()), &p);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition)
        << "step " << step << ": " << r.status();
    EXPECT_EQ(StateFingerprint(), state) << "step " << step;
  }
}

TEST_P(StepExchangeTest, BadChunkIsRefusedAndTheStepAppliesNothing) {
  std::vector<uint16_t> warm = Bf16Grads(kLen1), p;
  ASSERT_TRUE(Exchange(1, 1, Whole(1, warm.data()), &p).ok());
  Reference(1, warm.data(), DType::kBf16);
  const std::string state = StateFingerprint();
  // Every case below also sends the whole range, so only the bad chunk can make it fail.
  std::vector<uint16_t> g = Bf16Grads(kLen1 + 100);
  const Chunk all{kLen0, kLen1, g.data(), DType::kBf16};
  struct Case {
    const char* what;
    absl::StatusCode code;
    std::vector<Chunk> chunks;
  };
  const std::vector<Case> cases = {
      {"offset past the range",
       absl::StatusCode::kOutOfRange,
       {all, Chunk{kTotal, 10, g.data(), DType::kBf16}}},
      {"chunk runs past the range",
       absl::StatusCode::kOutOfRange,
       {Chunk{kLen0 + 50, kLen1, g.data(), DType::kBf16}, all}},
      {"offset before the range (in range 0)",
       absl::StatusCode::kOutOfRange,
       {Chunk{kLen0 - 10, 20, g.data(), DType::kBf16}, all}},
      {"negative offset", absl::StatusCode::kOutOfRange, {Chunk{-5, 10, g.data(), DType::kBf16}}},
      {"overlapping chunk",
       absl::StatusCode::kInvalidArgument,
       {Chunk{kLen0, 1000, g.data(), DType::kBf16},
        Chunk{kLen0 + 999, kLen1 - 999, g.data() + 999, DType::kBf16}}},
      {"the same chunk twice", absl::StatusCode::kInvalidArgument, {all, all}},
  };
  for (const Case& c : cases) {
    auto r = Exchange(1, 2, c.chunks, &p);
    EXPECT_EQ(r.status().code(), c.code) << c.what << ": " << r.status();
    EXPECT_FALSE(r.status().message().empty()) << c.what;
    EXPECT_EQ(StateFingerprint(), state) << c.what;
  }
  // The refused exchanges released the range: step 2 now works, and counts from step 1.
  std::vector<uint16_t> good = Bf16Grads(kLen1);
  auto r = ExchangeAfterAbandon(1, 2, Whole(1, good.data()), &p);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->adam_step(), 2u);
  const std::vector<uint16_t> e = Reference(1, good.data(), DType::kBf16);
  EXPECT_TRUE(p == e) << FirstDifference(p, e) << " seed " << seed_;
}

TEST_P(StepExchangeTest, NonFiniteGradientIsRefusedAndChangesNothing) {
  // The shard scans a chunk in tiles across its pool: the NaN sits in the last tile.
  std::vector<uint16_t> g = Bf16Grads(kLen0), p;
  g[kLen0 - 1] = 0x7fc0;  // bf16 NaN
  const std::string state = StateFingerprint();
  auto r = Exchange(0, 1, Whole(0, g.data()), &p);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "inf or NaN")) << r.status();
  EXPECT_EQ(StateFingerprint(), state);
  if (GetParam().kind != "shm" && GetParam().kind != "grpc") return;
  // Written into the gradient area, the same gradients are refused the same way.
  auto stream = transport_->OpenStep(kJob, 0, 0, kLen0, 1);
  ASSERT_TRUE(stream.ok()) << stream.status();
  char* area = static_cast<char*>((*stream)->GradientArea());  // (kLen0,) bf16
  ASSERT_NE(area, nullptr);
  std::memcpy(area, g.data(), kLen0 * 2);
  absl::Status sent = (*stream)->SendGradients(0, area, DType::kBf16, kLen0);
  std::vector<uint16_t> none(kLen0, kSentinel);
  absl::StatusOr<v1::StepResult> committed =
      !sent.ok() ? sent
      : GetParam().kind == "shm"
          ? (*stream)->CommitInPlace(kLr, 1.0f, false,
                                     [](int64_t, int64_t, const void*) {
                                       ADD_FAILURE() << "parameters of a refused step";
                                     })
          : (*stream)->Commit(kLr, 1.0f, false, none.data());
  EXPECT_EQ(committed.status().code(), absl::StatusCode::kInvalidArgument) << committed.status();
  EXPECT_TRUE(none == std::vector<uint16_t>(kLen0, kSentinel)) << "parameters of a refused step";
  EXPECT_EQ(StateFingerprint(), state);
}

// Parameter groups on every plane: the commit's group lrs arrive, and each group's piece of a
// range runs with its group's hyper-parameters and lr. The inputs are seeded alike for every
// plane and must give the kernel's bits piece by piece, so every plane sends the same bits.
TEST_P(StepExchangeTest, ParameterGroupsGetTheirLrsOnEveryPlane) {
  // Group 0 is the fixture's AdamW. Group 1 starts inside a tile and a wave of range 0 and holds
  // all of range 1: Adam with L2 decay 0, other betas and eps.
  constexpr int64_t kCut = 40001;
  AdamHyperParams other;
  other.beta1 = 0.85f;
  other.beta2 = 0.98f;
  other.eps = 1e-6f;
  other.weight_decay = 0.0f;
  other.adamw = false;
  const AdamHyperParams hps[2] = {hp_, other};
  const int64_t group_begin[2] = {0, kCut}, group_end[2] = {kCut, kTotal};
  v1::CreateJobRequest request =
      MakeCreateJobRequest(kJob, {{0, kLen0}, {kLen0, kLen1}}, hp_, DType::kBf16);
  for (int k = 0; k < 2; ++k) {
    v1::ParamGroup* g = request.add_groups();
    g->set_offset(group_begin[k]);
    g->set_length(group_end[k] - group_begin[k]);
    *g->mutable_adam() = AdamConfigToProto(hps[k]);
  }
  ASSERT_TRUE(client_->DropJob(kJob).ok());
  ASSERT_TRUE(client_->CreateJob(request).ok());
  rng_.seed(20240611);  // the same inputs on every plane
  ref_p_ = Random(kTotal, 1.0f);
  ref_m_.assign(kTotal, 0.0f);
  ref_v_.assign(kTotal, 0.0f);
  ASSERT_TRUE(
      client_->LoadState(kJob, v1::STATE_TENSOR_MASTER_WEIGHTS, 0, ref_p_.data(), kTotal).ok());
  // Range r's update on the local copy, group piece by group piece.
  auto reference = [&](int r, const uint16_t* g, const double* lrs, uint64_t t, float gm) {
    std::vector<uint16_t> out(kLengths[r]);
    for (int k = 0; k < 2; ++k) {
      const int64_t lo = std::max(kOffsets[r], group_begin[k]);
      const int64_t hi = std::min(kOffsets[r] + kLengths[r], group_end[k]);
      if (lo >= hi) continue;
      AdamSpan span{g + (lo - kOffsets[r]), DType::kBf16,
                    ref_p_.data() + lo,     ref_m_.data() + lo,
                    ref_v_.data() + lo,     out.data() + (lo - kOffsets[r]),
                    DType::kBf16,           hi - lo};
      GetAdamKernel(BestSimdPath())(
          ComputeAdamStepScalars(hps[k], lrs[k], static_cast<int64_t>(t), gm), span);
    }
    return out;
  };
  for (uint64_t step = 1; step <= 3; ++step) {
    // Doubles not exact in fp32: every plane must carry them as they are.
    const double lrs[2] = {1e-3 / step, 2e-4 * step};
    const float gm = step == 2 ? 0.5f : 1.0f;
    for (int r = 0; r < 2; ++r) {
      std::vector<uint16_t> g = Bf16Grads(kLengths[r]), p;
      // `lr` is unused with group lrs: a NaN there must not matter.
      auto result = Exchange(r, step, Whole(r, g.data()), &p, false, std::nanf(""), gm, lrs);
      ASSERT_TRUE(result.ok()) << "step " << step << " range " << r << ": " << result.status();
      const std::vector<uint16_t> e = reference(r, g.data(), lrs, step, gm);
      ASSERT_TRUE(p == e) << "step " << step << " range " << r << ": " << FirstDifference(p, e);
    }
  }
  EXPECT_TRUE(MasterWeights() == ref_p_);
  if (GetParam().kind == "shm") {
    // The zero-copy commit carries them too.
    const double lrs[2] = {3e-4, 7e-4};
    const std::vector<uint16_t> g = Bf16Grads(kLen0);
    auto stream = transport_->OpenStep(kJob, 0, 0, kLen0, 4);
    ASSERT_TRUE(stream.ok()) << stream.status();
    ASSERT_TRUE((*stream)->SendGradients(0, g.data(), DType::kBf16, kLen0).ok());
    std::vector<uint16_t> p(kLen0, kSentinel);
    auto r = (*stream)->CommitInPlace(
        kLr, 1.0f, false,
        [&](int64_t begin, int64_t n, const void* params) {
          std::memcpy(p.data() + begin, params, n * 2);
        },
        lrs);
    ASSERT_TRUE(r.ok()) << r.status();
    const std::vector<uint16_t> e = reference(0, g.data(), lrs, 4, 1.0f);
    EXPECT_TRUE(p == e) << FirstDifference(p, e);
  }

  // Refused on every plane, and nothing changes: one lr for two groups, a NaN one, a negative
  // one, more than any job may have.
  const uint64_t next = 4;  // range 1's
  const std::string state = StateFingerprint();
  const std::vector<uint16_t> g = Bf16Grads(kLen1);
  struct Case {
    const char* what;
    std::vector<double> group_lr;
    const char* names;
  };
  const std::vector<Case> cases = {
      {"one lr for two groups", {kLr}, "group_lr"},
      {"NaN lr of group 1", {kLr, std::nanf("")}, "group_lr[1]"},
      {"negative lr of group 0", {-kLr, kLr}, "group_lr[0]"},
      {"65 lrs", std::vector<double>(kMaxParamGroups + 1, kLr), "65"},
  };
  std::vector<uint16_t> p;
  for (const Case& c : cases) {
    absl::StatusOr<v1::StepResult> r;
    for (int attempt = 0; attempt < 250; ++attempt) {  // the last refusal may still hold the lease
      r = Exchange(1, next, Whole(1, g.data()), &p, false, kLr, 1.0f, c.group_lr);
      if (r.status().code() != absl::StatusCode::kAborted) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
        << c.what << ": " << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), c.names)) << c.what << ": " << r.status();
    EXPECT_EQ(StateFingerprint(), state) << c.what;
  }
}

// Range steps (StepCommit.range_steps) travel on every plane: a skipped run and runs with their
// own t, one reaching from range 0 into range 1 (each range's shard takes its part), checked bit
// for bit against the kernel run piece by piece on the local copy; a bad list is refused on every
// plane with nothing changed.
TEST_P(StepExchangeTest, RangeStepsSkipAndOverrideTOnEveryPlane) {
  // Range r's next update on the local copy: the range's t, but steps' own where they say so.
  auto reference = [&](int r, const uint16_t* g, const std::vector<RangeStep>& steps) {
    const int64_t o = kOffsets[r], n = kLengths[r];
    const int64_t t = static_cast<int64_t>(++ref_adam_step_[r]);
    std::vector<uint16_t> out(n);
    auto update = [&](int64_t lo, int64_t hi, int64_t step_t) {  // flat [lo, hi)
      if (lo >= hi) return;
      if (step_t == 0) {
        for (int64_t i = lo; i < hi; ++i) out[i - o] = FloatToBf16(ref_p_[i]);
        return;
      }
      AdamSpan span{
          g + (lo - o),       DType::kBf16,          ref_p_.data() + lo, ref_m_.data() + lo,
          ref_v_.data() + lo, out.data() + (lo - o), DType::kBf16,       hi - lo};
      GetAdamKernel(SimdPath::kScalar)(ComputeAdamStepScalars(hp_, kLr, step_t, 1.0f), span);
    };
    int64_t at = o;
    for (const RangeStep& rs : ClipRangeSteps(steps, o, o + n)) {
      update(at, rs.offset, t);
      update(rs.offset, rs.offset + rs.length, static_cast<int64_t>(rs.t));
      at = rs.offset + rs.length;
    }
    update(at, o + n, t);
    return out;
  };
  const std::vector<RangeStep> steps = {
      {5, 1000, 0},            // skipped, from inside the first vector
      {20001, 5000, 1},        // t 1 across a tile and a wave
      {kLen0 - 10, 17, 0},     // skipped, the end of range 0 and the start of range 1
      {kLen0 + 40000, 3, 2}};  // beyond range 1: nobody's
  for (uint64_t step = 1; step <= 3; ++step) {
    for (int r = 0; r < 2; ++r) {
      const std::vector<uint16_t> g = Bf16Grads(kLengths[r]);
      std::vector<uint16_t> p;
      // Step 1 plain (t 1 for every element), then with the range steps.
      const std::vector<RangeStep> these = step == 1 ? std::vector<RangeStep>() : steps;
      auto result = Exchange(r, step, Whole(r, g.data()), &p, false, kLr, 1.0f, {}, these);
      ASSERT_TRUE(result.ok()) << "step " << step << " range " << r << ": " << result.status();
      EXPECT_EQ(result->adam_step(), step);
      const std::vector<uint16_t> e = reference(r, g.data(), these);
      ASSERT_TRUE(p == e) << "step " << step << " range " << r << ": " << FirstDifference(p, e)
                          << " seed " << seed_;
    }
  }
  EXPECT_TRUE(MasterWeights() == ref_p_) << "seed " << seed_;
  if (GetParam().kind == "shm") {
    // The zero-copy commit carries them too.
    const std::vector<uint16_t> g = Bf16Grads(kLen0);
    auto stream = transport_->OpenStep(kJob, 0, 0, kLen0, 4);
    ASSERT_TRUE(stream.ok()) << stream.status();
    ASSERT_TRUE((*stream)->SendGradients(0, g.data(), DType::kBf16, kLen0).ok());
    std::vector<uint16_t> p(kLen0, kSentinel);
    auto r = (*stream)->CommitInPlace(
        kLr, 1.0f, false,
        [&](int64_t begin, int64_t n, const void* params) {
          std::memcpy(p.data() + begin, params, n * 2);
        },
        {}, steps);
    ASSERT_TRUE(r.ok()) << r.status();
    const std::vector<uint16_t> e = reference(0, g.data(), steps);
    EXPECT_TRUE(p == e) << FirstDifference(p, e);
  }

  // Refused on every plane, and nothing changes.
  const uint64_t next = 4;  // range 1's
  const std::string state = StateFingerprint();
  const std::vector<uint16_t> g = Bf16Grads(kLen1);
  struct Case {
    const char* what;
    std::vector<RangeStep> steps;
    const char* names;
  };
  const std::vector<Case> cases = {
      {"t past adam_step + 1", {{kLen0 + 5, 10, 9}}, "has t 9"},
      {"overlapping", {{kLen0 + 5, 10, 0}, {kLen0 + 14, 10, 1}}, "range_steps[1] starts at"},
      {"empty", {{kLen0 + 5, 0, 0}}, "range_steps[0]"},
  };
  std::vector<uint16_t> p;
  for (const Case& c : cases) {
    absl::StatusOr<v1::StepResult> r;
    for (int attempt = 0; attempt < 250; ++attempt) {  // the last refusal may still hold the lease
      r = Exchange(1, next, Whole(1, g.data()), &p, false, kLr, 1.0f, {}, c.steps);
      if (r.status().code() != absl::StatusCode::kAborted) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
        << c.what << ": " << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), c.names)) << c.what << ": " << r.status();
    EXPECT_EQ(StateFingerprint(), state) << c.what;
  }
}

// Zero-copy (step_transport.h): on shared memory the trainer writes its gradients into the
// segment and reads the parameters where the shard wrote them; gRPC sends from its gradient area
// and commits into the trainer's buffer; UCX has neither.
TEST_P(StepExchangeTest, ZeroCopyStepsMatchTheKernel) {
  const bool has_area = GetParam().kind == "shm" || GetParam().kind == "grpc";
  const bool in_place = GetParam().kind == "shm";
  if (!in_place) {
    // On range 1: the shard may hold range 0 a moment after this stream ends.
    auto stream = transport_->OpenStep(kJob, 1, kLen0, kLen1, 1);
    ASSERT_TRUE(stream.ok()) << stream.status();
    EXPECT_EQ((*stream)->GradientArea() != nullptr, has_area);
    auto r = (*stream)->CommitInPlace(kLr, 1.0f, false, [](int64_t, int64_t, const void*) {});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented) << r.status();
    if (!has_area) return;
  }
  uint64_t area_id = 0;
  for (uint64_t step = 1; step <= 3; ++step) {
    const std::vector<uint16_t> g = Bf16Grads(kLen0);
    auto stream = transport_->OpenStep(kJob, 0, 0, kLen0, step);
    ASSERT_TRUE(stream.ok()) << stream.status();
    uint16_t* area = static_cast<uint16_t*>((*stream)->GradientArea());  // (kLen0,)
    ASSERT_NE(area, nullptr);
    // After committed steps the range keeps its memory (a trainer's page lock stays valid).
    const uint64_t id = (*stream)->GradientAreaId();
    EXPECT_NE(id, 0u);
    if (step > 1) EXPECT_EQ(id, area_id) << "step " << step;
    area_id = id;
    // Three pieces, the last first, as backward finishes buckets; the middle one is sent from
    // the trainer's own buffer (a copy into the same area) to mix both ways in one step.
    const int64_t cut[4] = {0, 20000, 50000, kLen0};
    for (int k = 2; k >= 0; --k) {
      const int64_t n = cut[k + 1] - cut[k];
      absl::Status s;
      if (k == 1) {
        s = (*stream)->SendGradients(cut[k], g.data() + cut[k], DType::kBf16, n);
      } else {
        std::memcpy(area + cut[k], g.data() + cut[k], n * 2);
        s = (*stream)->SendGradients(cut[k], area + cut[k], DType::kBf16, n);
      }
      ASSERT_TRUE(s.ok()) << s;
    }
    std::vector<uint16_t> p(kLen0, kSentinel);
    int64_t next = kLen0;
    absl::StatusOr<v1::StepResult> r;
    if (in_place) {
      next = 0;
      r = (*stream)->CommitInPlace(kLr, 1.0f, false,
                                   [&](int64_t begin, int64_t n, const void* params) {
                                     EXPECT_EQ(begin, next) << "waves out of order";
                                     ASSERT_LE(begin + n, kLen0);
                                     std::memcpy(p.data() + begin, params, n * 2);
                                     next = begin + n;
                                   });
    } else {
      r = (*stream)->Commit(kLr, 1.0f, false, p.data());
    }
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->applied());
    EXPECT_EQ(r->adam_step(), step);
    EXPECT_EQ(next, kLen0);
    EXPECT_EQ((*stream)->GradientArea(), nullptr) << "the area outlived the step";
    const std::vector<uint16_t> e = Reference(0, g.data(), DType::kBf16);
    EXPECT_TRUE(p == e) << FirstDifference(p, e) << " step " << step << " seed " << seed_;
  }
  EXPECT_TRUE(MasterWeights() == ref_p_) << "seed " << seed_;
}

// A step abandoned after sending from the gradient area: the next step's area holds what the
// trainer writes then, whatever gRPC still sends of the abandoned one, and the bits are the
// kernel's.
TEST_P(StepExchangeTest, GradientAreaAfterAnAbandonedStep) {
  if (GetParam().kind != "shm" && GetParam().kind != "grpc") {
    auto stream = transport_->OpenStep(kJob, 0, 0, kLen0, 1);
    ASSERT_TRUE(stream.ok()) << stream.status();
    EXPECT_EQ((*stream)->GradientArea(), nullptr);
    return;
  }
  {
    auto stream = transport_->OpenStep(kJob, 0, 0, kLen0, 1);
    ASSERT_TRUE(stream.ok()) << stream.status();
    uint16_t* area = static_cast<uint16_t*>((*stream)->GradientArea());  // (kLen0,)
    ASSERT_NE(area, nullptr);
    const std::vector<uint16_t> stale = Bf16Grads(kLen0);
    std::memcpy(area, stale.data(), kLen0 * 2);
    ASSERT_TRUE((*stream)->SendGradients(0, area, DType::kBf16, kLen0).ok());
    (*stream)->Abandon();
  }
  const std::vector<uint16_t> g = Bf16Grads(kLen0);
  std::vector<uint16_t> p(kLen0, kSentinel);
  absl::StatusOr<v1::StepResult> r;
  // The shard lets go of the abandoned stream's range once it sees the cancel: until then the
  // range is ABORTED (another stream open), and the step is tried again.
  for (int attempt = 0; attempt < 100; ++attempt) {
    auto stream = transport_->OpenStep(kJob, 0, 0, kLen0, 1);
    ASSERT_TRUE(stream.ok()) << stream.status();
    uint16_t* area = static_cast<uint16_t*>((*stream)->GradientArea());  // (kLen0,)
    ASSERT_NE(area, nullptr);
    std::memcpy(area, g.data(), kLen0 * 2);
    absl::Status sent = (*stream)->SendGradients(0, area, DType::kBf16, kLen0);
    r = sent.ok() ? (*stream)->Commit(kLr, 1.0f, false, p.data()) : sent;
    if (r.status().code() != absl::StatusCode::kAborted) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->adam_step(), 1u);
  const std::vector<uint16_t> e = Reference(0, g.data(), DType::kBf16);
  EXPECT_TRUE(p == e) << FirstDifference(p, e) << " seed " << seed_;
}

TEST_P(StepExchangeTest, SkippedStepSendsNoParametersAndCounts) {
  const std::vector<float> before = MasterWeights();
  std::vector<uint16_t> g = Bf16Grads(kLen0), p;
  g[5] = 0x7f80;  // bf16 +inf: the trainer saw the overflow and skips
  auto r = Exchange(0, 1, Whole(0, g.data()), &p, /*skip=*/true);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->skipped());
  EXPECT_FALSE(r->applied());
  EXPECT_EQ(r->adam_step(), 0u);
  EXPECT_EQ(r->skipped_steps(), 1u);
  EXPECT_TRUE(p == std::vector<uint16_t>(kLen0, kSentinel)) << "parameters written on a skip";
  EXPECT_TRUE(MasterWeights() == before);
  const v1::RangeStatus status = RangeStatusOf(0);
  EXPECT_EQ(status.completed_step(), 1u);
  EXPECT_EQ(status.adam_step(), 0u);
  EXPECT_EQ(status.skipped_steps(), 1u);
  // A skip with no gradients at all is fine too.
  r = Exchange(0, 2, {}, &p, /*skip=*/true);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->skipped_steps(), 2u);
  // The next applied step is Adam's first: the skips did not advance bias correction.
  std::vector<uint16_t> g3 = Bf16Grads(kLen0);
  r = Exchange(0, 3, Whole(0, g3.data()), &p);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->adam_step(), 1u);
  const std::vector<uint16_t> e = Reference(0, g3.data(), DType::kBf16);
  EXPECT_TRUE(p == e) << FirstDifference(p, e) << " seed " << seed_;
}

// The process registry's value of counter `name` with label `transport` (or none), 0 if absent.
double CounterValue(const std::string& name, const std::string& transport = "") {
  for (const prometheus::MetricFamily& f : MetricsRegistry().Collect()) {
    if (f.name != name) continue;
    for (const prometheus::ClientMetric& m : f.metric) {
      bool match = transport.empty();
      for (const auto& label : m.label) {
        if (label.name == "transport" && label.value == transport) match = true;
      }
      if (match) return m.counter.value;
    }
  }
  return 0;
}

TEST_P(StepExchangeTest, MetricsCountAcceptedBytesAndSteps) {
  ServerMetrics::Get().Enable();
  const std::string plane = GetParam().kind;
  const double received = CounterValue("offload_optimizer_receive_bytes_total", plane);
  const double sent = CounterValue("offload_optimizer_transmit_bytes_total", plane);
  const double updated = CounterValue("offload_optimizer_params_updated_total");
  std::vector<uint16_t> g = Bf16Grads(kLen0), p;
  // A chunk the shard refuses (outside the range) is not counted as received.
  std::vector<uint16_t> extra(16);
  auto bad = Exchange(0, 1, {Chunk{kTotal, 16, extra.data(), DType::kBf16}}, &p);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(CounterValue("offload_optimizer_receive_bytes_total", plane), received);
  auto r = Exchange(0, 1, Whole(0, g.data()), &p);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(CounterValue("offload_optimizer_receive_bytes_total", plane) - received, kLen0 * 2);
  EXPECT_EQ(CounterValue("offload_optimizer_transmit_bytes_total", plane) - sent, kLen0 * 2);
  EXPECT_EQ(CounterValue("offload_optimizer_params_updated_total") - updated, kLen0);
}

TEST_P(StepExchangeTest, AccumulatedMicroBatchesEqualTheSummedGradients) {
  std::vector<uint16_t> a = Bf16Grads(kLen0), b = Bf16Grads(kLen0), c = Bf16Grads(kLen0), p;
  // Micro-batch 1 in two chunks, then micro-batches 2 and 3 with accumulate, cut differently.
  std::vector<Chunk> chunks = {
      Chunk{30000, kLen0 - 30000, a.data() + 30000, DType::kBf16},
      Chunk{0, 30000, a.data(), DType::kBf16},
      Chunk{0, 50000, b.data(), DType::kBf16, true},
      Chunk{50000, kLen0 - 50000, b.data() + 50000, DType::kBf16, true},
      Chunk{0, kLen0, c.data(), DType::kBf16, true},
  };
  auto r = Exchange(0, 1, chunks, &p);
  ASSERT_TRUE(r.ok()) << r.status();
  // The shard sums in fp32 in arrival order per element: a + b + c.
  std::vector<float> sum(kLen0);
  for (int64_t i = 0; i < kLen0; ++i) {
    sum[i] = Bf16ToFloat(a[i]) + Bf16ToFloat(b[i]);
    sum[i] += Bf16ToFloat(c[i]);
  }
  std::vector<uint16_t> e = Reference(0, sum.data(), DType::kFp32);
  EXPECT_TRUE(p == e) << FirstDifference(p, e) << " seed " << seed_;
  EXPECT_TRUE(RangeStatusOf(0).has_accumulator());
  // The next step without micro-batches sees none of the accumulator's old contents.
  std::vector<uint16_t> g2 = Bf16Grads(kLen0);
  r = Exchange(0, 2, Whole(0, g2.data()), &p);
  ASSERT_TRUE(r.ok()) << r.status();
  e = Reference(0, g2.data(), DType::kBf16);
  EXPECT_TRUE(p == e) << FirstDifference(p, e) << " seed " << seed_;
  // And an accumulating step after that starts from zero again.
  std::vector<uint16_t> h = Bf16Grads(kLen0);
  r = Exchange(
      0, 3,
      {Chunk{0, kLen0, g2.data(), DType::kBf16}, Chunk{0, kLen0, h.data(), DType::kBf16, true}},
      &p);
  ASSERT_TRUE(r.ok()) << r.status();
  for (int64_t i = 0; i < kLen0; ++i) sum[i] = Bf16ToFloat(g2[i]) + Bf16ToFloat(h[i]);
  e = Reference(0, sum.data(), DType::kFp32);
  EXPECT_TRUE(p == e) << FirstDifference(p, e) << " seed " << seed_;
}

TEST_P(StepExchangeTest, AbandonedStepAppliesNothingAndTheSameStepWorks) {
  const std::string state = StateFingerprint();
  std::vector<uint16_t> g = Bf16Grads(kLen0), p;
  {
    auto stream = transport_->OpenStep(kJob, 0, 0, kLen0, 1);
    ASSERT_TRUE(stream.ok()) << stream.status();
    ASSERT_TRUE((*stream)->SendGradients(0, g.data(), DType::kBf16, kLen0 / 2).ok());
    (*stream)->Abandon();
    (*stream)->Abandon();  // twice is harmless
  }
  {
    // Dropped without Commit or Abandon: the destructor abandons.
    auto stream = transport_->OpenStep(kJob, 0, 0, kLen0, 1);
    const absl::Status sent =
        stream.ok() ? (*stream)->SendGradients(0, g.data(), DType::kBf16, kLen0) : stream.status();
    // The shard may not have seen the first abandon yet: ABORTED, at the open, or at the first
    // chunk where the plane learns of the refused open only then (gRPC buffers its writes).
    EXPECT_TRUE(sent.ok() || sent.code() == absl::StatusCode::kAborted) << sent;
  }
  EXPECT_EQ(StateFingerprint(), state);
  // The gradients of both abandoned attempts are gone: a fresh first half must not overlap.
  auto r = ExchangeAfterAbandon(0, 1, Whole(0, g.data()), &p);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->applied());
  EXPECT_EQ(r->adam_step(), 1u);
  const std::vector<uint16_t> e = Reference(0, g.data(), DType::kBf16);
  EXPECT_TRUE(p == e) << FirstDifference(p, e) << " seed " << seed_;
  // Abandoning right after the open works as well, mid-way through later steps.
  {
    auto stream = transport_->OpenStep(kJob, 0, 0, kLen0, 2);
    ASSERT_TRUE(stream.ok()) << stream.status();
    (*stream)->Abandon();
  }
  std::vector<uint16_t> g2 = Bf16Grads(kLen0);
  r = ExchangeAfterAbandon(0, 2, Whole(0, g2.data()), &p);
  ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<uint16_t> e2 = Reference(0, g2.data(), DType::kBf16);
  EXPECT_TRUE(p == e2) << FirstDifference(p, e2) << " seed " << seed_;
}

// The update during backward (StepStream::UpdateEarly), on every plane: the shard updates each
// half as soon as its gradients are in, and the commit gives the kernel's bits whether it keeps
// the early updates (the same arguments), redoes them (another lr) or undoes them (a skip); a
// refused update fails the step with nothing changed.
TEST_P(StepExchangeTest, UpdateDuringBackwardOnEveryPlane) {
  const int64_t half = 30011;
  struct Case {
    const char* what;
    double lr;  // the commit's; the early updates take kLr
    bool skip;
  };
  const std::vector<Case> cases = {{"the same arguments", kLr, false},
                                   {"another lr", 2 * kLr, false},
                                   {"a skip", kLr, true},
                                   {"the same arguments again", kLr, false}};
  uint64_t step = 1;
  for (const Case& c : cases) {
    const std::vector<uint16_t> g = Bf16Grads(kLen0);
    const std::vector<float> before = MasterWeights();
    auto stream = transport_->OpenStep(kJob, 0, 0, kLen0, step);
    ASSERT_TRUE(stream.ok()) << stream.status();
    // The second half first, as backward finishes it first; each updated once it is sent.
    ASSERT_TRUE((*stream)->SendGradients(half, g.data() + half, DType::kBf16, kLen0 - half).ok());
    absl::Status early = (*stream)->UpdateEarly(half, kLen0 - half, 0, kLr, 1.0f, {});
    ASSERT_TRUE(early.ok()) << early;
    ASSERT_TRUE((*stream)->SendGradients(0, g.data(), DType::kBf16, half).ok());
    early = (*stream)->UpdateEarly(0, half, 0, kLr, 1.0f, {});
    ASSERT_TRUE(early.ok()) << early;
    std::vector<uint16_t> p(kLen0, kSentinel);
    auto r = (*stream)->Commit(c.lr, 1.0f, c.skip, p.data());
    ASSERT_TRUE(r.ok()) << c.what << ": " << r.status();
    const bool stood = !c.skip && c.lr == kLr;
    EXPECT_EQ(r->early_updated(), stood ? static_cast<uint64_t>(kLen0) : 0u) << c.what;
    EXPECT_EQ(r->early_rolled_back(), !stood ? static_cast<uint64_t>(kLen0) : 0u) << c.what;
    if (c.skip) {
      EXPECT_TRUE(r->skipped()) << c.what;
      EXPECT_TRUE(MasterWeights() == before) << c.what << " seed " << seed_;
    } else {
      const std::vector<uint16_t> e = Reference(0, g.data(), DType::kBf16, c.lr);
      EXPECT_TRUE(p == e) << c.what << ": " << FirstDifference(p, e) << " seed " << seed_;
      EXPECT_EQ(r->adam_step(), ref_adam_step_[0]) << c.what;
    }
    ++step;
  }
  EXPECT_TRUE(MasterWeights() == ref_p_) << "seed " << seed_;

  // Refused by the shard (an element without its gradient yet): the step fails at the next call
  // with the shard's error, and nothing changed.
  const std::string state = StateFingerprint();
  const std::vector<uint16_t> g = Bf16Grads(kLen0);
  auto stream = transport_->OpenStep(kJob, 0, 0, kLen0, step);
  ASSERT_TRUE(stream.ok()) << stream.status();
  ASSERT_TRUE((*stream)->SendGradients(0, g.data(), DType::kBf16, half).ok());
  ASSERT_TRUE((*stream)->UpdateEarly(0, half, 0, kLr, 1.0f, {}).ok());
  absl::Status refused = (*stream)->UpdateEarly(half, 10, 0, kLr, 1.0f, {});
  if (refused.ok()) {
    refused = (*stream)->SendGradients(half, g.data() + half, DType::kBf16, kLen0 - half);
  }
  if (refused.ok()) {
    std::vector<uint16_t> p(kLen0);
    refused = (*stream)->Commit(kLr, 1.0f, false, p.data()).status();
  }
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "no gradient for element")) << refused;
  stream->reset();
  EXPECT_EQ(StateFingerprint(), state);
  // And the same step then works, early updates and all.
  std::vector<uint16_t> p;
  auto r = ExchangeAfterAbandon(0, step, Whole(0, g.data()), &p);
  ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<uint16_t> e = Reference(0, g.data(), DType::kBf16);
  EXPECT_TRUE(p == e) << FirstDifference(p, e) << " seed " << seed_;
}

TEST_P(StepExchangeTest, TwoRangesCommittedConcurrently) {
  constexpr int kSteps = 3;
  // grads[r][s]: range r's gradients of step s + 1, made up front (the rng is not shared).
  std::vector<uint16_t> grads[2][kSteps];
  for (int r = 0; r < 2; ++r) {
    for (int s = 0; s < kSteps; ++s) grads[r][s] = Bf16Grads(kLengths[r]);
  }
  std::vector<uint16_t> got[2][kSteps];
  absl::Status errors[2];
  auto run = [&](int r) {
    for (int s = 0; s < kSteps; ++s) {
      // Halves in reverse, so both streams interleave chunks as well as commits.
      const int64_t half = kLengths[r] / 2;
      const uint16_t* g = grads[r][s].data();
      std::vector<Chunk> chunks = {
          Chunk{kOffsets[r] + half, kLengths[r] - half, g + half, DType::kBf16},
          Chunk{kOffsets[r], half, g, DType::kBf16}};
      auto result = Exchange(r, s + 1, chunks, &got[r][s]);
      if (!result.ok()) {
        errors[r] = result.status();
        return;
      }
      if (!result->applied() || result->adam_step() != static_cast<uint64_t>(s + 1)) {
        errors[r] = absl::InternalError(result->DebugString());
        return;
      }
    }
  };
  std::thread t0(run, 0), t1(run, 1);
  t0.join();
  t1.join();
  ASSERT_TRUE(errors[0].ok()) << errors[0];
  ASSERT_TRUE(errors[1].ok()) << errors[1];
  for (int r = 0; r < 2; ++r) {
    for (int s = 0; s < kSteps; ++s) {
      const std::vector<uint16_t> e = Reference(r, grads[r][s].data(), DType::kBf16);
      EXPECT_TRUE(got[r][s] == e) << "range " << r << " step " << s + 1 << ": "
                                  << FirstDifference(got[r][s], e) << " seed " << seed_;
    }
  }
  EXPECT_TRUE(MasterWeights() == ref_p_) << "seed " << seed_;
}

std::vector<Plane> Planes() {
  std::vector<Plane> planes = {{"grpc", "grpc", ""}, {"shm", "shm", ""}};
#ifdef OFFLOAD_HAVE_UCX
  // UCX picks its transports from UCX_TLS: TCP (the cross-host path without RDMA) and shared
  // memory (sm,self: the same-host path), each forced, plus whatever UCX picks itself.
  planes.push_back({"ucx", "ucx", ""});
  planes.push_back({"ucx_tcp", "ucx", "tcp"});
  planes.push_back({"ucx_sm", "ucx", "sm,self"});
#endif
  return planes;
}

// The step timeout bounds waits on the shard, not the stream: a trainer that pauses inside a step
// (a debugger between backward and step, a slow collective) longer than the timeout still
// commits, on every plane.
TEST_P(StepExchangeTest, ATrainerPausedInsideAStepIsNotAStalledShard) {
  Connect(absl::Milliseconds(500));
  ASSERT_FALSE(HasFatalFailure());
  std::vector<uint16_t> p;
  for (uint64_t step = 1; step <= StepTimeout::kMinSteps; ++step) {
    std::vector<uint16_t> g = Bf16Grads(kLen0);
    auto result = Exchange(0, step, Whole(0, g.data()), &p);
    ASSERT_TRUE(result.ok()) << result.status();
    Reference(0, g.data(), DType::kBf16);
  }
  ASSERT_EQ(client_->step_timeout().Get(), absl::Milliseconds(500));
  const uint64_t step = StepTimeout::kMinSteps + 1;
  std::vector<uint16_t> g = Bf16Grads(kLen0);
  auto stream = transport_->OpenStep(kJob, 0, kOffsets[0], kLengths[0], step);
  ASSERT_TRUE(stream.ok()) << stream.status();
  ASSERT_TRUE((*stream)->SendGradients(0, g.data(), DType::kBf16, kLen0).ok());
  absl::SleepFor(absl::Milliseconds(1500));  // 3x the timeout
  p.assign(kLen0, kSentinel);
  auto result = (*stream)->Commit(kLr, 1.0f, false, p.data());
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->adam_step(), step);
  const std::vector<uint16_t> e = Reference(0, g.data(), DType::kBf16);
  EXPECT_TRUE(p == e) << FirstDifference(p, e) << " seed " << seed_;
}

INSTANTIATE_TEST_SUITE_P(Planes, StepExchangeTest, ::testing::ValuesIn(Planes()),
                         [](const ::testing::TestParamInfo<Plane>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace offload
