#include "gpu_trainer/train/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <future>

#include "absl/strings/str_cat.h"
#include "cpu_optimizer_server/wire_convert.h"
#include "gpu_trainer/checkpoint/checkpoint_dir.h"
#include "gpu_trainer/model/param_layout.h"
#include "gpu_trainer/splitmix64.h"
#include "gpu_trainer/train/checkpointing.h"
#include "gpu_trainer/train/grad_stats.h"
#include "gpu_trainer/train/lr_schedule.h"
#include "gpu_trainer/train/partition.h"

namespace offload {
namespace {

// Fails with a message naming the setting when a resumed run asks for something else than the
// checkpoint was trained with.
absl::Status CheckSame(const char* what, const std::string& in_checkpoint,
                       const std::string& in_run) {
  if (in_checkpoint == in_run) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("the checkpoint was trained with ", what, "=",
                                                    in_checkpoint, " but this run asks for ", what,
                                                    "=", in_run));
}

}  // namespace

Trainer::Trainer(const TrainerOptions& options, OptimizerBackend* backend)
    : options_(options),
      backend_(backend),
      scaler_(options.loss_scaler, options.param_dtype == DType::kFp16) {}

Trainer::~Trainer() {
  FinishPendingCommit().IgnoreError();
  sender_.reset();
  backend_->AbortStep();
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const TrainerOptions& options,
                                                         OptimizerBackend* backend) {
  std::unique_ptr<Trainer> trainer(new Trainer(options, backend));
  if (absl::Status s = trainer->Init(); !s.ok()) return s;
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
  if (o.dpu && o.dpu_warmup_steps > (uint64_t{1} << 40)) {
    return absl::InvalidArgumentError("dpu_warmup_steps is out of range");
  }
  if (absl::Status s = ValidateLrSchedule(o.schedule); !s.ok()) return s;
  absl::StatusOr<TokenDataset> dataset = TokenDataset::Open(o.data);
  if (!dataset.ok()) return dataset.status();
  dataset_ = std::make_unique<TokenDataset>(std::move(*dataset));
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

  absl::StatusOr<std::unique_ptr<ModelRunner>> runner =
      o.device == ComputeDevice::kCuda
          ? CreateCudaModelRunner(o.model, o.batch, o.seq_len, o.param_dtype, o.cuda_device,
                                  o.pinned_staging_bytes)
          : CreateCpuModelRunner(o.model, o.batch, o.seq_len, o.kernels, o.param_dtype);
  if (!runner.ok()) return runner.status();
  runner_ = std::move(*runner);
  const v1::PartitionMap& map = backend_->partition();
  if (static_cast<int64_t>(map.num_params()) != runner_->num_params()) {
    return absl::InvalidArgumentError(absl::StrCat("the partition map covers ", map.num_params(),
                                                   " parameters, the model has ",
                                                   runner_->num_params()));
  }
  weights16_.assign(map.padded_length(), 0);
  grads16_.assign(map.padded_length(), 0);
  if (o.dpu) next_weights16_.assign(map.padded_length(), 0);
  inputs_.assign(static_cast<size_t>(o.batch) * o.seq_len, 0);
  targets_.assign(inputs_.size(), 0);
  sender_ = std::make_unique<GradientSender>(backend_, grads16_.data(), o.trace);
  return absl::OkStatus();
}

absl::StatusOr<std::string> Trainer::Start() {
  const TrainerOptions& o = options_;
  if (absl::Status s = backend_->CreateJob(o.job_id, o.adam, o.param_dtype); !s.ok()) return s;

  if (!o.checkpoint_dir.empty()) {
    absl::StatusOr<std::string> dir = LatestCheckpointDir(o.checkpoint_dir);
    if (dir.ok() && !o.resume) {
      // A fresh run would move `latest` back to its own first checkpoint and hide this one.
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint_dir ", o.checkpoint_dir, " already holds a checkpoint (", *dir,
                       "): pass --resume to continue it, or choose another --checkpoint_dir"));
    }
    if (dir.ok()) {
      absl::StatusOr<v1::CheckpointManifest> manifest = ReadManifest(*dir);
      if (!manifest.ok()) return manifest.status();
      const v1::CheckpointManifest& m = *manifest;
      const v1::ModelConfig want = ModelConfigToProto(o.model);
      if (absl::Status s =
              CheckSame("model", m.model().ShortDebugString(), want.ShortDebugString());
          !s.ok()) {
        return s;
      }
      if (absl::Status s = CheckSame("dtype", v1::DType_Name(m.param_dtype()),
                                     v1::DType_Name(DTypeToProto(o.param_dtype)));
          !s.ok()) {
        return s;
      }
      if (absl::Status s = CheckSame("seed", absl::StrCat(m.seed()), absl::StrCat(o.seed));
          !s.ok()) {
        return s;
      }
      // The optimizer must be the one the checkpoint trained with; only the length of the run
      // (and with it the end of the cosine decay) may change, to train longer.
      if (absl::Status s =
              CheckSame("optimizer", m.adam().ShortDebugString(), o.adam.ShortDebugString());
          !s.ok()) {
        return s;
      }
      v1::LrSchedule schedule = m.schedule();
      schedule.set_total_steps(o.schedule.total_steps());
      if (absl::Status s =
              CheckSame("lr schedule", schedule.ShortDebugString(), o.schedule.ShortDebugString());
          !s.ok()) {
        return s;
      }
      if (absl::Status s =
              CheckSame("grad_clip", absl::StrCat(m.grad_clip()), absl::StrCat(o.grad_clip));
          !s.ok()) {
        return s;
      }
      if (absl::Status s =
              CheckSame("dpu", absl::StrCat(m.dpu(), "/", m.dpu() ? m.dpu_warmup_steps() : 0),
                        absl::StrCat(o.dpu, "/", o.dpu ? o.dpu_warmup_steps : 0));
          !s.ok()) {
        return s;
      }
      if (absl::Status s = RestoreCheckpoint(*dir, m, weights16_.data(), backend_); !s.ok()) {
        return s;
      }
      if (o.dpu && m.step() > o.dpu_warmup_steps) {
        // Mid-pipeline: the model file holds the weights of step - 1, which the next step computes
        // with, and the shards those of `step`, which the step after takes. Their 16-bit copy is
        // the rounding of the master weights, as the commit that made them sent it.
        const v1::PartitionMap& map = backend_->partition();
        std::vector<float> master(map.padded_length(), 0.0f);  // (padded,)
        for (int i = 0; i < map.slices_size(); ++i) {
          const v1::ShardSlice& slice = map.slices(i);
          if (absl::Status s = backend_->ReadSliceState(
                  i, v1::STATE_TENSOR_MASTER_WEIGHTS, static_cast<int64_t>(slice.offset()),
                  static_cast<int64_t>(slice.length()), master.data() + slice.offset());
              !s.ok()) {
            return s;
          }
        }
        ConvertFromFloat(master.data(), static_cast<int64_t>(master.size()), o.param_dtype,
                         next_weights16_.data());
        next_ready_ = true;
      }
      if (absl::Status s = sampler_->Restore(m.data()); !s.ok()) return s;
      if (absl::Status s = scaler_.Restore(m.loss_scale()); !s.ok()) return s;
      step_ = m.step();
      counters_ = StepCounters{m.shard_files(0).completed_step(), m.shard_files(0).adam_step()};
      last_loss_ = m.train_loss();
      params_stale_ = true;
      return absl::StrCat("resumed from ", *dir, " at step ", step_);
    } else if (!absl::IsNotFound(dir.status())) {
      return dir.status();
    }
  }

  // Fresh start: fp32 master weights on the shards, their 16-bit rounding here.
  const v1::PartitionMap& map = backend_->partition();
  std::vector<float> master(map.padded_length(), 0.0f);  // (padded,) the padding stays 0
  std::string how;
  if (!o.init_from.empty()) {
    if (absl::Status s = LoadGpt2Weights(o.init_from, o.model, master.data()); !s.ok()) return s;
    how = absl::StrCat("weights from ", o.init_from);
  } else {
    InitGpt2Params(o.model, o.seed, master.data());
    how = absl::StrCat("GPT-2 initialisation, seed ", o.seed);
  }
  for (int shard = 0; shard < backend_->num_shards(); ++shard) {
    std::vector<StateSliceRef> refs;
    for (const v1::ShardSlice& s : SlicesOfShard(map, shard)) {
      refs.push_back(StateSliceRef{v1::STATE_TENSOR_MASTER_WEIGHTS,
                                   static_cast<int64_t>(s.offset()), master.data() + s.offset(),
                                   static_cast<int64_t>(s.length())});
    }
    if (absl::Status s = backend_->LoadShardState(shard, refs, nullptr); !s.ok()) return s;
  }
  ConvertFromFloat(master.data(), static_cast<int64_t>(master.size()), o.param_dtype,
                   weights16_.data());
  params_stale_ = true;
  return absl::StrCat("started from ", how);
}

absl::Status Trainer::ApplyWeights() {
  if (!params_stale_) return absl::OkStatus();
  if (absl::Status s = runner_->SetWeights(weights16_.data()); !s.ok()) return s;
  params_stale_ = false;
  return absl::OkStatus();
}

absl::StatusOr<StepReport> Trainer::Step() {
  const uint64_t step = step_ + 1;
  if (options_.dpu && step > options_.dpu_warmup_steps) return DelayedStep(step);
  return SyncStep(step);
}

StepReport Trainer::Report(uint64_t step, float loss, float loss_scale,
                           const GradStats& stats) const {
  StepReport report;
  report.step = step;
  report.loss = loss;
  report.loss_scale = loss_scale;
  report.skipped = stats.nonfinite;
  report.grad_norm = std::sqrt(stats.sum_squares) / loss_scale;
  report.lr = ScheduledLr(options_.schedule, step);
  return report;
}

// DESIGN section 1: 1 / loss_scale * clip_coef (no clipping on a step the shards skip).
float Trainer::GradMultiplier(const StepReport& report) const {
  const float clip = report.skipped ? 1.0f : ClipCoefficient(report.grad_norm, options_.grad_clip);
  return clip / report.loss_scale;
}

absl::StatusOr<float> Trainer::ForwardNextBatch(uint64_t step) {
  const TrainerOptions& o = options_;
  sender_->set_step(step);
  if (absl::Status s = ApplyWeights(); !s.ok()) return s;
  sampler_->Next(inputs_.data(), targets_.data());
  TracePhase phase(o.trace, "forward", step);
  return runner_->Forward(inputs_.data(), targets_.data(), o.batch, o.seq_len);
}

absl::StatusOr<StepReport> Trainer::SyncStep(uint64_t step) {
  const TrainerOptions& o = options_;
  absl::StatusOr<float> loss = ForwardNextBatch(step);
  if (!loss.ok()) return loss.status();

  if (absl::Status s = backend_->BeginStep(step); !s.ok()) return s;
  const float scale = scaler_.scale();
  // Each layer's gradients leave on the sender thread as soon as they are in grads16_, while
  // backward computes the layer below.
  absl::StatusOr<GradStats> backward;
  {
    TracePhase phase(o.trace, "backward", step);
    backward = runner_->Backward(scale, grads16_.data(),
                                 [&](int64_t offset, int64_t n) { sender_->Enqueue(offset, n); });
  }
  const int64_t n = runner_->num_params();
  sender_->Enqueue(n, static_cast<int64_t>(grads16_.size()) - n);  // the zero padding
  absl::Status sent;
  {
    TracePhase phase(o.trace, "wait_offload", step);
    sent = sender_->Drain();
  }
  if (!backward.ok() || !sent.ok()) {
    backend_->AbortStep();
    return !backward.ok() ? backward.status() : sent;
  }
  const GradStats& stats = *backward;

  const StepReport report = Report(step, *loss, scale, stats);
  const float grad_multiplier = GradMultiplier(report);
  absl::StatusOr<StepCounters> counters;
  {
    TracePhase phase(o.trace, "commit", step);
    counters = backend_->Commit(report.lr, grad_multiplier, report.skipped, weights16_.data());
  }
  if (!counters.ok()) return counters.status();
  counters_ = *counters;
  scaler_.Update(report.skipped);
  if (!report.skipped) params_stale_ = true;
  step_ = step;
  last_loss_ = *loss;
  return report;
}

// Step s computes on weights16_, the result of the commit of step s - 2, while the commit of step
// s - 1 runs on the shards. Its gradients wait in grads16_ until that commit is done (a range
// takes one step at a time), then leave, and the commit of step s starts in the background.
absl::StatusOr<StepReport> Trainer::DelayedStep(uint64_t step) {
  const TrainerOptions& o = options_;
  absl::StatusOr<float> loss = ForwardNextBatch(step);
  if (!loss.ok()) return loss.status();
  const float scale = scaler_.scale();
  absl::StatusOr<GradStats> backward;
  {
    TracePhase phase(o.trace, "backward", step);
    backward = runner_->Backward(scale, grads16_.data(), nullptr);
  }
  if (!backward.ok()) return backward.status();

  {
    TracePhase phase(o.trace, "wait_commit", step);
    if (absl::Status s = FinishPendingCommit(); !s.ok()) return s;
  }
  if (next_ready_) {
    // The previous step's update: the next step computes with it.
    weights16_.swap(next_weights16_);
    next_ready_ = false;
    params_stale_ = true;
  }
  if (absl::Status s = backend_->BeginStep(step); !s.ok()) return s;
  sender_->Enqueue(0, static_cast<int64_t>(grads16_.size()));
  absl::Status sent;
  {
    TracePhase phase(o.trace, "wait_offload", step);
    sent = sender_->Drain();
  }
  if (absl::Status s = sent; !s.ok()) {
    backend_->AbortStep();
    return s;
  }

  const StepReport report = Report(step, *loss, scale, *backward);
  const float grad_multiplier = GradMultiplier(report);
  pending_skipped_ = report.skipped;
  pending_commit_ = std::async(
      std::launch::async, [this, step, lr = report.lr, grad_multiplier, skip = report.skipped] {
        TracePhase phase(options_.trace, "commit", step);
        return backend_->Commit(lr, grad_multiplier, skip, next_weights16_.data());
      });
  scaler_.Update(report.skipped);
  step_ = step;
  last_loss_ = *loss;
  return report;
}

absl::Status Trainer::FinishPendingCommit() {
  if (!pending_commit_.valid()) return absl::OkStatus();
  absl::StatusOr<StepCounters> counters = pending_commit_.get();
  if (!counters.ok()) return counters.status();
  counters_ = *counters;
  if (!pending_skipped_) next_ready_ = true;
  return absl::OkStatus();
}

absl::Status Trainer::Flush() { return FinishPendingCommit(); }

absl::StatusOr<float> Trainer::Evaluate(int batches) {
  if (absl::Status s = ApplyWeights(); !s.ok()) return s;
  const TrainerOptions& o = options_;
  const int64_t available = NumValidationBatches(val_, o.batch, o.seq_len);
  const int64_t count = std::max<int64_t>(1, std::min<int64_t>(batches, available));
  double sum = 0;
  for (int64_t i = 0; i < count; ++i) {
    ValidationBatch(val_, o.batch, o.seq_len, i, inputs_.data(), targets_.data());
    absl::StatusOr<float> loss =
        runner_->Forward(inputs_.data(), targets_.data(), o.batch, o.seq_len);
    if (!loss.ok()) return loss.status();
    sum += *loss;
  }
  return static_cast<float>(sum / count);
}

absl::StatusOr<std::string> Trainer::Sample(const std::string& prompt, int n, float temperature,
                                            uint64_t seed) {
  if (absl::Status s = ApplyWeights(); !s.ok()) return s;
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
    absl::StatusOr<float> unused = runner_->Forward(context, nullptr, 1, t);
    if (!unused.ok()) return unused.status();
    if (absl::Status s = runner_->Logits(t - 1, logits.data()); !s.ok()) return s;
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

v1::CheckpointManifest Trainer::Manifest() const {
  const TrainerOptions& o = options_;
  v1::CheckpointManifest m;
  m.set_format_version(1);
  *m.mutable_model() = ModelConfigToProto(o.model);
  m.set_param_dtype(DTypeToProto(o.param_dtype));
  m.set_step(step_);
  m.set_seed(o.seed);
  *m.mutable_partition() = backend_->partition();
  *m.mutable_data() = sampler_->Position();
  *m.mutable_loss_scale() = scaler_.State();
  *m.mutable_adam() = o.adam;
  *m.mutable_schedule() = o.schedule;
  m.set_grad_clip(o.grad_clip);
  m.set_train_loss(last_loss_);
  m.set_dpu(o.dpu);
  if (o.dpu) m.set_dpu_warmup_steps(o.dpu_warmup_steps);
  return m;
}

absl::StatusOr<std::string> Trainer::SaveCheckpoint(float val_loss) {
  if (options_.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError("no checkpoint directory was given");
  }
  // The shards' state must be quiet, and whole: the background commit finishes first.
  if (absl::Status s = FinishPendingCommit(); !s.ok()) return s;
  v1::CheckpointManifest m = Manifest();
  m.set_val_loss(val_loss);
  return offload::SaveCheckpoint(options_.checkpoint_dir, std::move(m), weights16_.data(), backend_,
                                 counters_, options_.keep_checkpoints);
}

}  // namespace offload
