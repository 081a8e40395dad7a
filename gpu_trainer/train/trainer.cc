#include "gpu_trainer/train/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/host_memory.h"
#include "base/splitmix64.h"
#include "base/status_macros.h"
#include "gpu_trainer/collectives/local_collectives.h"
#include "model_spec/param_layout.h"
#include "optimizer_client/precision/lr_schedule.h"

namespace offload {

absl::StatusOr<CollectiveLibrary> ParseCollectiveLibrary(absl::string_view name) {
  if (name.empty() || name == "gloo") return CollectiveLibrary::kGloo;
  if (name == "nccl") return CollectiveLibrary::kNccl;
  return absl::InvalidArgumentError(
      absl::StrCat("--collectives=", name, " is not one of gloo, nccl"));
}

absl::Status CheckCollectiveLibrary(ComputeDevice device, CollectiveLibrary library) {
  if (library != CollectiveLibrary::kNccl || device == ComputeDevice::kCuda) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      "--collectives=nccl needs --device=cuda: NCCL reduces GPU buffers; the CPU backend's "
      "ranks meet over gloo");
}

Trainer::Trainer(const TrainerOptions& options, OptimizerBackend* backend)
    : options_(options), backend_(backend) {}

Trainer::~Trainer() {
  // Local only: a collective here could wait on ranks that are gone. The reducer hands the
  // engine gradients, so it goes first; the engine waits for a delayed commit and ends an open
  // step.
  reducer_.reset();
  engine_.reset();
  if (runner_ != nullptr) {
    for (const HostArea& a : host_areas_) {
      if (a.locked) runner_->UnregisterHostMemory(a.p).IgnoreError();
    }
  }
}

void Trainer::RegisterGradientAreas() {
  for (const v1::ShardSlice& slice : backend_->partition().slices()) {
    const auto offset = static_cast<int64_t>(slice.offset());
    const auto n = static_cast<int64_t>(slice.length());
    if (offset < backend_->partition_offset() ||
        offset + n > backend_->partition_offset() + backend_->partition_length()) {
      continue;  // another rank's
    }
    uint16_t* area = backend_->GradientPlace(offset, n);
    const uint64_t id = backend_->GradientPlaceId(offset, n);
    if (area == nullptr || id == 0) continue;
    auto same = std::find_if(host_areas_.begin(), host_areas_.end(),
                             [&](const HostArea& a) { return a.p == area; });
    if (same != host_areas_.end()) {
      if (same->id == id) continue;  // seen: locked, or refused and left to the ring
      // Other memory at the same address (the segment mapped again): the old lock goes first.
      if (same->locked) runner_->UnregisterHostMemory(same->p).IgnoreError();
      host_areas_.erase(same);
    }
    // A refusal leaves the ring to carry the gradients; nothing else changes.
    host_areas_.push_back(HostArea{area, id, runner_->RegisterHostMemory(area, n * 2).ok()});
  }
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const TrainerOptions& options,
                                                         OptimizerBackend* backend) {
  std::unique_ptr<Trainer> trainer(new Trainer(options, backend));
  OFFLOAD_RETURN_IF_ERROR(trainer->Init());
  return trainer;
}

absl::Status Trainer::Init() {
  const TrainerOptions& o = options_;
  if (o.param_dtype != DType::kFp16 && o.param_dtype != DType::kBf16) {
    return absl::InvalidArgumentError("dtype must be fp16 or bf16");
  }
  if (o.batch < 1 || o.seq_len < 1 || o.seq_len > o.model.context_length) {
    return absl::InvalidArgumentError(absl::StrCat("batch must be >= 1 and seq_len in [1, context ",
                                                   o.model.context_length, "], got batch ", o.batch,
                                                   " seq_len ", o.seq_len));
  }
  if (o.steps < 1) return absl::InvalidArgumentError("steps must be >= 1");
  // Refused here, not first at the first checkpoint's commit.
  if (o.keep_checkpoints < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("keep_checkpoints must be >= 1, got ", o.keep_checkpoints));
  }
  if (o.collectives == nullptr) {
    single_rank_ = SingleRankCollectives();
    collectives_ = single_rank_.get();
  } else {
    collectives_ = o.collectives;
  }
  const int W = collectives_->world_size();
  if (o.micro_batches < 1 || o.batch % (W * o.micro_batches) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch ", o.batch, " must split evenly over ", W, " rank(s) x ",
                     o.micro_batches, " micro-batch(es) (micro_batches must be >= 1)"));
  }
  local_batch_ = o.batch / (W * o.micro_batches);
  if (o.bucket_elements < 1) return absl::InvalidArgumentError("bucket_elements must be >= 1");
  if (o.dpu && o.dpu_warmup_steps > (uint64_t{1} << 40)) {
    return absl::InvalidArgumentError("dpu_warmup_steps is out of range");
  }
  if (o.zero_stage != 2 && o.zero_stage != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("zero_stage must be 2 or 3, got ", o.zero_stage));
  }
  const bool stage3 = o.zero_stage == 3;
  if (stage3 && o.dpu) {
    return absl::InvalidArgumentError(
        "--dpu does not work with --zero_stage=3 yet: the delayed update computes each step on "
        "the weights of the commit before last while the last one lands, so every rank would "
        "hold two versions of its partition and gather layers from the older; use "
        "--zero_stage=2 with --dpu");
  }
  if (stage3 && o.device == ComputeDevice::kCuda && W > 1 &&
      o.collective_library != CollectiveLibrary::kNccl) {
    return absl::UnimplementedError(
        "--zero_stage=3 --device=cuda over more than one rank gathers each layer on the GPUs, "
        "which needs --collectives=nccl (one GPU per rank); with gloo use --zero_stage=2");
  }
  if (stage3 && o.param_window_layers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("param_window_layers must be >= 1, got ", o.param_window_layers));
  }
  OFFLOAD_RETURN_IF_ERROR(ValidateLrSchedule(o.schedule));
  OFFLOAD_ASSIGN_OR_RETURN(TokenDataset dataset, TokenDataset::Open(o.data));
  dataset_ = std::make_unique<TokenDataset>(std::move(dataset));
  if (dataset_->vocab_size() > o.model.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("the data ", o.data, " has tokens up to ",
                                                   dataset_->vocab_size() - 1, " but the model's ",
                                                   "vocabulary is ", o.model.vocab_size));
  }
  absl::StatusOr<std::pair<TokenSpan, TokenSpan>> split =
      SplitTrainVal(*dataset_, o.val_fraction, o.seq_len);
  if (!split.ok()) return split.status();
  train_ = split->first;
  val_ = split->second;
  sampler_ = std::make_unique<BatchSampler>(train_, o.batch, o.seq_len, o.seed);
  OFFLOAD_RETURN_IF_ERROR(CheckHostMemory());

  OFFLOAD_RETURN_IF_ERROR(CheckCollectiveLibrary(o.device, o.collective_library));
  // W NCCL ranks hand the model device pointers: gloo's collectives would read them as host memory.
  if (o.collective_library == CollectiveLibrary::kNccl && W > 1 &&
      !absl::StartsWith(collectives_->Describe(), "nccl")) {
    return absl::InvalidArgumentError(absl::StrCat("--collectives=nccl over ", W,
                                                   " ranks needs NCCL collectives, not ",
                                                   collectives_->Describe()));
  }
  const v1::PartitionMap& map = backend_->partition();
  // The CUDA backend's gradients leave by bucket (each unit its own with one rank, as the
  // reducer's), its ZeRO-3 weights come through a device window, and NCCL ranks reduce and gather
  // on the GPUs.
  CudaScaleOptions scale;
  scale.gradient_bucket_elements = W > 1 ? o.bucket_elements : 1;
  scale.param_window_layers = stage3 ? o.param_window_layers : 0;
  // With one rank the trainer's collectives are a local stand-in, not NCCL: nothing to reduce.
  scale.collectives =
      o.collective_library == CollectiveLibrary::kNccl && W > 1 ? collectives_ : nullptr;
  scale.padded_length = static_cast<int64_t>(map.padded_length());
  absl::StatusOr<std::unique_ptr<ModelRunner>> runner =
      o.make_runner ? o.make_runner(local_batch_)
      : o.device == ComputeDevice::kCuda
          ? CreateCudaModelRunner(o.model, local_batch_, o.seq_len, o.param_dtype, o.cuda_device,
                                  o.pinned_staging_bytes, o.activation_checkpointing,
                                  /*reference_attention=*/false, scale)
          : CreateCpuModelRunner(o.model, local_batch_, o.seq_len, o.kernels, o.param_dtype,
                                 o.activation_checkpointing);
  if (!runner.ok()) return runner.status();
  runner_ = std::move(*runner);
  if (static_cast<int>(map.world_size()) != W || backend_->rank() != collectives_->rank()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the partition map is for ", map.world_size(), " rank(s) and the backend steps for rank ",
        backend_->rank(), ", but this is rank ", collectives_->rank(), " of ", W));
  }
  if (static_cast<int64_t>(map.num_params()) != runner_->num_params()) {
    return absl::InvalidArgumentError(absl::StrCat("the partition map covers ", map.num_params(),
                                                   " parameters, the model has ",
                                                   runner_->num_params()));
  }
  if (stage3) {
    // The gatherer and its communicator come in Start, once the ranks agree on the settings.
    partition16_ = Weights16(backend_->partition_length(), &weight_meter_);
  } else {
    weights16_.assign(map.padded_length(), 0);
    if (o.dpu) next_weights16_.assign(map.padded_length(), 0);
    weight_meter_.Add(static_cast<int64_t>(weights16_.size() + next_weights16_.size()) * 2);
  }
  StepEngineOptions engine;
  engine.dtype = o.param_dtype;
  engine.policy =
      StepPolicyOptions{o.loss_scaler, o.param_dtype == DType::kFp16, o.grad_clip, o.micro_batches};
  engine.trace = o.trace;
  OFFLOAD_ASSIGN_OR_RETURN(engine_, StepEngine::Create(backend_, engine));
  inputs_.assign(static_cast<size_t>(o.batch) * o.seq_len, 0);
  targets_.assign(inputs_.size(), 0);
  // The CUDA backend uploads from and downloads into these directly once they are page-locked;
  // where that is refused, its pinned ring carries them as before.
  const int64_t padded = static_cast<int64_t>(map.padded_length());
  for (std::vector<uint16_t>* buffer : {&weights16_, &next_weights16_}) {
    if (buffer->empty()) continue;
    host_areas_.push_back(
        HostArea{buffer->data(), 0, runner_->RegisterHostMemory(buffer->data(), padded * 2).ok()});
  }
  host_areas_.push_back(
      HostArea{engine_->gradients16(), 0,
               runner_->RegisterHostMemory(engine_->gradients16(), padded * 2).ok()});
  // ZeRO-3 on the CUDA backend with one rank: the window is filled straight from the partition.
  if (stage3 && runner_->takes_partition_weights() && partition16_.data() != nullptr) {
    const int64_t bytes = backend_->partition_length() * 2;
    host_areas_.push_back(HostArea{partition16_.data(), 0,
                                   runner_->RegisterHostMemory(partition16_.data(), bytes).ok()});
  }
  runner_->set_trace(o.trace, [this] { return trace_step_.load(); });
  // fp32 gradients go to the reducer unit by unit; a backend with 16-bit ones and other ranks
  // to meet (the CUDA backend over gloo) hands it each range once it is on the host.
  if (runner_->has_fp32_gradients() || (W > 1 && !runner_->reduces_gradients())) {
    reducer_ = std::make_unique<GradientReducer>(
        collectives_, o.model, padded, engine_->gradients16(), o.param_dtype, o.bucket_elements,
        [this](int64_t offset, int64_t n, const uint16_t* rounded) {
          OnGradientsRounded(offset, n, rounded);
        },
        o.trace);
  }
  return absl::OkStatus();
}

absl::Status Trainer::ApplyWeights() {
  if (!params_stale_) return absl::OkStatus();
  if (runner_->takes_partition_weights()) {
    OFFLOAD_RETURN_IF_ERROR(runner_->SetPartitionWeights(
        stage3() ? partition16_.data() : weights16_.data() + backend_->partition_offset()));
  } else if (stage3()) {
    if (gatherer_ == nullptr) return absl::FailedPreconditionError("Start the trainer first");
    gatherer_->Invalidate();  // the layers gathered so far are of the old weights
  } else {
    OFFLOAD_RETURN_IF_ERROR(runner_->SetWeights(weights16_.data()));
  }
  params_stale_ = false;
  return absl::OkStatus();
}

absl::StatusOr<StepReport> Trainer::Step() {
  const TrainerOptions& o = options_;
  const uint64_t step = step_ + 1;
  // DPU: step s computes on weights16_, the result of the commit of step s - 2, while the commit
  // of step s - 1 runs on the shards; its step opens once that commit is done (a range takes one
  // step at a time), and its own commit then runs in the background.
  const bool delayed = o.dpu && step > o.dpu_warmup_steps;
  trace_step_.store(step);
  OFFLOAD_RETURN_IF_ERROR(ApplyWeights());
  sampler_->Next(inputs_.data(), targets_.data());
  const float scale = engine_->policy().loss_scale();
  if (!delayed) {
    OFFLOAD_RETURN_IF_ERROR(engine_->BeginStep(step));
  }
  double loss_sum = 0;
  for (int k = 0; k < o.micro_batches; ++k) {
    const bool open = !delayed || k > 0;
    GradStats stats;
    absl::Status s = MicroBatch(step, k, scale, open, &loss_sum, &stats);
    if (s.ok() && !open) s = OpenDelayedStep(step);
    if (!s.ok()) {
      // Before the delayed step opened the engine has no step of this one's (the previous
      // step's commit may still run): only a step this one opened is ended.
      engine_->AbortStep();
      return s;
    }
    engine_->AddStats(stats);
  }
  absl::StatusOr<GradStats> stats;
  {
    TracePhase phase(o.trace, "wait_offload", step);
    stats = engine_->Drain();  // a failed send ends the step
  }
  if (!stats.ok()) return stats.status();

  // One all-reduce agrees on what every rank needs: the global norm, whether any gradient
  // overflowed, the loss, whether to stop, and the checkpoint request (a sum is the one rank's
  // request; doubles hold request numbers exactly up to 2^53).
  double agreed[5] = {stats->sum_squares, stats->nonfinite ? 1.0 : 0.0, loss_sum / o.micro_batches,
                      stop_requested_.load() ? 1.0 : 0.0,
                      static_cast<double>(checkpoint_requested_.load())};
  if (absl::Status s = collectives_->AllReduce(agreed, 5, ReduceOp::kSum); !s.ok()) {
    engine_->AbortStep();
    return s;
  }
  const float loss = static_cast<float>(agreed[2] / world_size());
  const GradStats global{agreed[0], agreed[1] > 0};
  const float lr = ScheduledLr(o.schedule, step);
  StepDecision decision;
  if (delayed) {
    OFFLOAD_ASSIGN_OR_RETURN(
        decision, engine_->CommitAsync(global, /*max_grad_norm=*/-1, lr, {},
                                       next_weights16_.data() + backend_->partition_offset()));
  } else {
    // Nothing may read the partition while it changes.
    if (gatherer_ != nullptr) gatherer_->Invalidate();
    uint16_t* partition =
        stage3() ? partition16_.data() : weights16_.data() + backend_->partition_offset();
    OFFLOAD_ASSIGN_OR_RETURN(const CommitOutcome outcome,
                             engine_->Commit(global, /*max_grad_norm=*/-1, lr, {}, partition));
    decision = outcome.decision;
    counters_ = outcome.counters;
    if (!decision.skip) {
      // Stage 3 gathers each layer when it is next used instead.
      if (!stage3()) OFFLOAD_RETURN_IF_ERROR(AllGatherPartitions(weights16_.data()));
      params_stale_ = true;
    }
  }
  StepReport report = Report(step, loss, decision);
  report.stop = agreed[3] > 0;
  report.checkpoint_request = static_cast<uint64_t>(agreed[4]);
  step_ = step;
  last_loss_ = loss;
  return report;
}

Trainer::HostMemory Trainer::PlanHostMemory() const {
  const TrainerOptions& o = options_;
  const v1::PartitionMap& map = backend_->partition();
  const int64_t padded = static_cast<int64_t>(map.padded_length());
  const int64_t P = padded / std::max<int64_t>(1, map.world_size());
  const Gpt2Config& c = o.model;
  const int64_t n = Gpt2NumParams(c);
  const bool cpu = o.device == ComputeDevice::kCpu;
  HostMemory m;
  if (stage3()) {
    const int64_t window =
        Gpt2UnitRange(c, 0).size() + Gpt2UnitRange(c, c.num_layers + 1).size() +
        std::min(o.param_window_layers, c.num_layers) * Gpt2UnitRange(c, 1).size();
    // The partition, the window's 16-bit and fp32 copies (on the host for the CPU backend; the
    // CUDA backend's window is on the GPU), and rank 0's whole model at start-up.
    m.weights =
        2 * P + (cpu ? 6 * window : 0) + (rank() == 0 && map.world_size() > 1 ? 2 * padded : 0);
  } else {
    // The 16-bit copy (and DPU's second one), and the CPU backend's fp32 copy it computes with.
    m.weights = 2 * padded * (o.dpu ? 2 : 1) + (cpu ? 4 * n : 0);
  }
  // 16-bit gradients that leave, the fp32 buckets on their way where there is a reducer (the CPU
  // backend, and CUDA ranks staged on the host; the embeddings' bucket and two more, each under
  // bucket_elements plus a unit; never more than the whole buffer), and the micro-batch
  // accumulator.
  const int64_t block = Gpt2UnitRange(c, 1).size();
  const int64_t buckets32 =
      4 * std::min(padded, (o.bucket_elements + Gpt2UnitRange(c, 0).size()) +
                               2 * (o.bucket_elements + std::max(block, padded - n)));
  const bool reducer = cpu || map.world_size() > 1;
  m.gradients = 2 * padded + (reducer ? buckets32 : 0) + (o.micro_batches > 1 ? 4 * P : 0);
  m.activations = cpu ? Gpt2Cpu::ActivationBytes(c, local_batch_, o.seq_len,
                                                 o.activation_checkpointing)
                      : 2 * o.pinned_staging_bytes;  // CUDA: the pinned rings instead
  return m;
}

absl::Status Trainer::CheckHostMemory() const {
  const HostMemory need = PlanHostMemory();
  const int64_t limit = options_.host_memory_limit_bytes > 0 ? options_.host_memory_limit_bytes
                                                             : AvailableHostBytes();
  if (limit < 0 || need.total() <= limit) return absl::OkStatus();
  const Gpt2Config& c = options_.model;
  auto mib = [](int64_t bytes) { return absl::StrCat(bytes >> 20, " MiB"); };
  return absl::ResourceExhaustedError(absl::StrCat(
      "this trainer rank needs ", mib(need.total()), " of host memory for GPT-2 layers=",
      c.num_layers, " channels=", c.channels, " (", Gpt2NumParams(c), " parameters; weights ",
      mib(need.weights), ", gradients ", mib(need.gradients),
      options_.device == ComputeDevice::kCpu ? ", activations " : ", pinned staging ",
      mib(need.activations), ") but ", mib(limit),
      options_.host_memory_limit_bytes > 0 ? " are allowed" : " are available (MemAvailable)",
      ": lower --batch or --seq_len, add --micro_batches, use --activation_checkpointing or "
      "--zero_stage=3, or train a smaller model"));
}

std::string Trainer::DescribeZero() const {
  const int64_t padded = static_cast<int64_t>(backend_->partition().padded_length());
  if (!stage3()) {
    return absl::StrCat("ZeRO stage 2: every rank holds all ", padded,
                        " 16-bit weights; updated partitions are all-gathered after each step");
  }
  const Gpt2Config& c = options_.model;
  const int blocks = std::min(options_.param_window_layers, c.num_layers);
  const int64_t window = Gpt2UnitRange(c, 0).size() + Gpt2UnitRange(c, c.num_layers + 1).size() +
                         blocks * Gpt2UnitRange(c, 1).size();
  return absl::StrCat("ZeRO stage 3: this rank holds ", backend_->partition_length(), " of ",
                      padded, " 16-bit weights; each layer is gathered before use into a window ",
                      "of ", blocks, " block(s) plus the embeddings and ln_f (",
                      2 * (window + backend_->partition_length()),
                      " bytes of 16-bit weights in all)");
}

StepReport Trainer::Report(uint64_t step, float loss, const StepDecision& decision) const {
  StepReport report;
  report.step = step;
  report.loss = loss;
  report.loss_scale = decision.loss_scale;
  report.skipped = decision.skip;
  report.grad_norm = decision.grad_norm;
  report.lr = ScheduledLr(options_.schedule, step);
  return report;
}

absl::Status Trainer::MicroBatch(uint64_t step, int k, float loss_scale, bool send,
                                 double* loss_sum, GradStats* stats) {
  const TrainerOptions& o = options_;
  // Rank r's share of micro-batch k: rows [(k * W + r) * b, + b) of the global batch (B, T).
  const int64_t row = (static_cast<int64_t>(k) * world_size() + rank()) * local_batch_;
  const int32_t* inputs = inputs_.data() + row * o.seq_len;    // (b, T)
  const int32_t* targets = targets_.data() + row * o.seq_len;  // (b, T)
  absl::StatusOr<float> loss;
  {
    TracePhase phase(o.trace, "forward", step);
    loss = runner_->Forward(inputs, targets, local_batch_, o.seq_len);
  }
  if (!loss.ok()) return loss.status();
  *loss_sum += *loss;
  // The gradient buffer is about to be rewritten: the previous micro-batch must have left, and
  // the engine goes on summing micro-batches.
  if (k > 0) {
    OFFLOAD_RETURN_IF_ERROR(engine_->NextMicroBatch());
  }
  send_gradients_.store(send);
  uint16_t* const grads16 = engine_->gradients16();  // (padded,)
  absl::StatusOr<GradStats> backward;
  if (reducer_ != nullptr) {
    // Zero-copy where the data plane has a place for the gradients (shared memory): each share
    // is rounded straight into it and sent from there. Not with micro-batches, whose first one
    // is summed from where it was sent once the second begins, nor before the step is open
    // (DPU's first micro-batch).
    GradientReducer::PlaceFn place;
    if (send && o.micro_batches == 1) {
      place = [this](int64_t offset, int64_t n) { return engine_->GradientPlace(offset, n); };
    }
    reducer_->Begin(step, std::move(place));
    absl::Status s;
    {
      TracePhase phase(o.trace, "backward", step);
      if (runner_->has_fp32_gradients()) {
        s = runner_->BackwardFp32(loss_scale, *reducer_);
      } else {
        // Host-staged: each range is widened into the reducer as soon as it is on the host, and
        // the reducer rounds this rank's share over the same buffer once it is reduced.
        std::mutex error_mu;  // on_ready may run on the backend's copy thread
        absl::Status staged;
        s = runner_
                ->Backward(loss_scale, grads16,
                           [&](int64_t offset, int64_t n) {
                             absl::Status added =
                                 reducer_->AddGradients16(offset, n, grads16 + offset);
                             std::lock_guard<std::mutex> lock(error_mu);
                             staged.Update(added);
                           })
                .status();
        std::lock_guard<std::mutex> lock(error_mu);
        s.Update(staged);
      }
    }
    // Either way the reducer is idle after this, before anything else uses the collectives.
    if (!s.ok()) {
      reducer_->Abandon();
      return s;
    }
    TracePhase phase(o.trace, "wait_reduce", step);
    backward = reducer_->Finish();
  } else {
    // One rank, 16-bit gradients from the device: each range lands in its place on the data plane
    // where it has one (zero-copy shared memory) and is sent from there.
    const bool placed = send && o.micro_batches == 1 && runner_->writes_gradient_places();
    if (placed) RegisterGradientAreas();
    TracePhase phase(o.trace, "backward", step);
    // Where each range went (offset, place), recorded when the runner asks and read when the range
    // lands (on the copy thread), so the place is asked for once; Backward returns after the last.
    std::mutex placed_mu;
    std::vector<std::pair<int64_t, const uint16_t*>> placed_at;  // guarded by placed_mu
    std::function<uint16_t*(int64_t, int64_t)> place;
    if (placed) {
      place = [&](int64_t offset, int64_t n) {
        uint16_t* p = engine_->GradientPlace(offset, n);
        std::lock_guard<std::mutex> lock(placed_mu);
        placed_at.emplace_back(offset, p);
        return p;
      };
    }
    backward = runner_->Backward(
        loss_scale, grads16,
        [&](int64_t offset, int64_t n) {
          const uint16_t* from = nullptr;
          {
            std::lock_guard<std::mutex> lock(placed_mu);
            for (const auto& [at, p] : placed_at) {
              if (at == offset) from = p;
            }
          }
          OnGradientsRounded(offset, n, from);
        },
        place);
    // The padding above the parameters, where it is in this rank's partition: zeros.
    const int64_t lo = std::max(runner_->num_params(), backend_->partition_offset());
    const int64_t hi = backend_->partition_offset() + backend_->partition_length();
    if (backward.ok() && hi > lo) OnGradientsRounded(lo, hi - lo);
  }
  if (!backward.ok()) return backward.status();
  *stats = *backward;
  return absl::OkStatus();
}

void Trainer::OnGradientsRounded(int64_t offset, int64_t n, const uint16_t* rounded) {
  if (!send_gradients_.load()) return;
  engine_->Enqueue(offset, n, rounded != nullptr ? rounded : engine_->gradients16() + offset);
}

absl::Status Trainer::OpenDelayedStep(uint64_t step) {
  {
    TracePhase phase(options_.trace, "wait_commit", step);
    OFFLOAD_RETURN_IF_ERROR(FinishPendingCommit());
  }
  if (next_ready_) {
    // The previous step's update: the next step computes with it.
    weights16_.swap(next_weights16_);
    next_ready_ = false;
    params_stale_ = true;
  }
  OFFLOAD_RETURN_IF_ERROR(engine_->BeginStep(step));
  const int64_t offset = backend_->partition_offset();
  engine_->Enqueue(offset, backend_->partition_length(), engine_->gradients16() + offset);
  return absl::OkStatus();
}

absl::Status Trainer::AllGatherPartitions(uint16_t* buffer) {
  // NCCL ranks gather on the device when ApplyWeights hands the runner this rank's partition.
  if (runner_->takes_partition_weights()) return absl::OkStatus();
  TracePhase phase(options_.trace, "all_gather", step_ + 1);
  return collectives_->AllGather16(buffer + backend_->partition_offset(), buffer,
                                   backend_->partition_length());
}

absl::Status Trainer::FinishPendingCommit() {
  if (!engine_->commit_in_flight()) return absl::OkStatus();
  OFFLOAD_ASSIGN_OR_RETURN(const CommitOutcome outcome, engine_->WaitCommit());
  counters_ = outcome.counters;
  if (outcome.decision.skip) return absl::OkStatus();
  OFFLOAD_RETURN_IF_ERROR(AllGatherPartitions(next_weights16_.data()));
  next_ready_ = true;
  return absl::OkStatus();
}

absl::Status Trainer::Flush() {
  OFFLOAD_RETURN_IF_ERROR(FinishPendingCommit());
  // A skipped commit gathers nothing: the barrier is what says every rank's commit is done.
  return world_size() > 1 ? collectives_->Barrier() : absl::OkStatus();
}

absl::StatusOr<float> Trainer::Evaluate(int batches) {
  trace_step_.store(step_);
  OFFLOAD_RETURN_IF_ERROR(ApplyWeights());
  const TrainerOptions& o = options_;
  const int64_t available = NumValidationBatches(val_, o.batch, o.seq_len);
  const int64_t count = std::max<int64_t>(1, std::min<int64_t>(batches, available));
  // Each batch in pieces the size of a micro-batch, dealt to the ranks in turn; the mean of the
  // pieces' means is the batch's mean, as they are all the same size.
  const int pieces = o.batch / local_batch_;
  double sum = 0;
  for (int64_t i = 0; i < count; ++i) {
    ValidationBatch(val_, o.batch, o.seq_len, i, inputs_.data(), targets_.data());
    for (int p = rank(); p < pieces; p += world_size()) {
      const int64_t at = static_cast<int64_t>(p) * local_batch_ * o.seq_len;
      absl::StatusOr<float> loss =
          runner_->Forward(inputs_.data() + at, targets_.data() + at, local_batch_, o.seq_len);
      if (!loss.ok()) return loss.status();
      sum += *loss;
    }
  }
  OFFLOAD_RETURN_IF_ERROR(collectives_->AllReduce(&sum, 1, ReduceOp::kSum));
  return static_cast<float>(sum / (count * pieces));
}

absl::StatusOr<std::string> Trainer::Sample(const std::string& prompt, int n, float temperature,
                                            uint64_t seed) {
  OFFLOAD_RETURN_IF_ERROR(ApplyWeights());
  const int V = options_.model.vocab_size;
  const int max_t = options_.seq_len;
  std::vector<int32_t> tokens;
  for (unsigned char c : prompt) tokens.push_back(std::min<int32_t>(c, V - 1));
  if (tokens.empty()) tokens.push_back(static_cast<int32_t>('\n') % V);
  uint64_t rng = seed;
  std::string out;
  std::vector<double> probs(V);
  std::vector<float> logits(V);  // (V,)
  for (int i = 0; i < n; ++i) {
    const int t = std::min<int>(static_cast<int>(tokens.size()), max_t);
    const int32_t* context = tokens.data() + tokens.size() - t;  // (1, t)
    OFFLOAD_RETURN_IF_ERROR(runner_->Forward(context, nullptr, 1, t).status());
    OFFLOAD_RETURN_IF_ERROR(runner_->Logits(t - 1, logits.data()));
    const float max_logit = *std::max_element(logits.begin(), logits.end());
    double total = 0;
    for (int v = 0; v < V; ++v) {
      probs[v] = std::exp((logits[v] - max_logit) / std::max(temperature, 1e-4f));
      total += probs[v];
    }
    // Inverse-CDF sampling with a portable generator: the same seed gives the same text.
    double u = static_cast<double>(SplitMix64(&rng) >> 11) * 0x1.0p-53 * total;
    int next = V - 1;
    for (int v = 0; v < V; ++v) {
      if ((u -= probs[v]) < 0) {
        next = v;
        break;
      }
    }
    tokens.push_back(next);
    if (V <= 256) {
      out.push_back(static_cast<char>(next));
    } else {
      absl::StrAppend(&out, i ? " " : "", next);  // no tokenizer here: token ids
    }
  }
  return out;
}

}  // namespace offload
