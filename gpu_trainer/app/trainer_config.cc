#include "gpu_trainer/app/trainer_config.h"

#include <unistd.h>

#include <algorithm>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "jobs/spec/job_spec.h"
#include "model_spec/model_preset.h"

ABSL_FLAG(std::string, model, "demo", "model preset: demo, gpt2, gpt2-medium, gpt2-large, gpt2-xl");
ABSL_FLAG(int, layers, 0, "override the preset's number of layers");
ABSL_FLAG(int, heads, 0, "override the preset's number of attention heads");
ABSL_FLAG(int, channels, 0, "override the preset's channels");
ABSL_FLAG(int, context, 0, "override the preset's context length");
ABSL_FLAG(int, vocab, 0, "vocabulary size; 0: 256 for text, 50257 for GPT-2 token shards");
ABSL_FLAG(std::string, kernels, "fast", "CPU kernels: fast (BLAS) or naive (the reference loops)");
ABSL_FLAG(std::string, device, "cpu",
          "cpu: the CPU backend; cuda: the CUDA backend (16-bit compute on the GPU)");
ABSL_FLAG(int, cuda_device, 0, "which GPU, with --device=cuda");
ABSL_FLAG(std::string, collectives, "gloo",
          "with world_size > 1: gloo (TCP from host memory; CUDA ranks stage their 16-bit "
          "gradients on the host and may share a GPU) or nccl (GPU buffers, a GPU per rank; "
          "--device=cuda)");
ABSL_FLAG(int64_t, pinned_staging_mb, 64,
          "--device=cuda: pinned host memory per transfer direction (a bounded ring, whatever the "
          "model size)");
ABSL_FLAG(std::string, data, "data/tinyshakespeare.txt",
          "training data: a text file (bytes), an llm.c .bin token shard, or a glob of shards");
ABSL_FLAG(double, val_fraction, 0.1, "fraction of the data held out for validation (its end)");
ABSL_FLAG(int, batch, 16,
          "sequences per step, over all ranks and micro-batches (the global batch)");
ABSL_FLAG(int, micro_batches, 1,
          "micro-batches per step: gradients accumulate in fp32 on the shards, one update per "
          "step; batch must divide by ranks x micro_batches");
ABSL_FLAG(double, bucket_mb, 8,
          "fp32 gradient MiB per bucket: the unit reduce-scattered between ranks while backward "
          "goes on");
ABSL_FLAG(int, seq_len, 128, "tokens per sequence");
ABSL_FLAG(int64_t, steps, 600, "training steps");
ABSL_FLAG(uint64_t, seed, 1337, "seed of the initialisation and the data sampling");
ABSL_FLAG(std::string, dtype, "fp16", "weights and gradients on the trainer: fp16 or bf16");
ABSL_FLAG(std::string, optimizer, "adamw", "adamw or adam");
ABSL_FLAG(float, lr, 2e-3f, "peak learning rate");
ABSL_FLAG(float, min_lr, 2e-4f, "learning rate at the end of the cosine decay");
ABSL_FLAG(int, warmup_steps, 50, "steps of linear warm-up");
ABSL_FLAG(float, beta1, 0.9f, "Adam beta1");
ABSL_FLAG(float, beta2, 0.95f, "Adam beta2");
ABSL_FLAG(float, eps, 1e-8f, "Adam epsilon");
ABSL_FLAG(float, weight_decay, 0.0f, "weight decay (decoupled for adamw, L2 for adam)");
ABSL_FLAG(float, grad_clip, 1.0f, "max global gradient norm; 0 disables clipping");
ABSL_FLAG(float, loss_scale, 65536.0f, "initial fp16 loss scale");
ABSL_FLAG(int, loss_scale_window, 2000, "clean fp16 steps before the loss scale doubles");
ABSL_FLAG(std::string, job_id, "",
          "job name on the optimizer shards (one trainer owns it); empty: gpt-<host>-<pid>");
ABSL_FLAG(std::string, init_from, "",
          "start from GPT-2 weights in a safetensors file (Hugging Face naming)");
ABSL_FLAG(std::string, checkpoint_dir, "", "where checkpoints go; empty: none");
ABSL_FLAG(bool, resume, false, "continue from the latest checkpoint in --checkpoint_dir");
ABSL_FLAG(int, keep_checkpoints, 2, "checkpoints kept in --checkpoint_dir (at least 1)");
ABSL_FLAG(bool, dpu, false,
          "delayed parameter update: after --dpu_warmup_steps, each step's optimizer update runs "
          "while the next step computes on weights one step older");
ABSL_FLAG(int64_t, dpu_warmup_steps, 20, "synchronous steps before the delayed update starts");
ABSL_FLAG(bool, activation_checkpointing, false,
          "keep only each transformer block's input in forward and recompute the block in "
          "backward: one layer's activations instead of all, for about a third more compute");
ABSL_FLAG(int32_t, zero_stage, 2,
          "ZeRO stage: 2 holds the whole 16-bit model on every rank; 3 holds only this rank's "
          "partition and gathers each layer's weights from their owners just before use");
ABSL_FLAG(int32_t, param_window_layers, 2,
          "with --zero_stage=3: blocks whose weights the compute device holds at once (1: no "
          "overlap of gathers with compute)");

namespace offload {

absl::StatusOr<TrainerOptions> TrainerOptionsFromFlags() {
  // The settings' rules live in one place, the job spec's: a job file and these flags are checked
  // by the same code, and the conversions below may take every value as valid.
  OFFLOAD_ASSIGN_OR_RETURN(v1::JobSpec spec, JobSpecFromTrainerFlags());
  if (absl::Status s = ValidateSettings(spec, PathRule::kAsGiven); !s.ok()) return NameTheFlag(s);

  TrainerOptions o;
  o.data = absl::GetFlag(FLAGS_data);
  ModelShape shape;
  shape.preset = absl::GetFlag(FLAGS_model);
  shape.vocab = absl::GetFlag(FLAGS_vocab);
  shape.layers = absl::GetFlag(FLAGS_layers);
  shape.heads = absl::GetFlag(FLAGS_heads);
  shape.channels = absl::GetFlag(FLAGS_channels);
  shape.context = absl::GetFlag(FLAGS_context);
  OFFLOAD_ASSIGN_OR_RETURN(o.model, ResolveModel(shape, o.data, "--model", ""));

  o.kernels = absl::GetFlag(FLAGS_kernels) == "fast" ? CpuKernelSet::kFast : CpuKernelSet::kNaive;
  o.device = absl::GetFlag(FLAGS_device) == "cuda" ? ComputeDevice::kCuda : ComputeDevice::kCpu;
  o.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  OFFLOAD_ASSIGN_OR_RETURN(o.collective_library,
                           ParseCollectiveLibrary(absl::GetFlag(FLAGS_collectives)));
  o.pinned_staging_bytes = absl::GetFlag(FLAGS_pinned_staging_mb) << 20;
  o.val_fraction = absl::GetFlag(FLAGS_val_fraction);
  o.batch = absl::GetFlag(FLAGS_batch);
  o.micro_batches = absl::GetFlag(FLAGS_micro_batches);
  o.bucket_elements =
      std::max<int64_t>(1, static_cast<int64_t>(absl::GetFlag(FLAGS_bucket_mb) * (1 << 20) / 4));
  o.seq_len = absl::GetFlag(FLAGS_seq_len);
  o.steps = static_cast<uint64_t>(absl::GetFlag(FLAGS_steps));
  o.seed = absl::GetFlag(FLAGS_seed);
  o.param_dtype = absl::GetFlag(FLAGS_dtype) == "fp16" ? DType::kFp16 : DType::kBf16;

  o.adam.set_kind(absl::GetFlag(FLAGS_optimizer) == "adamw" ? v1::OPTIMIZER_KIND_ADAMW
                                                            : v1::OPTIMIZER_KIND_ADAM);
  o.adam.set_lr(absl::GetFlag(FLAGS_lr));
  o.adam.set_beta1(absl::GetFlag(FLAGS_beta1));
  o.adam.set_beta2(absl::GetFlag(FLAGS_beta2));
  o.adam.set_eps(absl::GetFlag(FLAGS_eps));
  o.adam.set_weight_decay(absl::GetFlag(FLAGS_weight_decay));
  o.schedule.set_max_lr(absl::GetFlag(FLAGS_lr));
  o.schedule.set_min_lr(absl::GetFlag(FLAGS_min_lr));
  o.schedule.set_warmup_steps(absl::GetFlag(FLAGS_warmup_steps));
  o.schedule.set_total_steps(static_cast<uint32_t>(o.steps));
  o.grad_clip = absl::GetFlag(FLAGS_grad_clip);
  o.loss_scaler.init_scale = absl::GetFlag(FLAGS_loss_scale);
  o.loss_scaler.growth_interval = absl::GetFlag(FLAGS_loss_scale_window);
  o.job_id = absl::GetFlag(FLAGS_job_id);
  if (o.job_id.empty()) {
    char host[64] = {};
    gethostname(host, sizeof(host) - 1);
    o.job_id = absl::StrCat("gpt-", host, "-", getpid());
  }
  o.init_from = absl::GetFlag(FLAGS_init_from);
  o.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  o.resume = absl::GetFlag(FLAGS_resume);
  o.keep_checkpoints = absl::GetFlag(FLAGS_keep_checkpoints);
  o.dpu = absl::GetFlag(FLAGS_dpu);
  o.dpu_warmup_steps = static_cast<uint64_t>(absl::GetFlag(FLAGS_dpu_warmup_steps));
  o.activation_checkpointing = absl::GetFlag(FLAGS_activation_checkpointing);
  o.zero_stage = absl::GetFlag(FLAGS_zero_stage);
  o.param_window_layers = absl::GetFlag(FLAGS_param_window_layers);
  return o;
}

}  // namespace offload
