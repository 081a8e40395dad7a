// One trainer rank: forward and backward on the 16-bit weights the optimizer sends, gradients
// streamed to the optimizer bucket by bucket while backward goes on, loss scaling, clipping, the
// lr schedule, gradient accumulation, the delayed parameter update, evaluation, text sampling,
// and checkpoints that resume bit for bit (ARCHITECTURE.md sections 1 and 6). With W ranks (ZeRO-2)
// each rank computes on 1/W of the batch, gradients are reduce-scattered so each rank offloads only
// its partition, and the updated partitions are all-gathered back (ARCHITECTURE.md section 3).
// With ZeRO-3 a rank keeps only its partition of the 16-bit weights, and each layer's weights are
// gathered just before they are used (gpu_trainer/zero3/param_gatherer.h).
#ifndef OFFLOAD_GPU_TRAINER_TRAIN_TRAINER_H_
#define OFFLOAD_GPU_TRAINER_TRAIN_TRAINER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/dtype.h"
#include "gpu_trainer/collectives/collectives.h"
#include "gpu_trainer/data/batch_sampler.h"
#include "gpu_trainer/data/token_dataset.h"
#include "gpu_trainer/model/gpt2.h"
#include "gpu_trainer/train/gradient_reducer.h"
#include "gpu_trainer/train/model_runner.h"
#include "gpu_trainer/zero3/param_gatherer.h"
#include "gpu_trainer/zero3/weight_meter.h"
#include "offload/v1/checkpoint.pb.h"
#include "optimizer_client/backends/optimizer_backend.h"
#include "optimizer_client/precision/loss_scaler.h"
#include "optimizer_client/precision/step_policy.h"
#include "optimizer_client/sender/phase_trace.h"
#include "optimizer_client/step_engine/step_engine.h"

namespace offload {

enum class ComputeDevice { kCpu, kCuda };

// How W > 1 ranks reduce-scatter gradients and all-gather weights (ARCHITECTURE.md section 1).
// kGloo: over TCP from host memory; the CUDA backend's ranks stage their 16-bit gradients on the
// host first (host-staged), and may share a GPU. kNccl: on the GPU, one GPU per rank.
enum class CollectiveLibrary { kGloo, kNccl };

struct TrainerOptions {
  Gpt2Config model;
  // kCpu: fp32 compute on the 16-bit weights (CPU backend). kCuda: the CUDA backend computes in
  // param_dtype itself (16-bit weights, activations and gradients, fp32 accumulation).
  ComputeDevice device = ComputeDevice::kCpu;
  CpuKernelSet kernels = CpuKernelSet::kFast;  // CPU backend only
  int cuda_device = 0;
  int64_t pinned_staging_bytes = int64_t{64} << 20;  // CUDA: pinned host memory per direction
  // Keep only each block's input in forward and recompute the block in backward: activations of
  // one layer instead of L, for a second forward's compute. The same bits on the CPU backend.
  bool activation_checkpointing = false;
  // The host memory this rank may take; Create refuses a job that needs more, naming the model,
  // the need and the limit, before it allocates. 0: what the host has available (MemAvailable).
  int64_t host_memory_limit_bytes = 0;
  std::string data;  // text file, llm.c .bin file, or a glob of .bin files
  double val_fraction = 0.1;
  // Sequences per step over all ranks and micro-batches: each rank computes micro_batches
  // micro-batches of batch / (world_size * micro_batches) sequences, accumulated on the shards.
  int batch = 16;
  int micro_batches = 1;
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
  // Delayed parameter update (ARCHITECTURE.md section 1, the paper's section 5): after
  // dpu_warmup_steps synchronous steps, step s's optimizer update runs on the shards while this
  // trainer already computes step s+1 on the weights of step s-1: exactly one step stale, never
  // anything between.
  bool dpu = false;
  uint64_t dpu_warmup_steps = 20;
  // ZeRO stage (ARCHITECTURE.md section 3). 2: every rank holds the whole 16-bit model and
  // all-gathers the updated partitions after each step. 3: a rank holds only its partition, and
  // each layer's weights are all-gathered from their owners just before use and freed after, with
  // the next layer's gather in flight (CPU backend; not with dpu). Both train the same bits.
  int zero_stage = 2;
  // Stage 3: how many blocks' weights the compute device holds at once (>= 1). With 1 nothing
  // overlaps: the next block is gathered only once the current one is done.
  int param_window_layers = 2;
  PhaseTrace* trace = nullptr;  // per-phase timestamps of every step, if given (not owned)
  // This rank's collectives (not owned); null: a single rank. The backend's rank must match.
  Collectives* collectives = nullptr;
  // What `collectives` is, for a check that the compute device can use it (nccl needs cuda).
  CollectiveLibrary collective_library = CollectiveLibrary::kGloo;
  // Tests: builds the compute device for this rank's batch instead of `device` (a CPU runner
  // made to behave as another backend does, such as one without fp32 gradients). Null: `device`.
  std::function<absl::StatusOr<std::unique_ptr<ModelRunner>>(int max_batch)> make_runner;
  // fp32 elements per gradient bucket, the unit of the reduce-scatter and of its overlap with
  // backward.
  int64_t bucket_elements = int64_t{1} << 21;
  // How long the other ranks wait for rank 0 to load the job's state onto the shards, or to
  // write a checkpoint, which can take far longer than a collective.
  absl::Duration lead_timeout = absl::Minutes(30);
};

// "gloo" or "nccl" (the flag and the job spec's parallel.collectives); "" is gloo.
absl::StatusOr<CollectiveLibrary> ParseCollectiveLibrary(absl::string_view name);
// Whether `library` can serve ranks computing on `device`: nccl reduces GPU buffers, so it needs
// cuda (W NCCL ranks reduce-scatter the gradient buckets and gather the weights on their GPUs).
absl::Status CheckCollectiveLibrary(ComputeDevice device, CollectiveLibrary library);

struct StepReport {
  uint64_t step = 0;
  float loss = 0;
  float lr = 0;
  float loss_scale = 1;
  double grad_norm = 0;
  bool skipped = false;  // overflow: the shards dropped the gradients
  bool stop = false;     // some rank asked to stop (RequestStop): every rank stops after this step
  // The newest checkpoint request (RequestCheckpoint) any rank has seen, the same on every rank:
  // when it is new to the caller, every rank checkpoints after this step.
  uint64_t checkpoint_request = 0;
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

  // Every method below but Sample and the accessors is collective: all ranks call it in the
  // same order.
  absl::StatusOr<StepReport> Step();
  // Asks every rank to stop: the next Step's report says stop on all of them. Signal-safe to set
  // from another thread.
  void RequestStop() { stop_requested_.store(true); }
  // Asks every rank to checkpoint after the next step; `request` numbers the request (the job
  // controller's counter), so each is carried out once. Only one rank (rank 0) should ask.
  void RequestCheckpoint(uint64_t request) { checkpoint_requested_.store(request); }
  // With DPU, waits for the update still running on the shards (before the job is dropped or
  // the process ends); a no-op otherwise.
  absl::Status Flush();
  // Mean loss over `batches` fixed validation batches.
  absl::StatusOr<float> Evaluate(int batches);
  // `n` tokens sampled after `prompt` (bytes for the byte-level vocab), seeded. Collective under
  // ZeRO-3, where every forward gathers the layers from all ranks; any rank's own call otherwise.
  absl::StatusOr<std::string> Sample(const std::string& prompt, int n, float temperature,
                                     uint64_t seed);
  // Rank 0 writes it; returns the checkpoint directory written.
  absl::StatusOr<std::string> SaveCheckpoint(float val_loss);

  int rank() const { return collectives_->rank(); }
  int world_size() const { return collectives_->world_size(); }
  uint64_t step() const { return step_; }
  uint64_t total_steps() const { return options_.steps; }
  int64_t tokens_per_step() const { return int64_t{options_.batch} * options_.seq_len; }
  const Gpt2Config& model_config() const { return options_.model; }
  int64_t num_params() const { return runner_->num_params(); }
  std::string DescribeBackend() const { return runner_->Describe(); }
  // One line on what this rank holds of the 16-bit weights and how they move.
  std::string DescribeZero() const;
  ModelRunner::DeviceMemory DeviceMemory() const {
    ModelRunner::DeviceMemory m = runner_->Memory();
    if (gatherer_ != nullptr) m.used_bytes += gatherer_->window_bytes32();
    if (reducer_ != nullptr) m.used_bytes += reducer_->held_bytes();
    return m;
  }
  const DynamicLossScaler& loss_scaler() const { return engine_->policy().scaler(); }
  // The 16-bit weights the trainer computes with, (padded_length,); empty under ZeRO-3. NCCL ranks
  // gather the others' partitions on the device: their host copy is whole after a checkpoint.
  const std::vector<uint16_t>& weights16() const { return weights16_; }
  // This rank's 16-bit weights that every stage holds, (partition_length,).
  const uint16_t* partition16() const {
    return options_.zero_stage == 3 ? partition16_.data()
                                    : weights16_.data() + backend_->partition_offset();
  }
  // The 16-bit weight bytes this rank holds: every such buffer is counted.
  WeightMeter& weight_meter() { return weight_meter_; }
  int zero_stage() const { return options_.zero_stage; }
  // The host bytes this rank allocates for the job (the fp32 state lives on the shards), as
  // Create checked them against TrainerOptions::host_memory_limit_bytes.
  struct HostMemory {
    int64_t weights = 0, gradients = 0, activations = 0;
    int64_t total() const { return weights + gradients + activations; }
  };
  HostMemory PlanHostMemory() const;

 private:
  Trainer(const TrainerOptions& options, OptimizerBackend* backend);
  absl::Status Init();
  // Hands weights16_ to the model if the optimizer changed them since.
  absl::Status ApplyWeights();
  // Rank 0's part of Start: the job on the shards and its state, its 16-bit weights into
  // weights16 (padded,). Sets `how`.
  absl::Status LoadJob(const std::string* checkpoint, const v1::CheckpointManifest* manifest,
                       uint16_t* weights16, std::string* how);
  // ZeRO-3: rank 0's whole weights full (padded,) (null on the other ranks) dealt out, each rank
  // keeping its partition.
  absl::Status DealPartitions(const uint16_t* full);
  absl::Status CheckHostMemory() const;
  // After rank 0 failed a step every rank waited for (loading the job, writing a checkpoint): its
  // error, broadcast so that every rank's error says why, not only rank 0's log. Collective.
  std::string ShareLeadError(const absl::Status& status);
  // ZeRO-3: the gathers' communicator and the gatherer, the model's source of weights. Collective.
  absl::Status StartGatherer();
  bool stage3() const { return options_.zero_stage == 3; }
  // What a step reports, from its loss and the policy's decision on its (global) gradients.
  StepReport Report(uint64_t step, float loss, const StepDecision& decision) const;
  // Micro-batch k of the step: forward, backward, and its gradients on their way (sent when
  // `send`, else kept in the engine's buffer for OpenDelayedStep). Adds its loss to *loss_sum;
  // *stats := its gradients' statistics, as the rounding pass measured them.
  absl::Status MicroBatch(uint64_t step, int k, float loss_scale, bool send, double* loss_sum,
                          GradStats* stats);
  // Backward's 16-bit gradients [offset, offset + n) of this rank's partition are final, at
  // `rounded` (n,) (null: in the engine's buffer).
  void OnGradientsRounded(int64_t offset, int64_t n, const uint16_t* rounded = nullptr);
  // DPU: once the first micro-batch is done, waits for the commit of the previous step and opens
  // this one with that micro-batch's gradients.
  absl::Status OpenDelayedStep(uint64_t step);
  // buffer (padded,): every rank's partition gathered from its owner.
  absl::Status AllGatherPartitions(uint16_t* buffer);
  // Waits for the commit running in the background (DPU), if any; its weights are gathered into
  // next_weights16_, where they wait until the next step takes them. Collective.
  absl::Status FinishPendingCommit();
  v1::CheckpointManifest Manifest() const;

  TrainerOptions options_;
  OptimizerBackend* const backend_;
  std::unique_ptr<ModelRunner> runner_;
  std::unique_ptr<TokenDataset> dataset_;
  TokenSpan train_, val_;
  std::unique_ptr<BatchSampler> sampler_;
  std::unique_ptr<Collectives> single_rank_;  // when options_.collectives is null
  Collectives* collectives_ = nullptr;
  int local_batch_ = 0;  // sequences per micro-batch on this rank
  // The rank's step on the optimizer: gradients out, the policy (skip, clip, loss scale), the
  // micro-batch sum, the commit and DPU's background commit; its buffer is where gradients land.
  std::unique_ptr<StepEngine> engine_;
  std::unique_ptr<GradientReducer> reducer_;  // backends with fp32 gradients; after engine_
  std::atomic<bool> send_gradients_{false};   // read by the reducer thread
  std::atomic<bool> stop_requested_{false};
  std::atomic<uint64_t> checkpoint_requested_{0};

  // One allocation each, sized once: the flat buffers of the step.
  WeightMeter weight_meter_;             // counts weights16_, next_weights16_, partition16_...
  std::vector<uint16_t> weights16_;      // (padded,) stage 2: what the optimizer sent
  Weights16 partition16_;                // (P,) stage 3: this rank's part of it
  std::atomic<uint64_t> trace_step_{0};  // the step a gather is recorded under
  std::unique_ptr<Collectives> param_collectives_;  // stage 3: the gathers' own communicator
  std::unique_ptr<ParamGatherer> gatherer_;         // stage 3: the layers' weights on demand
  std::vector<int32_t> inputs_, targets_;           // (B, T) the global batch
  bool params_stale_ = true;
  // DPU: the weights the commit of the last step writes while the next step computes (or a resume
  // restored), which the step after that computes with.
  std::vector<uint16_t> next_weights16_;  // (padded,)
  bool next_ready_ = false;
  // Host memory offered to the runner for page-locking (the CUDA backend's direct transfers): the
  // buffers above (area id 0) and the data plane's gradient areas (shared memory, where the CUDA
  // backend's gradients land without a host copy), each seen once per area id, locked or refused
  // (then left to the pinned ring); the locked ones are unlocked before any of them goes away.
  struct HostArea {
    void* p = nullptr;
    uint64_t id = 0;
    bool locked = false;
  };
  std::vector<HostArea> host_areas_;
  // Registers each gradient area of this rank's open slices not seen yet; one whose memory
  // changed under the same address (another area id) is unlocked first, then locked again.
  void RegisterGradientAreas();
  uint64_t step_ = 0;
  StepCounters counters_;
  float last_loss_ = 0;
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_TRAIN_TRAINER_H_
