// One trainer rank on the CPU backend: forward and backward with fp32 compute on the 16-bit
// weights the optimizer sends, gradients rounded to 16 bits and streamed to the optimizer layer
// by layer while backward goes on, loss scaling, clipping, the lr schedule, evaluation, text
// sampling, and checkpoints that resume bit for bit (DESIGN sections 1 and 6).
#ifndef OFFLOAD_GPU_TRAINER_TRAIN_TRAINER_H_
#define OFFLOAD_GPU_TRAINER_TRAIN_TRAINER_H_

#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cpu_optimizer_server/dtype.h"
#include "gpu_trainer/data/batch_sampler.h"
#include "gpu_trainer/data/token_dataset.h"
#include "gpu_trainer/model/gpt2.h"
#include "gpu_trainer/train/gradient_sender.h"
#include "gpu_trainer/train/loss_scaler.h"
#include "gpu_trainer/train/model_runner.h"
#include "gpu_trainer/train/optimizer_backend.h"
#include "gpu_trainer/train/phase_trace.h"
#include "offload/v1/checkpoint.pb.h"

namespace offload {

enum class ComputeDevice { kCpu, kCuda };

struct TrainerOptions {
  Gpt2Config model;
  // kCpu: fp32 compute on the 16-bit weights (CPU backend). kCuda: the CUDA backend computes in
  // param_dtype itself (16-bit weights, activations and gradients, fp32 accumulation).
  ComputeDevice device = ComputeDevice::kCpu;
  CpuKernelSet kernels = CpuKernelSet::kFast;  // CPU backend only
  int cuda_device = 0;
  int64_t pinned_staging_bytes = int64_t{64} << 20;  // CUDA: pinned host memory per direction
  std::string data;  // text file, llm.c .bin file, or a glob of .bin files
  double val_fraction = 0.1;
  int batch = 16;
  int seq_len = 128;
  uint64_t steps = 1000;
  uint64_t seed = 1337;
  DType param_dtype = DType::kFp16;
  v1::AdamConfig adam;
  v1::LrSchedule schedule;
  float grad_clip = 1.0f;  // max global norm; <= 0 disables clipping
  LossScalerOptions loss_scaler;
  std::string job_id = "offload-demo";
  std::string init_from;  // GPT-2 safetensors weights to start from instead of random init
  std::string checkpoint_dir;
  bool resume = false;  // continue from checkpoint_dir's latest checkpoint if there is one
  int keep_checkpoints = 2;
  // Delayed parameter update (DESIGN section 1, the paper's section 5): after dpu_warmup_steps
  // synchronous steps, step s's optimizer update runs on the shards while this trainer already
  // computes step s+1 on the weights of step s-1: exactly one step stale, never anything between.
  bool dpu = false;
  uint64_t dpu_warmup_steps = 20;
  PhaseTrace* trace = nullptr;  // per-phase timestamps of every step, if given (not owned)
};

struct StepReport {
  uint64_t step = 0;
  float loss = 0;
  float lr = 0;
  float loss_scale = 1;
  double grad_norm = 0;
  bool skipped = false;  // overflow: the shards dropped the gradients
};

class Trainer {
 public:
  // Loads the data and builds the model; `backend` must hold the partition map of this model.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const TrainerOptions& options,
                                                         OptimizerBackend* backend);
  ~Trainer();

  // Creates the job on the shards and loads its state: the latest checkpoint when resuming and
  // one exists, else GPT-2 weights from init_from, else the seeded GPT-2 initialisation.
  // Returns a line that says which.
  absl::StatusOr<std::string> Start();

  absl::StatusOr<StepReport> Step();
  // With DPU, waits for the update still running on the shards (before the job is dropped or
  // the process ends); a no-op otherwise.
  absl::Status Flush();
  // Mean loss over `batches` fixed validation batches.
  absl::StatusOr<float> Evaluate(int batches);
  // `n` tokens sampled after `prompt` (bytes for the byte-level vocab), seeded.
  absl::StatusOr<std::string> Sample(const std::string& prompt, int n, float temperature,
                                     uint64_t seed);
  // Returns the checkpoint directory written.
  absl::StatusOr<std::string> SaveCheckpoint(float val_loss);

  uint64_t step() const { return step_; }
  uint64_t total_steps() const { return options_.steps; }
  int64_t tokens_per_step() const { return int64_t{options_.batch} * options_.seq_len; }
  const Gpt2Config& model_config() const { return options_.model; }
  int64_t num_params() const { return runner_->num_params(); }
  std::string DescribeBackend() const { return runner_->Describe(); }
  const DynamicLossScaler& loss_scaler() const { return scaler_; }
  // The 16-bit weights the trainer computes with, (padded_length,).
  const std::vector<uint16_t>& weights16() const { return weights16_; }

 private:
  Trainer(const TrainerOptions& options, OptimizerBackend* backend);
  absl::Status Init();
  // Hands weights16_ to the model if the optimizer changed them since.
  absl::Status ApplyWeights();
  // What a step reports, from its loss and the statistics of its gradients.
  StepReport Report(uint64_t step, float loss, float loss_scale, const GradStats& stats) const;
  float GradMultiplier(const StepReport& report) const;
  // The start of every step: the latest weights applied, the next batch, its forward.
  absl::StatusOr<float> ForwardNextBatch(uint64_t step);
  // The synchronous step, and the delayed one (DPU).
  absl::StatusOr<StepReport> SyncStep(uint64_t step);
  absl::StatusOr<StepReport> DelayedStep(uint64_t step);
  // Waits for the commit running in the background (DPU), if any; its weights wait in
  // next_weights16_ until the next step takes them.
  absl::Status FinishPendingCommit();
  v1::CheckpointManifest Manifest() const;

  TrainerOptions options_;
  OptimizerBackend* const backend_;
  std::unique_ptr<ModelRunner> runner_;
  std::unique_ptr<TokenDataset> dataset_;
  TokenSpan train_, val_;
  std::unique_ptr<BatchSampler> sampler_;
  DynamicLossScaler scaler_;
  std::unique_ptr<GradientSender> sender_;

  // One allocation each, sized once: the flat buffers of the step.
  std::vector<uint16_t> weights16_;        // (padded,) what the optimizer sent
  std::vector<uint16_t> grads16_;          // (padded,) what leaves; the padding stays 0
  std::vector<int32_t> inputs_, targets_;  // (B, T)
  bool params_stale_ = true;
  // DPU: the commit of the last step, running while the next step computes, and the weights it
  // writes (or a resume restored), which the step after that computes with.
  std::future<absl::StatusOr<StepCounters>> pending_commit_;
  bool pending_skipped_ = false;
  std::vector<uint16_t> next_weights16_;  // (padded,)
  bool next_ready_ = false;
  uint64_t step_ = 0;
  StepCounters counters_;
  float last_loss_ = 0;
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_TRAIN_TRAINER_H_
