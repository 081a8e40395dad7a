// ZeRO-3 through the trainer: W ranks (threads of this process meeting over an in-memory Gloo
// store) against optimizer shards over gRPC on loopback. Stage 3 trains exactly what stage 2
// trains, for 1, 2 and 3 ranks, fp16 and bf16, with and without micro-batches, and with a
// one-layer window; checkpoints cross between the stages bit for bit; and a rank holds at most
// its partition plus the gather window of 16-bit weights.
#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gloo/rendezvous/hash_store.h"
#include "gpu_trainer/collectives/gloo_collectives.h"
#include "gpu_trainer/train/trainer.h"
#include "gpu_trainer/train/trainer_test_util.h"
#include "gtest/gtest.h"
#include "model_spec/param_layout.h"
#include "model_spec/partition.h"
#include "optimizer_client/backends/remote_optimizer.h"
#include "optimizer_client/checkpoint/checkpoint_dir.h"

namespace offload {
namespace {

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A batch that splits over 1, 2 and 3 ranks with 1 or 2 micro-batches, and a model of 3 blocks so
// that a window of 2 leaves one block out.
TrainerOptions Options(int zero_stage) {
  TrainerOptions o = TinyOptions();
  o.model = Gpt2Config{256, 32, 3, 2, 32};
  o.batch = 12;
  o.seq_len = 16;
  o.steps = 4;
  o.schedule.set_total_steps(4);
  o.zero_stage = zero_stage;
  return o;
}

void ExpectSameRun(const std::vector<RunResult>& stage2, const std::vector<RunResult>& stage3,
                   const std::string& what) {
  ASSERT_EQ(stage2.size(), stage3.size());
  for (size_t r = 0; r < stage2.size(); ++r) {
    EXPECT_EQ(stage2[r].losses, stage3[r].losses) << what << " rank " << r;
    EXPECT_EQ(stage2[r].partition16, stage3[r].partition16) << what << " rank " << r;
    EXPECT_TRUE(stage3[r].weights16.empty()) << what << ": stage 3 holds the whole model";
  }
  EXPECT_TRUE(SameBits(stage2[0].master, stage3[0].master)) << what;
}

struct Case {
  int ranks;
  DType dtype;
  int micro_batches;
};

class Stage3Test : public ::testing::TestWithParam<Case> {};

TEST_P(Stage3Test, TrainsExactlyWhatStage2Trains) {
  const Case c = GetParam();
  const std::string what = absl::StrCat(c.ranks, " ranks, ", DTypeName(c.dtype), ", ",
                                        c.micro_batches, " micro-batches");
  TrainerOptions o2 = Options(2), o3 = Options(3);
  for (TrainerOptions* o : {&o2, &o3}) {
    o->param_dtype = c.dtype;
    o->micro_batches = c.micro_batches;
  }
  LocalShards shards2(2), shards3(2);
  const std::vector<RunResult> stage2 = TrainRanks(o2, shards2, c.ranks, o2.steps);
  const std::vector<RunResult> stage3 = TrainRanks(o3, shards3, c.ranks, o3.steps);
  ExpectSameRun(stage2, stage3, what);
  for (const RunResult& r : stage2) EXPECT_FALSE(r.losses.empty()) << what;
}

INSTANTIATE_TEST_SUITE_P(Runs, Stage3Test,
                         ::testing::Values(Case{1, DType::kFp16, 1}, Case{2, DType::kFp16, 1},
                                           Case{3, DType::kFp16, 1}, Case{1, DType::kBf16, 2},
                                           Case{2, DType::kBf16, 2}, Case{3, DType::kBf16, 2},
                                           Case{2, DType::kFp16, 2}, Case{3, DType::kBf16, 1}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return absl::StrCat("W", info.param.ranks, "_",
                                               DTypeName(info.param.dtype), "_micro",
                                               info.param.micro_batches);
                         });

// One rank with a window of one block: the 16-bit model stays in host memory and the compute
// device holds one block at a time, and still the same bits.
TEST(Stage3, OneRankWithAOneLayerWindow) {
  TrainerOptions o2 = Options(2), o3 = Options(3);
  o3.param_window_layers = 1;
  LocalShards shards2(1), shards3(1);
  ExpectSameRun(TrainRanks(o2, shards2, 1, o2.steps), TrainRanks(o3, shards3, 1, o3.steps),
                "window 1");
}

// The 16-bit weight bytes a rank holds over its steps and a checkpoint, counted allocation by
// allocation: at most its partition (2N/W, padded) plus the window (the embeddings and ln_f, the
// stated constant, and param_window_layers blocks), where stage 2 holds the whole model.
TEST(Stage3, ARankHoldsItsPartitionAndTheWindow) {
  TempDir dir2, dir3;
  TrainerOptions o2 = Options(2), o3 = Options(3);
  // Deeper, so that the blocks, not the embeddings, are most of the model, as in GPT-2.
  o2.model = o3.model = Gpt2Config{256, 32, 8, 2, 32};
  o2.checkpoint_dir = dir2.path();
  o3.checkpoint_dir = dir3.path();
  const int W = 3;
  LocalShards shards2(1), shards3(1);
  const std::vector<RunResult> stage2 = TrainRanks(o2, shards2, W, 2, /*checkpoint_at_end=*/true);
  const std::vector<RunResult> stage3 = TrainRanks(o3, shards3, W, 2, /*checkpoint_at_end=*/true);
  const Gpt2Config& m = o3.model;
  const int64_t N = Gpt2NumParams(m);
  // The map pads the model to whole blocks of kPartitionBlock per rank.
  const int64_t P = (N + W * kPartitionBlock - 1) / (W * kPartitionBlock) * kPartitionBlock;
  const int64_t window = Gpt2UnitRange(m, 0).size() + Gpt2UnitRange(m, m.num_layers + 1).size() +
                         o3.param_window_layers * Gpt2UnitRange(m, 1).size();
  for (int r = 0; r < W; ++r) {
    EXPECT_EQ(stage3[r].weight_peak_bytes,
              2 * (static_cast<int64_t>(stage3[r].partition16.size()) + window))
        << "rank " << r;
    EXPECT_EQ(static_cast<int64_t>(stage3[r].partition16.size()), P) << "rank " << r;
    EXPECT_GE(stage2[r].weight_peak_bytes, 2 * N) << "rank " << r;
    EXPECT_LT(stage3[r].weight_peak_bytes, stage2[r].weight_peak_bytes) << "rank " << r;
  }
  std::printf(
      "16-bit weight bytes per rank, W=%d, N=%lld: stage 2 %lld, stage 3 %lld "
      "(partition %lld + window %lld)\n",
      W, static_cast<long long>(N), static_cast<long long>(stage2[0].weight_peak_bytes),
      static_cast<long long>(stage3[0].weight_peak_bytes),
      static_cast<long long>(2 * stage3[0].partition16.size()), static_cast<long long>(2 * window));
  // Written from the shards' master weights under stage 3, the model file has the same bytes.
  const std::string name = "/model.safetensors";
  absl::StatusOr<std::string> latest2 = LatestCheckpointDir(dir2.path());
  absl::StatusOr<std::string> latest3 = LatestCheckpointDir(dir3.path());
  ASSERT_TRUE(latest2.ok() && latest3.ok());
  EXPECT_EQ(ReadBytes(*latest2 + name), ReadBytes(*latest3 + name));
}

// The trace shows each layer's gather on the gather thread while the trainer computes.
TEST(Stage3, GathersOverlapCompute) {
  PhaseTrace trace;
  TrainerOptions o = Options(3);
  o.model = Gpt2Config{256, 32, 6, 2, 64};
  o.trace = &trace;
  LocalShards shards(1);
  TrainRanks(o, shards, 1, 2);
  int gathers = 0, overlapping = 0;
  const std::vector<PhaseTrace::Event> events = trace.Events();
  for (const PhaseTrace::Event& g : events) {
    if (g.name != "gather") continue;
    ++gathers;
    for (const PhaseTrace::Event& c : events) {
      if ((c.name == "forward" || c.name == "backward") && c.thread != g.thread &&
          g.begin_us < c.end_us && c.begin_us < g.end_us) {
        ++overlapping;
        break;
      }
    }
  }
  // Per step: every unit in forward; in backward the blocks the window no longer holds.
  EXPECT_GE(gathers, 2 * (o.model.num_layers + 2));
  // All but the first gather of each pass are prefetches, in flight while a layer computes.
  EXPECT_GE(overlapping, gathers / 2) << gathers << " gathers";
}

// A checkpoint of either stage resumes under the other, bit for bit.
TEST(Stage3, CheckpointsCrossBetweenTheStages) {
  const int W = 2;
  TrainerOptions o2 = Options(2);
  o2.steps = 6;
  o2.schedule.set_total_steps(6);
  LocalShards straight_shards(2);
  const std::vector<RunResult> straight = TrainRanks(o2, straight_shards, W, 6);
  for (int first : {2, 3}) {
    TempDir dir;
    TrainerOptions a = o2, b = o2;
    a.zero_stage = first;
    b.zero_stage = 5 - first;
    a.checkpoint_dir = b.checkpoint_dir = dir.path();
    a.resume = b.resume = true;
    LocalShards shards(2);
    TrainRanks(a, shards, W, 3, /*checkpoint_at_end=*/true);
    const std::vector<RunResult> resumed = TrainRanks(b, shards, W, 3);
    for (int r = 0; r < W; ++r) {
      EXPECT_EQ(std::vector<float>(straight[r].losses.begin() + 3, straight[r].losses.end()),
                resumed[r].losses)
          << "stage " << first << " to " << 5 - first << ", rank " << r;
      EXPECT_EQ(straight[r].partition16, resumed[r].partition16) << "rank " << r;
    }
    EXPECT_TRUE(SameBits(straight[0].master, resumed[0].master))
        << "stage " << first << " to " << 5 - first;
  }
}

// Ranks that would gather differently refuse to start together, before any gather.
TEST(Stage3, RanksThatDisagreeOnTheStageOrWindowRefuseTogether) {
  for (const bool window_differs : {false, true}) {
    LocalShards shards(1);
    std::vector<absl::Status> started(2);
    RunRanks(Options(3), shards, 2, absl::Seconds(20),
             [&](int r, const TrainerOptions& mine, OptimizerBackend* backend) {
               TrainerOptions o = mine;
               o.zero_stage = window_differs || r == 0 ? 3 : 2;
               if (window_differs && r == 1) o.param_window_layers = 1;
               absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(o, backend);
               ASSERT_TRUE(t.ok()) << t.status();
               started[r] = (*t)->Start().status();
             });
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(started[r].code(), absl::StatusCode::kFailedPrecondition) << started[r];
      EXPECT_NE(started[r].message().find("zero_stage="), std::string::npos) << started[r];
    }
  }
}

TEST(Stage3, RefusesWhatItCannotDo) {
  LocalShards shards(1);
  auto backend =
      RemoteOptimizer::Connect(MapFor(Options(3), 1, 1), shards.addresses(), ClientOptions{});
  ASSERT_TRUE(backend.ok());
  TrainerOptions o = Options(3);
  o.dpu = true;
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(o, backend->get());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("--dpu"), std::string::npos) << t.status();
  o = Options(3);
  o.param_window_layers = 0;
  EXPECT_EQ(Trainer::Create(o, backend->get()).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options(4);
  EXPECT_EQ(Trainer::Create(o, backend->get()).status().code(), absl::StatusCode::kInvalidArgument);
  // One CUDA rank runs stage 3 through its device window: no refusal of the stage; what stops it
  // here is only a missing GPU (or a build without the CUDA backend).
  o = Options(3);
  o.device = ComputeDevice::kCuda;
  t = Trainer::Create(o, backend->get());
  if (!t.ok()) {
    EXPECT_EQ(t.status().message().find("zero_stage"), std::string::npos) << t.status();
  }
}

}  // namespace
}  // namespace offload
