// The trainer on the CUDA backend, offloading to the CPU optimizer (in process): it trains, its
// losses track the CPU backend's on the same data and weights within half-precision tolerance,
// and it samples text. Skips without a GPU; without the CUDA backend the trainer says so.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "gpu_trainer/cuda/runtime/cuda_test_util.h"
#include "gpu_trainer/offload/inprocess_optimizer.h"
#include "gpu_trainer/train/trainer.h"
#include "gtest/gtest.h"
#include "model_spec/param_layout.h"
#include "model_spec/partition.h"

namespace offload {
namespace {

TrainerOptions TinyOptions(ComputeDevice device) {
  TrainerOptions o;
  o.device = device;
  o.model = Gpt2Config{256, 64, 2, 2, 64};
  o.data = std::string(OFFLOAD_SOURCE_DIR) + "/data/tinyshakespeare.txt";
  o.batch = 4;
  o.seq_len = 64;
  o.steps = 60;
  o.seed = 7;
  o.param_dtype = DType::kBf16;
  o.adam.set_kind(v1::OPTIMIZER_KIND_ADAMW);
  o.adam.set_lr(3e-3f);
  o.adam.set_beta1(0.9f);
  o.adam.set_beta2(0.95f);
  o.adam.set_eps(1e-8f);
  o.schedule.set_max_lr(3e-3f);
  o.schedule.set_min_lr(3e-4f);
  o.schedule.set_warmup_steps(5);
  o.schedule.set_total_steps(60);
  o.pinned_staging_bytes = 1 << 20;
  return o;
}

std::vector<float> TrainLosses(const TrainerOptions& o, int steps, std::string* sample) {
  absl::StatusOr<v1::PartitionMap> map = MakePartitionMap(Gpt2NumParams(o.model), 1, 2);
  EXPECT_TRUE(map.ok());
  InProcessOptimizer backend(*map, 2, BestSimdPath());
  auto trainer = Trainer::Create(o, &backend);
  EXPECT_TRUE(trainer.ok()) << trainer.status();
  if (!trainer.ok()) return {};
  EXPECT_TRUE((*trainer)->Start().ok());
  std::vector<float> losses;
  for (int i = 0; i < steps; ++i) {
    auto report = (*trainer)->Step();
    EXPECT_TRUE(report.ok()) << report.status();
    if (!report.ok()) break;
    EXPECT_FALSE(report->skipped);
    losses.push_back(report->loss);
  }
  if (sample != nullptr) {
    auto text = (*trainer)->Sample("ROMEO:", 32, 0.8f, 1);
    EXPECT_TRUE(text.ok()) << text.status();
    if (text.ok()) *sample = *text;
  }
  return losses;
}

TEST(TrainerCuda, TrainsAndTracksTheCpuBackend) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  std::string sample;
  const std::vector<float> gpu = TrainLosses(TinyOptions(ComputeDevice::kCuda), 60, &sample);
  const std::vector<float> cpu = TrainLosses(TinyOptions(ComputeDevice::kCpu), 60, nullptr);
  ASSERT_EQ(gpu.size(), 60u);
  ASSERT_EQ(cpu.size(), 60u);
  // Same weights, same batches: the first loss differs only by bf16 activations.
  EXPECT_NEAR(gpu[0], cpu[0], 0.03f * cpu[0]);
  // Afterwards the runs drift apart as any two precisions do, but both learn alike.
  EXPECT_LT(gpu.back(), gpu.front() - 1.0f);
  EXPECT_NEAR(gpu.back(), cpu.back(), 0.15f * cpu.back());
  EXPECT_EQ(sample.size(), 32u);
}

}  // namespace
}  // namespace offload
