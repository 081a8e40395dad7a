// The trainer's start and its GPT checkpoints (trainer.h): the job created on the shards and its
// state loaded (a checkpoint when resuming, GPT-2 weights, or the seeded initialisation), the
// ranks' agreement on their settings, ZeRO-3's partitions dealt out, and rank 0 writing a
// checkpoint every rank waits for. The step itself is in trainer.cc.
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/dtype_proto.h"
#include "base/status_macros.h"
#include "gpu_trainer/train/checkpointing.h"
#include "gpu_trainer/train/trainer.h"
#include "model_spec/param_layout.h"
#include "optimizer_client/checkpoint/checkpoint_dir.h"

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

// A resumed run must ask for what the checkpoint was trained with.
absl::Status CheckResumable(const v1::CheckpointManifest& m, const TrainerOptions& o,
                            int world_size, int num_shards) {
  const v1::ModelConfig want = ModelConfigToProto(o.model);
  OFFLOAD_RETURN_IF_ERROR(
      CheckSame("model", m.model().ShortDebugString(), want.ShortDebugString()));
  OFFLOAD_RETURN_IF_ERROR(CheckSame("dtype", v1::DType_Name(m.param_dtype()),
                                    v1::DType_Name(DTypeToProto(o.param_dtype))));
  OFFLOAD_RETURN_IF_ERROR(CheckSame("seed", absl::StrCat(m.seed()), absl::StrCat(o.seed)));
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
  // The partition map, and with it the shards' ranges, depends on the number of ranks and of
  // optimizer servers (shards): refused here, before CreateJob replaces a job the shards hold.
  if (absl::Status s =
          CheckSame("ranks", absl::StrCat(m.partition().world_size()), absl::StrCat(world_size));
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckSame("optimizer servers", absl::StrCat(m.partition().num_shards()),
                                 absl::StrCat(num_shards));
      !s.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(s.message(), "; re-sharding a checkpoint is not supported yet"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> Trainer::Start() {
  const TrainerOptions& o = options_;
  // Every rank reads the manifest (the ranks of a job share its checkpoint directory) and checks
  // it the same way; rank 0 alone loads the shards, and its weights reach the others below.
  std::string dir;
  v1::CheckpointManifest manifest;
  bool resuming = false;
  if (!o.checkpoint_dir.empty()) {
    absl::StatusOr<std::string> latest = LatestCheckpointDir(o.checkpoint_dir);
    if (latest.ok() && !o.resume) {
      // A fresh run would move `latest` back to its own first checkpoint and hide this one.
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint_dir ", o.checkpoint_dir, " already holds a checkpoint (", *latest,
          "): pass --resume to continue it, or choose another "
          "--checkpoint_dir"));
    }
    if (latest.ok()) {
      OFFLOAD_ASSIGN_OR_RETURN(v1::CheckpointManifest m, ReadManifest(*latest));
      OFFLOAD_RETURN_IF_ERROR(
          CheckResumable(m, o, world_size(), static_cast<int>(backend_->partition().num_shards())));
      dir = *latest;
      manifest = std::move(m);
      resuming = true;
    } else if (!absl::IsNotFound(latest.status())) {
      return latest.status();
    }
  }

  // Ranks that disagree on the settings or the checkpoint would make collectives of different
  // sizes: every rank compares its own with rank 0's first, and all fail together if any differs.
  if (world_size() > 1) {
    const std::string mine =
        absl::StrCat("batch=", o.batch, " micro_batches=", o.micro_batches, " seq_len=", o.seq_len,
                     " bucket_elements=", o.bucket_elements, " steps=", o.steps, " seed=", o.seed,
                     " dtype=", DTypeName(o.param_dtype), " dpu=", o.dpu, "/", o.dpu_warmup_steps,
                     " zero_stage=", o.zero_stage, "/", stage3() ? o.param_window_layers : 0,
                     " model=", ModelConfigToProto(o.model).ShortDebugString(),
                     " resume_step=", resuming ? static_cast<int64_t>(manifest.step()) : -1);
    char lead[1024] = {};
    mine.copy(lead, sizeof(lead) - 1);
    OFFLOAD_RETURN_IF_ERROR(collectives_->Broadcast(lead, sizeof(lead), 0));
    double differs = mine.substr(0, sizeof(lead) - 1) == lead ? 0.0 : 1.0;
    OFFLOAD_RETURN_IF_ERROR(collectives_->AllReduce(&differs, 1, ReduceOp::kMax));
    if (differs > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("the ranks disagree on their settings or checkpoint; rank 0: ", lead,
                       "; rank ", rank(), ": ", mine));
    }
  }

  if (stage3()) OFFLOAD_RETURN_IF_ERROR(StartGatherer());

  std::string how;
  absl::Status loaded;
  // ZeRO-3: rank 0 holds the whole 16-bit model only until it has dealt out the partitions (with
  // one rank the partition is the whole model).
  Weights16 full;
  uint16_t* weights16 = weights16_.data();
  if (stage3()) {
    if (world_size() > 1 && rank() == 0) {
      full = Weights16(backend_->partition().padded_length(), &weight_meter_);
    }
    weights16 = world_size() > 1 ? full.data() : partition16_.data();
  }
  if (rank() == 0) {
    loaded = LoadJob(resuming ? &dir : nullptr, resuming ? &manifest : nullptr, weights16, &how);
    // A user who asked to resume must not mistake a fresh start for a continued run.
    if (o.resume && !resuming) {
      how = absl::StrCat("nothing to resume: no checkpoint in ", o.checkpoint_dir, "; ", how);
    }
  } else {
    backend_->UseJob(o.job_id, o.param_dtype);
    how = resuming ? absl::StrCat("resumed from ", dir, " at step ", manifest.step())
                   : "weights from rank 0";
  }
  // Every rank learns whether rank 0 got there, so none waits for weights that never come.
  int32_t lead_ok = loaded.ok() ? 1 : 0;
  if (absl::Status s = collectives_->BroadcastWithin(&lead_ok, sizeof(lead_ok), 0, o.lead_timeout);
      !s.ok()) {
    return loaded.ok() ? s : loaded;
  }
  if (!lead_ok) {
    const std::string why = ShareLeadError(loaded);
    if (!loaded.ok()) return loaded;
    return absl::FailedPreconditionError(absl::StrCat("rank 0 could not start the job: ", why));
  }
  if (stage3()) {
    OFFLOAD_RETURN_IF_ERROR(DealPartitions(weights16));
    full.Reset();
  } else {
    OFFLOAD_RETURN_IF_ERROR(collectives_->Broadcast(weights16_.data(), weights16_.size() * 2, 0));
  }
  if (o.dpu) {
    int32_t next = next_ready_ ? 1 : 0;
    OFFLOAD_RETURN_IF_ERROR(collectives_->Broadcast(&next, sizeof(next), 0));
    next_ready_ = next != 0;
    if (next_ready_) {
      if (absl::Status s =
              collectives_->Broadcast(next_weights16_.data(), next_weights16_.size() * 2, 0);
          !s.ok()) {
        return s;
      }
    }
  }
  if (resuming) {
    const v1::CheckpointManifest& m = manifest;
    OFFLOAD_RETURN_IF_ERROR(sampler_->Restore(m.data()));
    OFFLOAD_RETURN_IF_ERROR(engine_->policy().Restore(m.loss_scale()));
    step_ = m.step();
    counters_ = StepCounters{m.shard_files(0).completed_step(), m.shard_files(0).adam_step()};
    last_loss_ = m.train_loss();
  }
  params_stale_ = true;
  return how;
}

absl::Status Trainer::StartGatherer() {
  if (gatherer_ != nullptr) return absl::OkStatus();
  // The CUDA backend gathers into its own device window (ApplyWeights hands it the partition).
  if (runner_->takes_partition_weights()) return absl::OkStatus();
  const TrainerOptions& o = options_;
  // Collective, like every gather after it: all ranks get here with the same settings.
  OFFLOAD_ASSIGN_OR_RETURN(param_collectives_, collectives_->Fork("params"));
  ParamGathererOptions g;
  g.model = o.model;
  g.dtype = o.param_dtype;
  g.padded_length = static_cast<int64_t>(backend_->partition().padded_length());
  g.rank = rank();
  g.world_size = world_size();
  g.window_layers = o.param_window_layers;
  if (o.trace != nullptr) {
    g.on_gathered = [this](int unit, PhaseTrace::Clock::time_point begin,
                           PhaseTrace::Clock::time_point end) {
      options_.trace->Record("gather", trace_step_.load(), begin, end);
    };
  }
  OFFLOAD_ASSIGN_OR_RETURN(gatherer_, ParamGatherer::Create(g, param_collectives_.get(),
                                                            partition16_.data(), &weight_meter_));
  return runner_->SetParamSource(gatherer_.get());
}

std::string Trainer::ShareLeadError(const absl::Status& status) {
  char why[512] = {};
  if (rank() == 0) status.ToString().copy(why, sizeof(why) - 1);
  if (!collectives_->Broadcast(why, sizeof(why), 0).ok()) return "its log says why";
  why[sizeof(why) - 1] = '\0';
  return why;
}

absl::Status Trainer::DealPartitions(const uint16_t* full) {
  const int64_t P = backend_->partition_length();
  if (rank() == 0 && full != partition16_.data()) {
    std::memcpy(partition16_.data(), full, P * sizeof(uint16_t));
  }
  // One broadcast per rank's partition: a rank keeps its own and passes over the others, so no
  // rank but 0 ever holds more than two partitions.
  Weights16 scratch;
  if (rank() != 0 && world_size() > 2) scratch = Weights16(P, &weight_meter_);
  for (int r = 1; r < world_size(); ++r) {
    uint16_t* chunk = rank() == 0   ? const_cast<uint16_t*>(full) + r * P
                      : rank() == r ? partition16_.data()
                                    : scratch.data();
    OFFLOAD_RETURN_IF_ERROR(collectives_->Broadcast(chunk, P * sizeof(uint16_t), 0));
  }
  return absl::OkStatus();
}

absl::Status Trainer::LoadJob(const std::string* checkpoint, const v1::CheckpointManifest* manifest,
                              uint16_t* weights16, std::string* how) {
  const TrainerOptions& o = options_;
  // A truncated or altered checkpoint file is refused before CreateJob replaces a job the shards
  // may still hold: a refused resume changes nothing.
  if (checkpoint != nullptr) {
    OFFLOAD_RETURN_IF_ERROR(VerifyCheckpointFiles(*checkpoint, *manifest));
  }
  OFFLOAD_RETURN_IF_ERROR(backend_->CreateJob(o.job_id, o.adam, o.param_dtype));
  const v1::PartitionMap& map = backend_->partition();
  if (checkpoint != nullptr) {
    const v1::CheckpointManifest& m = *manifest;
    OFFLOAD_RETURN_IF_ERROR(RestoreCheckpoint(*checkpoint, m, weights16, backend_));
    if (o.dpu && m.step() > o.dpu_warmup_steps) {
      // Mid-pipeline: the model file holds the weights of step - 1, which the next step computes
      // with, and the shards those of `step`, which the step after takes. Their 16-bit copy is
      // the rounding of the master weights, as the commit that made them sent it.
      std::vector<float> master(map.padded_length(), 0.0f);  // (padded,)
      OFFLOAD_RETURN_IF_ERROR(backend_->ReadMasterWeights(master.data()));
      ConvertFromFloat(master.data(), static_cast<int64_t>(master.size()), o.param_dtype,
                       next_weights16_.data());
      next_ready_ = true;
    }
    *how = absl::StrCat("resumed from ", *checkpoint, " at step ", m.step());
    return absl::OkStatus();
  }

  // Fresh start: fp32 master weights on the shards, their 16-bit rounding here.
  std::vector<float> master(map.padded_length(), 0.0f);  // (padded,) the padding stays 0
  if (!o.init_from.empty()) {
    OFFLOAD_RETURN_IF_ERROR(LoadGpt2Weights(o.init_from, o.model, master.data()));
    *how = absl::StrCat("started from weights from ", o.init_from);
  } else {
    InitGpt2Params(o.model, o.seed, master.data());
    *how = absl::StrCat("started from GPT-2 initialisation, seed ", o.seed);
  }
  OFFLOAD_RETURN_IF_ERROR(backend_->LoadMasterWeights(master.data()));
  ConvertFromFloat(master.data(), static_cast<int64_t>(master.size()), o.param_dtype, weights16);
  return absl::OkStatus();
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
  *m.mutable_loss_scale() = engine_->policy().State();
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
  // The shards' state must be quiet, and whole: every rank's commit finishes first.
  OFFLOAD_RETURN_IF_ERROR(FinishPendingCommit());
  OFFLOAD_RETURN_IF_ERROR(collectives_->Barrier());
  // NCCL ranks gather the updated partitions on their GPUs only: the whole 16-bit model comes back
  // from there (every rank gathers, collectively; rank 0 copies).
  absl::Status host_weights;
  if (runner_->takes_partition_weights() && !stage3()) {
    OFFLOAD_RETURN_IF_ERROR(ApplyWeights());
    if (rank() == 0) host_weights = runner_->CopyWeights16ToHost(weights16_.data());
  }
  absl::StatusOr<std::string> dir = absl::UnknownError("rank 0 writes the checkpoint");
  if (rank() == 0 && !host_weights.ok()) {
    dir = host_weights;
  } else if (rank() == 0) {
    v1::CheckpointManifest m = Manifest();
    m.set_val_loss(val_loss);
    // Stage 3: no rank holds the whole 16-bit model; the file is written from the shards'
    // master weights, whose rounding the 16-bit weights are (no DPU under stage 3).
    dir = offload::SaveCheckpoint(options_.checkpoint_dir, std::move(m),
                                  stage3() ? nullptr : weights16_.data(), backend_, counters_,
                                  options_.keep_checkpoints);
  }
  // No rank steps on (and changes the shards) before rank 0 has read them, and every rank learns
  // whether the checkpoint is there.
  int32_t written = dir.ok() ? 1 : 0;
  if (absl::Status s =
          collectives_->BroadcastWithin(&written, sizeof(written), 0, options_.lead_timeout);
      !s.ok()) {
    return s;
  }
  if (!written) {
    const std::string why = ShareLeadError(dir.status());
    if (rank() != 0) {
      return absl::DataLossError(absl::StrCat("rank 0 could not write the checkpoint: ", why));
    }
  }
  if (rank() == 0) return dir;
  return absl::StrCat(options_.checkpoint_dir, " (written by rank 0)");
}

}  // namespace offload
