// What the trainer tests share: a tiny model on the bundled text, optimizer shards served over
// gRPC in this process, and a training run that returns weights, master weights and losses.
#ifndef OFFLOAD_GPU_TRAINER_TRAIN_TRAINER_TEST_UTIL_H_
#define OFFLOAD_GPU_TRAINER_TRAIN_TRAINER_TEST_UTIL_H_

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "base/testing/test_util.h"
#include "base/thread_pool.h"
#include "cpu_optimizer_server/grpc/optimizer_service.h"
#include "cpu_optimizer_server/shard/shard_store.h"
#include "gpu_trainer/collectives/gloo_test_util.h"
#include "gpu_trainer/train/trainer.h"
#include "gtest/gtest.h"
#include "model_spec/param_layout.h"
#include "model_spec/partition.h"
#include "optimizer_client/backends/local_shards_test_util.h"
#include "optimizer_client/backends/optimizer_backend.h"
#include "optimizer_client/backends/remote_optimizer.h"

namespace offload {

inline TrainerOptions TinyOptions() {
  TrainerOptions o;
  o.model = Gpt2Config{256, 32, 2, 2, 32};
  o.data = SourceDir() + "/data/tinyshakespeare.txt";
  o.batch = 4;
  o.seq_len = 32;
  o.steps = 40;
  o.seed = 7;
  o.param_dtype = DType::kFp16;
  o.adam.set_kind(v1::OPTIMIZER_KIND_ADAMW);
  o.adam.set_lr(3e-3f);
  o.adam.set_beta1(0.9f);
  o.adam.set_beta2(0.95f);
  o.adam.set_eps(1e-8f);
  o.adam.set_weight_decay(0.01f);
  o.schedule.set_max_lr(3e-3f);
  o.schedule.set_min_lr(3e-4f);
  o.schedule.set_warmup_steps(5);
  o.schedule.set_total_steps(40);
  o.grad_clip = 1.0f;
  return o;
}

// 14 bf16 steps with the delayed update after a warm-up of 4.
inline TrainerOptions DpuOptions() {
  TrainerOptions o = TinyOptions();
  o.param_dtype = DType::kBf16;
  o.steps = 14;
  o.schedule.set_total_steps(14);
  o.dpu = true;
  o.dpu_warmup_steps = 4;
  return o;
}

// A CPU runner that behaves toward the trainer as the CUDA backend does: its gradients are 16-bit
// where they are computed (no BackwardFp32), so W > 1 ranks take the host-staged path, each range
// handed over once it is final.
class SixteenBitGradientsRunner final : public ModelRunner {
 public:
  explicit SixteenBitGradientsRunner(std::unique_ptr<ModelRunner> cpu) : cpu_(std::move(cpu)) {}
  int64_t num_params() const override { return cpu_->num_params(); }
  std::string Describe() const override { return "16-bit gradients: " + cpu_->Describe(); }
  absl::Status SetWeights(const uint16_t* w16) override { return cpu_->SetWeights(w16); }
  absl::StatusOr<float> Forward(const int32_t* inputs, const int32_t* targets, int B,
                                int T) override {
    return cpu_->Forward(inputs, targets, B, T);
  }
  // Each range is written to grads16 and then, as the CUDA backend's copy would land it, to its
  // place where `place` names one.
  absl::StatusOr<GradStats> Backward(
      float loss_scale, uint16_t* grads16,
      const std::function<void(int64_t offset, int64_t n)>& on_ready,
      const std::function<uint16_t*(int64_t offset, int64_t n)>& place) override {
    return cpu_->Backward(loss_scale, grads16, [&](int64_t offset, int64_t n) {
      if (uint16_t* p = place ? place(offset, n) : nullptr; p != nullptr) {
        std::memcpy(p, grads16 + offset, static_cast<size_t>(n) * 2);
      }
      if (on_ready) on_ready(offset, n);
    });
  }
  bool writes_gradient_places() const override { return true; }
  absl::Status Logits(int t, float* logits) override { return cpu_->Logits(t, logits); }
  DeviceMemory Memory() const override { return cpu_->Memory(); }

 private:
  std::unique_ptr<ModelRunner> cpu_;
};

// `o` with SixteenBitGradientsRunner as its compute device.
inline TrainerOptions WithSixteenBitGradients(TrainerOptions o) {
  o.make_runner = [o](int max_batch) -> absl::StatusOr<std::unique_ptr<ModelRunner>> {
    absl::StatusOr<std::unique_ptr<ModelRunner>> cpu = CreateCpuModelRunner(
        o.model, max_batch, o.seq_len, o.kernels, o.param_dtype, o.activation_checkpointing);
    if (!cpu.ok()) return cpu.status();
    return std::unique_ptr<ModelRunner>(new SixteenBitGradientsRunner(*std::move(cpu)));
  };
  return o;
}

inline v1::PartitionMap MapFor(const TrainerOptions& o, int shards, int ranks = 1) {
  absl::StatusOr<v1::PartitionMap> map = MakePartitionMap(Gpt2NumParams(o.model), ranks, shards);
  EXPECT_TRUE(map.ok()) << map.status();
  return *map;
}

struct RunResult {
  std::vector<uint16_t> weights16;    // (padded,) stage 2; empty under ZeRO-3
  std::vector<uint16_t> partition16;  // (P,) this rank's 16-bit weights, every stage
  int64_t weight_peak_bytes = 0;      // most 16-bit weight bytes held at once after Start
  std::vector<float> master;          // (padded,) fp32 master weights from the shards
  std::vector<float> losses;
  int64_t in_place_elements = 0;  // gradients sent from the data plane's own memory (zero-copy)
};

// Trains `steps` more steps on `backend` (creating the trainer, starting or resuming) and
// returns the weights, the shard master weights and the losses.
inline RunResult Train(const TrainerOptions& o, OptimizerBackend* backend, uint64_t steps,
                       bool checkpoint_at_end = false) {
  RunResult r;
  absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(o, backend);
  EXPECT_TRUE(trainer.ok()) << trainer.status();
  if (!trainer.ok()) return r;
  absl::StatusOr<std::string> started = (*trainer)->Start();
  EXPECT_TRUE(started.ok()) << started.status();
  (*trainer)->weight_meter().ResetPeak();
  for (uint64_t i = 0; i < steps; ++i) {
    absl::StatusOr<StepReport> report = (*trainer)->Step();
    EXPECT_TRUE(report.ok()) << report.status();
    if (!report.ok()) return r;
    r.losses.push_back(report->loss);
  }
  if (checkpoint_at_end) {
    absl::StatusOr<std::string> dir = (*trainer)->SaveCheckpoint(0.0f);
    EXPECT_TRUE(dir.ok()) << dir.status();
  }
  EXPECT_TRUE((*trainer)->Flush().ok());  // a DPU commit may still run
  r.weights16 = (*trainer)->weights16();
  r.partition16.assign((*trainer)->partition16(),
                       (*trainer)->partition16() + backend->partition_length());
  r.weight_peak_bytes = (*trainer)->weight_meter().peak();
  r.in_place_elements = backend->in_place_elements();
  const v1::PartitionMap& map = backend->partition();
  r.master.assign(map.padded_length(), 0.0f);
  EXPECT_TRUE(backend->ReadMasterWeights(r.master.data()).ok());
  return r;
}

inline bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// Runs `ranks` ranks of one job on `shards`, each on its own thread with its own collectives
// (over one in-memory store), shard clients and options (`o` with this rank's collectives):
// body(rank, options, backend).
inline void RunRanks(const TrainerOptions& o, const LocalShards& shards, int ranks,
                     absl::Duration timeout,
                     const std::function<void(int, const TrainerOptions&, OptimizerBackend*)>& body,
                     TransportChoice transport = TransportChoice::kGrpc) {
  RunOnGlooRanks(ranks, timeout, [&](int r, Collectives& collectives) {
    auto backend =
        RemoteOptimizer::Connect(MapFor(o, static_cast<int>(shards.addresses().size()), ranks),
                                 shards.addresses(), ClientOptions{}, transport);
    ASSERT_TRUE(backend.ok()) << backend.status();
    ASSERT_TRUE((*backend)->SetRank(r).ok());
    TrainerOptions mine = o;
    mine.collectives = &collectives;
    body(r, mine, backend->get());
  });
}

// `steps` steps of every rank; returns every rank's result.
inline std::vector<RunResult> TrainRanks(const TrainerOptions& o, const LocalShards& shards,
                                         int ranks, uint64_t steps, bool checkpoint_at_end = false,
                                         TransportChoice transport = TransportChoice::kGrpc) {
  std::vector<RunResult> results(ranks);
  RunRanks(
      o, shards, ranks, absl::Seconds(60),
      [&](int r, const TrainerOptions& mine, OptimizerBackend* backend) {
        results[r] = Train(mine, backend, steps, checkpoint_at_end);
      },
      transport);
  return results;
}

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_TRAIN_TRAINER_TEST_UTIL_H_
