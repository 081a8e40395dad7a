// bench_gpu: the GPU rows of ARCHITECTURE.md section 9, measured in one process on one GPU.
//
//   1. GPU-resident training, no offload: Gpt2Cuda forward + backward and the fused GpuAdamW on
//      the device; tokens/s and MFU (model FLOPs, Gpt2FlopsPerToken, over the 16-bit peak).
//   2. The same model through the Trainer with the optimizer offloaded: in process (synchronous
//      and DPU), and behind local shards on loopback (gRPC; shared memory, synchronous and DPU);
//      step times against each other and against (1). Then the pinned transfer bound
//      (cudaMemcpyAsync each way) and what a step's 16-bit bytes take at it.
//   3. The memory planner: the largest GPT-2-shaped model that trains on this GPU's memory with
//      offload and without.
//   4. The host's share of an offload step, for gpt2 (124M) and gpt2-xl (1.5B): the Adam pass over
//      every parameter against the host's own memory roofline (adam_roofline.h, as bench_adam),
//      on every core the process may use, pinned; and the bytes a step moves each way. Needs no
//      GPU (--host_rows=false skips it); a model whose state does not fit the host is skipped
//      saying so.
//   5. With --largest (--largest_only: nothing else), the largest models of (3) trained: the
//      planner's largest for this GPU's free memory and the host's, with offload (activation
//      checkpointing, gradient buckets, the optimizer in process) and GPU-only (activation
//      checkpointing, GpuAdamW), each a few steps, with a few fewer layers where one runs out of
//      memory; step time, model TFLOP/s, the device's peak use against the plan, and the ratio
//      of their sizes.
//
// Progress goes to stderr. stdout ends with a table and then one machine-readable line per
// result, "gpu <kind> key=value ..." with no spaces inside values (scripts/gpu-check parses
// them). Without a GPU it says why and exits 1 (0 with --allow_no_gpu); --plan_memory_gib makes
// the planner row print first, and the host rows print too, since they need no GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/dtype.h"
#include "base/host_memory.h"
#include "base/status_macros.h"
#include "base/thread_pool.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"
#include "cpu_optimizer_server/adam/adam_roofline.h"
#include "cpu_optimizer_server/grpc/optimizer_service.h"
#include "cpu_optimizer_server/shard/shard_store.h"
#include "cpu_optimizer_server/shard/wire_convert.h"
#include "cpu_optimizer_server/transport_factory/transport_factory.h"
#include "gpu_trainer/cuda/gpt2_cuda.h"
#include "gpu_trainer/cuda/memory_planner.h"
#include "gpu_trainer/cuda/optim/gpu_adamw.h"
#include "gpu_trainer/cuda/runtime/cuda_check.h"
#include "gpu_trainer/cuda/runtime/cuda_device.h"
#include "gpu_trainer/cuda/runtime/device_buffer.h"
#include "gpu_trainer/cuda/runtime/pinned_staging.h"
#include "gpu_trainer/cuda/runtime/transfer_schedule.h"
#include "gpu_trainer/train/trainer.h"
#include "model_spec/gpt2_config.h"
#include "model_spec/param_layout.h"
#include "model_spec/partition.h"
#include "optimizer_client/backends/inprocess_optimizer.h"
#include "optimizer_client/backends/remote_optimizer.h"
#include "optimizer_client/precision/grad_stats.h"
#include "optimizer_client/precision/lr_schedule.h"
#include "optimizer_client/sender/phase_trace.h"

// CMake defines it for the other benches; without it the default data path is relative to the
// working directory (the repository root, where scripts/gpu-check runs).
#ifndef OFFLOAD_SOURCE_DIR
#define OFFLOAD_SOURCE_DIR "."
#endif

ABSL_FLAG(std::string, model, "gpt2-124m,gpt2-xl",
          "comma-separated models, each measured GPU-resident and offloaded: gpt2-124m (vocab "
          "50257, context 1024, 12 layers, 12 heads, 768 channels), gpt2-xl (48 layers, 25 heads, "
          "1600 channels) or demo (vocab 256, 4 layers, 4 heads, 128 channels, context "
          "--seq_len)");
ABSL_FLAG(int, xl_steps, 6, "timed steps per configuration of gpt2-xl (its steps take ~10x)");
ABSL_FLAG(int, xl_warmup, 2, "untimed steps first, gpt2-xl");
ABSL_FLAG(std::string, trace_dir, "",
          "write each offload row's Chrome trace (forward, backward, each host <-> device "
          "transfer, the commit) to DIR/MODEL_ROW.json; the overlap lines are printed either way");
ABSL_FLAG(int, batch, 8, "sequences per step");
ABSL_FLAG(int, seq_len, 1024, "tokens per sequence");
ABSL_FLAG(std::string, dtype, "bf16", "bf16 or fp16: weights, activations and gradients");
ABSL_FLAG(int, steps, 20, "timed steps per configuration");
ABSL_FLAG(int, warmup, 3, "untimed steps first");
ABSL_FLAG(int, device, 0, "CUDA device ordinal");
ABSL_FLAG(double, peak_tflops, 0,
          "dense 16-bit peak TFLOP/s that MFU is measured against; 0: from the device's SM "
          "count, clock and architecture");
ABSL_FLAG(bool, offload, true, "also time the offload rows (the Trainer with CPU optimizers)");
ABSL_FLAG(int, shards, 1, "optimizer shards on loopback for the offload=server* rows");
ABSL_FLAG(bool, all_rows_all_models, false,
          "time every offload row for every model; by default the models after the first skip "
          "the gRPC row (a gpt2-xl step moves 3 GB each way through protobuf) and the synchronous "
          "shared-memory row, so that gpt2-xl's 1.5B-parameter initialisations stay few");
ABSL_FLAG(std::string, data, std::string(OFFLOAD_SOURCE_DIR) + "/data/tinyshakespeare.txt",
          "training text of the offload rows (bytes, vocab 256: fits any vocab)");
ABSL_FLAG(double, plan_memory_gib, 0,
          "device memory the planner plans for, GiB; 0: the GPU's total. When given, the "
          "planner row prints even on a machine without a GPU");
ABSL_FLAG(int, plan_batch, 1, "micro-batch of the planner row");
ABSL_FLAG(int, plan_seq_len, 1024, "sequence length (and context) of the planner row");
ABSL_FLAG(bool, allow_no_gpu, false, "exit 0, not 1, when there is no GPU");
ABSL_FLAG(bool, host_rows, true,
          "also measure the host's share of an offload step (Adam vs the memory roofline) for "
          "gpt2-124m and gpt2-xl; needs no GPU");
ABSL_FLAG(int, plan_window_layers, 2,
          "blocks of the parameter window in the planner's ZeRO-3 rows");
ABSL_FLAG(int, plan_ranks, 8, "GPUs of the planner's ZeRO-3 row, one rank each");
ABSL_FLAG(double, plan_host_gib, 0,
          "host memory the planner's rows must fit too (the shards' fp32 state, the trainer's "
          "16-bit copies, the pinned rings), GiB; 0: no host limit");
ABSL_FLAG(double, plan_gradient_bucket_mb, 0,
          "plan the gradients in buckets of at least this many MiB of 16-bit values, each leaving "
          "as backward finishes it (the GPU holds the embeddings' bucket and two others); 0: "
          "every gradient on the GPU");
ABSL_FLAG(bool, plan_activation_checkpointing, false,
          "plan every row with activation checkpointing (each block's input kept, the block "
          "recomputed in backward)");
ABSL_FLAG(bool, largest, false,
          "also train the largest GPT-2-shaped model the planner finds for this GPU's free "
          "memory and the host's, with offload (activation checkpointing, gradient buckets, the "
          "optimizer in process) and GPU-only (activation checkpointing, GpuAdamW), and print "
          "both and the ratio of their sizes");
ABSL_FLAG(bool, largest_only, false,
          "the --largest rows and nothing else: no per-model, transfer, planner or host rows");
ABSL_FLAG(int, largest_steps, 10, "timed steps of each --largest model, after one warm-up");
ABSL_FLAG(int, largest_batch, 1, "micro-batch of the --largest models");
ABSL_FLAG(int, largest_seq_len, 1024, "sequence length (and context) of the --largest models");
ABSL_FLAG(double, largest_host_gib, 0,
          "host memory of the --largest models, GiB; 0: what the host has available "
          "(MemAvailable). The planner gets 4/5 of it: the trainer's start-up holds an fp32 copy "
          "of the weights (4 bytes a parameter) beside the 16 the planner counts");

namespace offload {
namespace {

constexpr uint64_t kSeed = 1337;
constexpr float kMaxGradNorm = 1.0f;  // the Trainer's default clipping, so both rows clip alike

struct BenchConfig {
  std::string model_name;
  Gpt2Config model;
  DType dtype = DType::kBf16;
  int batch = 0;
  int seq_len = 0;
  int steps = 0;
  int warmup = 0;
  bool activation_checkpointing = false;  // both the GPU-resident and the offload rows
};

// The hyper-parameters of both the GPU-resident optimizer and the offloaded one (bench_trainer's).
AdamHyperParams BenchAdam() {
  AdamHyperParams hp;
  hp.lr = 1e-3f;
  hp.beta1 = 0.9f;
  hp.beta2 = 0.95f;
  hp.eps = 1e-8f;
  hp.weight_decay = 0.0f;
  hp.adamw = true;
  return hp;
}

v1::LrSchedule BenchSchedule() {
  v1::LrSchedule s;
  s.set_max_lr(1e-3f);
  s.set_min_lr(1e-4f);
  s.set_warmup_steps(0);
  s.set_total_steps(1 << 30);
  return s;
}

absl::StatusOr<BenchConfig> ModelConfig(const std::string& name) {
  BenchConfig b;
  b.model_name = name;
  b.batch = absl::GetFlag(FLAGS_batch);
  b.seq_len = absl::GetFlag(FLAGS_seq_len);
  b.steps = absl::GetFlag(FLAGS_steps);
  b.warmup = absl::GetFlag(FLAGS_warmup);
  if (b.model_name == "gpt2-124m") {
    b.model = Gpt2Config{50257, 1024, 12, 12, 768};
  } else if (b.model_name == "gpt2-xl") {
    b.model = Gpt2Config{50257, 1024, 48, 25, 1600};
    b.steps = absl::GetFlag(FLAGS_xl_steps);
    b.warmup = absl::GetFlag(FLAGS_xl_warmup);
  } else if (b.model_name == "demo") {
    b.model = Gpt2Config{256, b.seq_len, 4, 4, 128};
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--model takes gpt2-124m, gpt2-xl or demo, comma-separated; not '", b.model_name, "'"));
  }
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype == "bf16") {
    b.dtype = DType::kBf16;
  } else if (dtype == "fp16") {
    b.dtype = DType::kFp16;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--dtype must be bf16 or fp16, not '", dtype, "'"));
  }
  if (b.batch < 1 || b.seq_len < 1 || b.seq_len > b.model.context_length) {
    return absl::InvalidArgumentError(absl::StrCat("--batch must be >= 1 and --seq_len in [1, ",
                                                   b.model.context_length,
                                                   "] (the model's "
                                                   "context); got batch ",
                                                   b.batch, ", seq_len ", b.seq_len));
  }
  if (b.steps < 1 || b.warmup < 0) {
    return absl::InvalidArgumentError("--steps must be >= 1 and --warmup >= 0");
  }
  OFFLOAD_RETURN_IF_ERROR(ValidateGpt2Config(b.model));
  if (absl::GetFlag(FLAGS_shards) < 1) return absl::InvalidArgumentError("--shards must be >= 1");
  if (absl::GetFlag(FLAGS_plan_host_gib) < 0 || absl::GetFlag(FLAGS_plan_gradient_bucket_mb) < 0) {
    return absl::InvalidArgumentError("--plan_host_gib and --plan_gradient_bucket_mb must be >= 0");
  }
  if (absl::GetFlag(FLAGS_plan_window_layers) < 1 || absl::GetFlag(FLAGS_plan_ranks) < 1) {
    return absl::InvalidArgumentError("--plan_window_layers and --plan_ranks must be >= 1");
  }
  if (absl::GetFlag(FLAGS_plan_memory_gib) < 0 || absl::GetFlag(FLAGS_plan_batch) < 1 ||
      absl::GetFlag(FLAGS_plan_seq_len) < 1 || absl::GetFlag(FLAGS_peak_tflops) < 0) {
    return absl::InvalidArgumentError(
        "--plan_memory_gib and --peak_tflops must be >= 0, --plan_batch and --plan_seq_len >= 1");
  }
  if (absl::GetFlag(FLAGS_largest_steps) < 1 || absl::GetFlag(FLAGS_largest_batch) < 1 ||
      absl::GetFlag(FLAGS_largest_seq_len) < 1 || absl::GetFlag(FLAGS_largest_host_gib) < 0) {
    return absl::InvalidArgumentError(
        "--largest_steps, --largest_batch and --largest_seq_len must be >= 1, --largest_host_gib "
        ">= 0");
  }
  return b;
}

// Every model of --model, in order, each checked before anything runs.
absl::StatusOr<std::vector<BenchConfig>> ConfigsFromFlags() {
  std::vector<BenchConfig> configs;
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_model), ',')) {
    OFFLOAD_ASSIGN_OR_RETURN(BenchConfig b, ModelConfig(std::string(name)));
    configs.push_back(b);
  }
  return configs;
}

// A value for a key=value line: no spaces, so a line splits on whitespace.
std::string Token(const std::string& s) { return absl::StrReplaceAll(s, {{" ", "_"}}); }

// ---- 1. GPU-resident training -------------------------------------------------------------

struct GpuResult {
  int64_t params = 0;
  double step_s = 0;
  double tokens_per_s = 0;
  double mfu = 0;  // 0 when the peak is unknown
  float first_loss = 0, last_loss = 0;
  int skipped = 0;
  int64_t model_bytes = 0, optimizer_bytes = 0;
  int64_t peak_device_bytes = 0;  // SampleDeviceBytes after the set-up and after each step
  std::string attention;          // which attention ran (Gpt2Cuda::attention_path)
};

// Folds what the device has in use now (total - free: this process's and any other's) into
// *peak.
void SampleDeviceBytes(int64_t* peak) {
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  *peak = std::max(*peak, static_cast<int64_t>(total_bytes - free_bytes));
}

absl::StatusOr<GpuResult> RunGpuResident(const BenchConfig& b, int device, double peak_flops) {
  CudaModelOptions options;
  options.dtype = b.dtype;
  options.device = device;
  options.activation_checkpointing = b.activation_checkpointing;
  absl::StatusOr<std::unique_ptr<Gpt2Cuda>> model =
      Gpt2Cuda::Create(b.model, b.batch, b.seq_len, options);
  if (!model.ok()) return model.status();
  Gpt2Cuda& m = **model;
  const int64_t n = m.num_params();
  std::unique_ptr<GpuAdamW> adamw;
  {
    std::vector<float> params(n);  // (num_params,) fp32, the GPT-2 initialisation
    InitGpt2Params(b.model, kSeed, params.data());
    // SetParams goes through a transient fp32 copy on the device (4 bytes a parameter): before
    // the optimizer's 12 bytes a parameter, not on top of them, so the planner's largest fits.
    OFFLOAD_RETURN_IF_ERROR(m.SetParams(params.data()));
    OFFLOAD_ASSIGN_OR_RETURN(adamw, GpuAdamW::Create(n, b.dtype, BenchAdam(), m.compute_stream()));
    OFFLOAD_RETURN_IF_ERROR(adamw->Init(params.data()));
  }
  GpuResult r;
  r.params = n;
  r.model_bytes = m.device_bytes();
  r.attention = m.attention_path();
  r.optimizer_bytes = adamw->device_bytes();
  SampleDeviceBytes(&r.peak_device_bytes);

  // A few batches of random tokens (B, T), made before the clock starts and used in turn.
  constexpr int kBatches = 4;
  const int64_t BT = int64_t{b.batch} * b.seq_len;
  std::mt19937_64 rng(kSeed);
  std::uniform_int_distribution<int32_t> token(0, b.model.vocab_size - 1);
  std::vector<std::vector<int32_t>> inputs(kBatches, std::vector<int32_t>(BT));
  std::vector<std::vector<int32_t>> targets(kBatches, std::vector<int32_t>(BT));
  for (int k = 0; k < kBatches; ++k) {
    for (int64_t i = 0; i < BT; ++i) {
      inputs[k][i] = token(rng);
      targets[k][i] = token(rng);
    }
  }
  // bf16 has fp32's range: no scaling. fp16 gets a fixed scale, as a run past the dynamic
  // scaler's start would settle on; an overflow skips the step like the Trainer does.
  const float loss_scale = b.dtype == DType::kFp16 ? 1024.0f : 1.0f;
  const v1::LrSchedule schedule = BenchSchedule();
  absl::Time start = absl::Now();
  for (int i = 0; i < b.warmup + b.steps; ++i) {
    if (i == b.warmup) {
      OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.compute_stream()));
      start = absl::Now();
    }
    absl::StatusOr<float> loss =
        m.Forward(inputs[i % kBatches].data(), targets[i % kBatches].data(), b.batch, b.seq_len);
    if (!loss.ok()) return loss.status();
    if (!std::isfinite(*loss)) {
      return absl::InternalError(absl::StrCat("GPU-resident step ", i + 1, ": loss is ", *loss));
    }
    if (i == 0) r.first_loss = *loss;
    r.last_loss = *loss;
    OFFLOAD_ASSIGN_OR_RETURN(CudaGradStats stats, m.Backward(loss_scale, nullptr, nullptr));
    const double norm = std::sqrt(stats.sum_squares) / loss_scale;
    const float multiplier = ClipCoefficient(norm, kMaxGradNorm) / loss_scale;
    const float lr = ScheduledLr(schedule, static_cast<uint64_t>(adamw->step() + 1));
    if (stats.nonfinite) ++r.skipped;
    if (absl::Status s =
            adamw->Step(lr, multiplier, stats.nonfinite, m.device_grads(), m.device_params());
        !s.ok()) {
      return s;
    }
    // The step is over when the update has landed: the next Forward would wait for it anyway.
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.compute_stream()));
    SampleDeviceBytes(&r.peak_device_bytes);
    std::fprintf(stderr, "bench_gpu: GPU-resident step %d/%d loss %.4f%s\n", i + 1,
                 b.warmup + b.steps, *loss, stats.nonfinite ? " (overflow: skipped)" : "");
  }
  r.step_s = absl::ToDoubleSeconds(absl::Now() - start) / b.steps;
  r.tokens_per_s = static_cast<double>(BT) / r.step_s;
  if (peak_flops > 0) r.mfu = Gpt2FlopsPerToken(b.model, b.seq_len) * r.tokens_per_s / peak_flops;
  return r;
}

// ---- 2. Offload through the Trainer -------------------------------------------------------

TrainerOptions OffloadOptions(const BenchConfig& b, int device) {
  TrainerOptions o;
  o.model = b.model;
  o.device = ComputeDevice::kCuda;
  o.cuda_device = device;
  o.data = absl::GetFlag(FLAGS_data);
  o.batch = b.batch;
  o.seq_len = b.seq_len;
  o.steps = 1 << 30;
  o.seed = kSeed;
  o.param_dtype = b.dtype;
  o.adam = AdamConfigToProto(BenchAdam());
  o.schedule = BenchSchedule();
  o.grad_clip = kMaxGradNorm;
  o.activation_checkpointing = b.activation_checkpointing;
  return o;
}

// One offload configuration: where the optimizer runs, over which data plane, with or without
// the delayed parameter update.
struct OffloadRow {
  std::string name;  // the machine-readable line's offload=NAME
  std::string what;  // the table's words
  double step_s = 0;
  // The last step's transfers against its compute, from the trace: the gradients' copies still
  // running after the GPU finished backward ("d2h_exposed"), and the share of the weights' upload
  // (on the GPU's clock) that ran while the forward that waited for it was on the GPU.
  double d2h_exposed_s = 0, h2d_in_forward = 0;
  int64_t peak_device_bytes = 0;  // SampleDeviceBytes after Start and after each step
};

// Seconds per training step after the warm-up steps (bench_trainer's TimeSteps), and how the last
// step's transfers overlapped its compute, from a trace of every step.
absl::Status TimeTrainerSteps(TrainerOptions o, const BenchConfig& b, OptimizerBackend* backend,
                              OffloadRow* row) {
  PhaseTrace trace;
  o.trace = &trace;
  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(o, backend));
  if (absl::StatusOr<std::string> s = trainer->Start(); !s.ok()) return s.status();
  SampleDeviceBytes(&row->peak_device_bytes);
  absl::Time start = absl::Now();
  for (int i = 0; i < b.warmup + b.steps; ++i) {
    if (i == b.warmup) start = absl::Now();
    absl::StatusOr<StepReport> r = trainer->Step();
    if (!r.ok()) return r.status();
    SampleDeviceBytes(&row->peak_device_bytes);
    std::fprintf(stderr, "bench_gpu: %s offload %s step %d/%d loss %.4f%s\n", b.model_name.c_str(),
                 row->name.c_str(), i + 1, b.warmup + b.steps, r->loss,
                 r->skipped ? " (overflow: skipped)" : "");
  }
  row->step_s = absl::ToDoubleSeconds(absl::Now() - start) / b.steps;
  trainer.reset();  // every transfer landed and recorded
  const std::vector<PhaseTrace::Event> events = trace.Events();
  const auto last = static_cast<uint64_t>(b.warmup + b.steps);
  for (const PhaseTrace::Event& e : events) {
    if (e.name == "d2h_exposed" && e.step == last)
      row->d2h_exposed_s += (e.end_us - e.begin_us) / 1e6;
  }
  row->h2d_in_forward = OverlapFraction(events, "h2d_weights", "forward_gpu", last);
  if (const std::string dir = absl::GetFlag(FLAGS_trace_dir); !dir.empty()) {
    const std::string path = absl::StrCat(dir, "/", b.model_name, "_", row->name, ".json");
    if (absl::Status written = trace.WriteChromeTrace(path); !written.ok()) {
      std::fprintf(stderr, "bench_gpu: trace %s: %s\n", path.c_str(), written.ToString().c_str());
    }
  }
  return backend->DropJob();
}

struct OffloadResult {
  int64_t params = 0;
  std::vector<OffloadRow> rows;  // in the order they ran; inprocess first
  // The step time of row `name`, if it ran.
  std::optional<double> StepSeconds(const std::string& name) const {
    for (const OffloadRow& r : rows) {
      if (r.name == name) return r.step_s;
    }
    return std::nullopt;
  }
};

// The rows, each through a fresh Trainer on the same data: the optimizer in process (synchronous,
// then DPU), then behind --shards OptimizerServers on loopback in this process, over gRPC and
// over shared memory (synchronous, then DPU). DPU rows time only delayed steps: their warm-up is
// the bench's.
absl::Status RunOffload(const BenchConfig& b, int device, bool all_rows, OffloadResult* out) {
  TrainerOptions sync = OffloadOptions(b, device);
  TrainerOptions dpu = sync;
  dpu.dpu = true;
  dpu.dpu_warmup_steps = static_cast<uint64_t>(std::max(1, b.warmup));
  const int shards = absl::GetFlag(FLAGS_shards);
  absl::StatusOr<v1::PartitionMap> map = MakePartitionMap(Gpt2NumParams(b.model), 1, shards);
  if (!map.ok()) return map.status();
  out->params = map->num_params();

  auto time_row = [&](const TrainerOptions& o, OptimizerBackend* backend, const std::string& name,
                      const std::string& what) -> absl::Status {
    OffloadRow row{name, what};
    OFFLOAD_RETURN_IF_ERROR(TimeTrainerSteps(o, b, backend, &row));
    out->rows.push_back(row);
    return absl::OkStatus();
  };
  {
    InProcessOptimizer in_process(*map, 0, BestSimdPath());
    OFFLOAD_RETURN_IF_ERROR(time_row(sync, &in_process, "inprocess", "in process"));
  }
  {
    InProcessOptimizer in_process(*map, 0, BestSimdPath());
    OFFLOAD_RETURN_IF_ERROR(time_row(dpu, &in_process, "inprocess_dpu", "in process, DPU"));
  }

  // The shards as the launcher would run them, in this process on loopback.
  ThreadPool pool(ThreadPool::Options{});
  std::vector<std::unique_ptr<ShardStore>> stores;
  std::vector<std::unique_ptr<OptimizerServer>> servers;
  std::vector<std::string> addresses;
  for (int s = 0; s < shards; ++s) {
    stores.push_back(std::make_unique<ShardStore>(ShardOptions{}, &pool, BestSimdPath()));
    ServerOptions options;
    options.listen_address = "127.0.0.1:0";
    absl::StatusOr<std::unique_ptr<OptimizerServer>> server =
        OptimizerServer::Start(options, stores.back().get());
    if (!server.ok()) return server.status();
    addresses.push_back(absl::StrCat("127.0.0.1:", (*server)->port()));
    servers.push_back(std::move(*server));
  }
  const std::string n = absl::StrCat(shards, " shard", shards > 1 ? "s" : "");
  struct ServerRow {
    TransportChoice transport;
    const TrainerOptions* options;
    std::string name, what;
  };
  for (const ServerRow& row :
       {ServerRow{TransportChoice::kGrpc, &sync, "server", absl::StrCat(n, ", gRPC")},
        ServerRow{TransportChoice::kShm, &sync, "server_shm", absl::StrCat(n, ", shared memory")},
        ServerRow{TransportChoice::kShm, &dpu, "server_shm_dpu",
                  absl::StrCat(n, ", shared memory, DPU")}}) {
    if (!all_rows && row.options == &sync) continue;  // gRPC and synchronous shm: first model
    absl::StatusOr<std::unique_ptr<RemoteOptimizer>> remote =
        RemoteOptimizer::Connect(*map, addresses, ClientOptions{}, row.transport);
    if (!remote.ok()) return remote.status();
    OFFLOAD_RETURN_IF_ERROR(time_row(*row.options, remote->get(), row.name, row.what));
  }
  return absl::OkStatus();
}

// ---- 2b. Host <-> device transfers ----------------------------------------------------------

// The pinned bound of an offload step's transfers: cudaMemcpyAsync between page-locked host
// memory and the device, timed with events, best of `repeats`; and the bytes a step moves.
struct TransferResult {
  int64_t bytes = 0;  // per copy
  double h2d_s = 0, d2h_s = 0;
  int64_t step_bytes_each_way = 0;  // 16-bit gradients out, 16-bit weights in
};

absl::StatusOr<TransferResult> RunTransfers(int64_t step_bytes_each_way) {
  TransferResult t;
  t.bytes = int64_t{256} << 20;
  t.step_bytes_each_way = step_bytes_each_way;
  constexpr int kRepeats = 10;
  const auto bytes = static_cast<size_t>(t.bytes);
  DeviceBuffer dev;
  OFFLOAD_RETURN_IF_ERROR(dev.Allocate(bytes, "the transfer bound's device buffer"));
  void* pinned = nullptr;
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMallocHost(&pinned, bytes));
  const std::unique_ptr<void, cudaError_t (*)(void*)> host(pinned, cudaFreeHost);
  // Real data, written once: the page tables are touched before the clock starts.
  std::memset(host.get(), 0x5a, bytes);
  cudaEvent_t begin = nullptr, end = nullptr;
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventCreate(&begin));
  const std::unique_ptr<CUevent_st, cudaError_t (*)(cudaEvent_t)> begin_owner(begin,
                                                                              cudaEventDestroy);
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventCreate(&end));
  const std::unique_ptr<CUevent_st, cudaError_t (*)(cudaEvent_t)> end_owner(end, cudaEventDestroy);
  cudaStream_t stream = nullptr;
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const std::unique_ptr<CUstream_st, cudaError_t (*)(cudaStream_t)> stream_owner(stream,
                                                                                 cudaStreamDestroy);
  for (const bool to_device : {true, false}) {
    double best = 0;
    for (int i = 0; i < kRepeats + 1; ++i) {  // the first is a warm-up
      OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(begin, stream));
      OFFLOAD_CUDA_RETURN_IF_ERROR(
          to_device
              ? cudaMemcpyAsync(dev.data(), host.get(), bytes, cudaMemcpyHostToDevice, stream)
              : cudaMemcpyAsync(host.get(), dev.data(), bytes, cudaMemcpyDeviceToHost, stream));
      OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(end, stream));
      OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(end));
      float ms = 0;
      OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, begin, end));
      if (i > 0 && (best == 0 || ms * 1e-3 < best)) best = ms * 1e-3;
    }
    (to_device ? t.h2d_s : t.d2h_s) = best;
  }
  return t;
}

// The offload step's own transfers of one model at full size, outside a step: its 16-bit weights
// up unit by unit and its gradients down range by range (transfer_schedule.h) through the staging
// classes the model uses, from and into registered (page-locked) host buffers as the trainer's
// are, and through the pinned ring from pageable ones for comparison. Wall time from the first
// copy queued to the last landed, best of a few.
struct PipelineTransfer {
  std::string model;
  int64_t bytes = 0;                      // each way
  double h2d_s = 0, d2h_s = 0;            // registered: cudaMemcpyAsync in place
  double ring_h2d_s = 0, ring_d2h_s = 0;  // pageable: through the pinned ring
  std::string registered_error;           // why registration failed, if it did
};

absl::StatusOr<PipelineTransfer> RunPipelineTransfers(const BenchConfig& b) {
  PipelineTransfer t;
  t.model = b.model_name;
  const std::vector<FlatRange> units = ForwardWeightUnits(b.model);
  const int64_t n = Gpt2NumParams(b.model);
  t.bytes = 2 * n;
  DeviceBuffer dev;
  OFFLOAD_RETURN_IF_ERROR(dev.Allocate(static_cast<size_t>(t.bytes), "the transfer rows' weights"));
  auto* device16 = static_cast<uint16_t*>(dev.data());
  std::vector<uint16_t> registered(n, 0x3c00), pageable(n, 0x3c00);
  if (const cudaError_t e = cudaHostRegister(registered.data(), static_cast<size_t>(t.bytes),
                                             cudaHostRegisterDefault);
      e != cudaSuccess) {
    cudaGetLastError();
    t.registered_error = cudaGetErrorString(e);
  }
  const bool direct = t.registered_error.empty();
  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<HostToDeviceStaging> h2d,
                           HostToDeviceStaging::Create(StagingOptions{}));
  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<DeviceToHostStaging> d2h,
                           DeviceToHostStaging::Create(StagingOptions{}));
  std::vector<cudaEvent_t> arrived(units.size(), nullptr);
  for (cudaEvent_t& e : arrived) {
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  auto seconds_up = [&](uint16_t* host, bool in_place) -> absl::StatusOr<double> {
    const absl::Time start = absl::Now();
    for (size_t u = 0; u < units.size(); ++u) {
      OFFLOAD_RETURN_IF_ERROR(h2d->Copy(device16 + units[u].offset, host + units[u].offset,
                                        2 * units[u].n, arrived[u], in_place));
    }
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(h2d->stream()));
    return absl::ToDoubleSeconds(absl::Now() - start);
  };
  auto seconds_down = [&](uint16_t* host, bool in_place) -> absl::StatusOr<double> {
    const absl::Time start = absl::Now();
    for (auto it = units.rbegin(); it != units.rend(); ++it) {  // backward's order
      d2h->Copy(host + it->offset, device16 + it->offset, 2 * it->n, nullptr, nullptr, in_place);
    }
    OFFLOAD_RETURN_IF_ERROR(d2h->Drain());
    return absl::ToDoubleSeconds(absl::Now() - start);
  };
  constexpr int kRepeats = 3;
  auto best = [&](auto&& run, uint16_t* host, bool in_place, double* out) -> absl::Status {
    for (int i = 0; i < kRepeats + 1; ++i) {  // the first is a warm-up
      OFFLOAD_ASSIGN_OR_RETURN(double seconds, run(host, in_place));
      if (i > 0 && (*out == 0 || seconds < *out)) *out = seconds;
    }
    return absl::OkStatus();
  };
  absl::Status status;
  if (direct) {
    status.Update(best(seconds_up, registered.data(), true, &t.h2d_s));
    status.Update(best(seconds_down, registered.data(), true, &t.d2h_s));
  }
  status.Update(best(seconds_up, pageable.data(), false, &t.ring_h2d_s));
  status.Update(best(seconds_down, pageable.data(), false, &t.ring_d2h_s));
  for (cudaEvent_t e : arrived) cudaEventDestroy(e);
  if (direct) cudaHostUnregister(registered.data());
  if (!status.ok()) return status;
  return t;
}

// ---- 3. The memory planner ----------------------------------------------------------------

struct PlanResult {
  double memory_gib = 0;
  int batch = 0, seq_len = 0;
  DType dtype = DType::kBf16;
  bool checkpointing = false;
  double host_gib = 0;            // 0: no limit
  double gradient_bucket_mb = 0;  // 0: every gradient on the GPU
  std::string offload_binds = "-", gpu_only_binds = "-", window_binds = "-", stage3_binds = "-";
  int64_t offload_params = 0, gpu_only_params = 0;  // 0: nothing fits
  std::string offload_model = "none", gpu_only_model = "none";
  double ratio = 0;  // offload_params / gpu_only_params; 0 when either is 0
  // ZeRO-3 plans, with offload: one rank with a parameter window (the 16-bit model in pinned host
  // memory), and plan_ranks ranks each holding its partition and the window.
  int window_layers = 0, ranks = 0;
  int64_t window_params = 0, stage3_params = 0;
  std::string window_model = "none", stage3_model = "none";
};

absl::StatusOr<PlanResult> RunPlan(double memory_gib, DType dtype) {
  PlanResult p;
  p.memory_gib = memory_gib;
  p.batch = absl::GetFlag(FLAGS_plan_batch);
  p.seq_len = absl::GetFlag(FLAGS_plan_seq_len);
  p.dtype = dtype;
  p.checkpointing = absl::GetFlag(FLAGS_plan_activation_checkpointing);
  p.host_gib = absl::GetFlag(FLAGS_plan_host_gib);
  p.gradient_bucket_mb = absl::GetFlag(FLAGS_plan_gradient_bucket_mb);
  // Any positive size is at least one element: a bucket per unit, what one rank runs.
  const int64_t bucket =
      p.gradient_bucket_mb > 0
          ? std::max<int64_t>(1, static_cast<int64_t>(p.gradient_bucket_mb * (1 << 20)) /
                                     static_cast<int64_t>(DTypeSize(dtype)))
          : 0;
  const auto bytes = static_cast<int64_t>(memory_gib * static_cast<double>(int64_t{1} << 30));
  const auto host = static_cast<int64_t>(p.host_gib * static_cast<double>(int64_t{1} << 30));
  for (const bool gpu_optimizer : {false, true}) {
    absl::StatusOr<LargestTrainable> best = LargestTrainableGpt2(
        bytes, p.batch, p.seq_len, dtype, gpu_optimizer, {}, p.checkpointing, host, bucket);
    if (!best.ok() && !absl::IsNotFound(best.status())) return best.status();
    if (!best.ok()) continue;  // nothing fits: reported as 0 parameters
    (gpu_optimizer ? p.gpu_only_params : p.offload_params) = best->num_params;
    (gpu_optimizer ? p.gpu_only_model : p.offload_model) = Token(DescribeConfig(best->config));
    (gpu_optimizer ? p.gpu_only_binds : p.offload_binds) = best->binds;
  }
  if (p.offload_params > 0 && p.gpu_only_params > 0) {
    p.ratio = static_cast<double>(p.offload_params) / static_cast<double>(p.gpu_only_params);
  }
  p.window_layers = absl::GetFlag(FLAGS_plan_window_layers);
  p.ranks = absl::GetFlag(FLAGS_plan_ranks);
  for (const int ranks : {1, p.ranks}) {
    const ParamPlacement placement{3, ranks, p.window_layers};
    absl::StatusOr<LargestTrainable> best =
        LargestTrainableGpt2(bytes, p.batch, p.seq_len, dtype, /*gpu_optimizer=*/false, placement,
                             p.checkpointing, host, bucket);
    if (!best.ok() && !absl::IsNotFound(best.status())) return best.status();
    if (!best.ok()) continue;
    (ranks == 1 ? p.window_params : p.stage3_params) = best->num_params;
    (ranks == 1 ? p.window_model : p.stage3_model) = Token(DescribeConfig(best->config));
    (ranks == 1 ? p.window_binds : p.stage3_binds) = best->binds;
  }
  return p;
}

// ---- Report -------------------------------------------------------------------------------

// ---- 4. The host's share of an offload step --------------------------------------------

struct HostRow {
  std::string model;
  int64_t params = 0;
  int threads = 0;
  int64_t bytes_each_way = 0;  // 16-bit gradients in, 16-bit weights out
  double adam_s = 0, roofline_s = 0;
  std::string skipped;  // why it was not measured; empty if it was
};

HostRow RunHostRow(const std::string& name, const Gpt2Config& c, DType dtype) {
  HostRow row;
  row.model = name;
  row.params = Gpt2NumParams(c);
  row.bytes_each_way = 2 * row.params;
  // The shards' 16 bytes per parameter, with room left for the rest of the process.
  const int64_t need = 16 * row.params;
  const int64_t available = AvailableHostBytes();
  if (available >= 0 && need > available - (int64_t{2} << 30)) {
    row.skipped = absl::StrFormat("needs %.1f GiB of host memory, %.1f GiB available",
                                  need / 1073741824.0, available / 1073741824.0);
    return row;
  }
  ThreadPool pool(ThreadPool::Options{0, /*pin=*/true});
  row.threads = pool.num_threads();
  absl::StatusOr<std::unique_ptr<AdamRooflineBuffers>> buffers =
      AdamRooflineBuffers::Allocate(row.params);
  if (!buffers.ok()) {
    row.skipped = std::string(buffers.status().message());
    return row;
  }
  (*buffers)->Fill(dtype, pool);
  const AdamVsRoofline best = MeasureAdamVsRoofline(**buffers, dtype, BestSimdPath(), pool, 3);
  row.adam_s = best.adam_s;
  row.roofline_s = best.roofline_s;
  return row;
}

// ---- 5. The largest models, trained ------------------------------------------------------

// One side of --largest: what the planner chose and what trained.
struct LargestRow {
  std::string side;  // "offload" or "gpu_only"
  DType dtype = DType::kBf16;
  int batch = 0, seq_len = 0;
  double device_free_gib = 0, host_gib = 0;  // what the planner was given; host 0: no limit
  Gpt2Config planned;                        // the planner's answer
  std::string binds = "-";                   // which side stops one more layer of it
  Gpt2Config model;                          // what trained: planned, or fewer layers
  int64_t params = 0;                        // of `model`; 0 when nothing trained
  int tries = 0;
  double step_s = 0, tflops = 0;     // model FLOPs (Gpt2FlopsPerToken) over the step time
  int64_t peak_device_bytes = 0;     // SampleDeviceBytes, the most seen
  int64_t planned_device_bytes = 0;  // the planner's total for `model`
  std::string error;                 // why nothing trained; empty when it did
};

bool IsOutOfMemory(const absl::Status& s) {
  return absl::IsResourceExhausted(s) || absl::StrContains(s.message(), "out of memory");
}

// Trains `b.model` one way and fills in the step time and the device's peak.
absl::Status TrainLargest(const BenchConfig& b, bool gpu_only, int device, LargestRow* row) {
  if (gpu_only) {
    OFFLOAD_ASSIGN_OR_RETURN(GpuResult r, RunGpuResident(b, device, /*peak_flops=*/0));
    row->step_s = r.step_s;
    row->peak_device_bytes = r.peak_device_bytes;
    return absl::OkStatus();
  }
  // As the offload=inprocess row: the Trainer on the GPU, the shard's optimizer in this process.
  OFFLOAD_ASSIGN_OR_RETURN(v1::PartitionMap map, MakePartitionMap(Gpt2NumParams(b.model), 1, 1));
  InProcessOptimizer in_process(map, 0, BestSimdPath());
  OffloadRow offload{"inprocess", "in process"};
  OFFLOAD_RETURN_IF_ERROR(TimeTrainerSteps(OffloadOptions(b, device), b, &in_process, &offload));
  row->step_s = offload.step_s;
  row->peak_device_bytes = offload.peak_device_bytes;
  return absl::OkStatus();
}

// The planner's largest model for the device's free memory (and the host's, 4/5 of it: see
// --largest_host_gib), with activation checkpointing; with offload its gradients in buckets of a
// unit each, as one rank runs them. Trained; where that runs out of memory, again with 5% fewer
// layers, a few times.
LargestRow RunLargest(bool gpu_only, int device, DType dtype) {
  constexpr int kMaxTries = 6;
  constexpr int64_t kUnitBuckets = 1;
  LargestRow row;
  row.side = gpu_only ? "gpu_only" : "offload";
  row.dtype = dtype;
  row.batch = absl::GetFlag(FLAGS_largest_batch);
  row.seq_len = absl::GetFlag(FLAGS_largest_seq_len);
  size_t free_bytes = 0, total_bytes = 0;
  if (const cudaError_t e = cudaMemGetInfo(&free_bytes, &total_bytes); e != cudaSuccess) {
    row.error = absl::StrCat("cudaMemGetInfo: ", cudaGetErrorString(e));
    return row;
  }
  const double host_gib = absl::GetFlag(FLAGS_largest_host_gib);
  const int64_t host_bytes = host_gib > 0 ? static_cast<int64_t>(host_gib * (int64_t{1} << 30))
                                          : std::max<int64_t>(0, AvailableHostBytes());
  const int64_t host_budget = host_bytes / 5 * 4;
  row.device_free_gib = free_bytes / 1073741824.0;
  row.host_gib = host_budget / 1073741824.0;
  absl::StatusOr<LargestTrainable> best = LargestTrainableGpt2(
      static_cast<int64_t>(free_bytes), row.batch, row.seq_len, dtype, gpu_only, {},
      /*activation_checkpointing=*/true, host_budget, kUnitBuckets);
  if (!best.ok()) {
    row.error = std::string(best.status().message());
    return row;
  }
  row.planned = best->config;
  row.binds = best->binds;
  BenchConfig b;
  b.model_name = absl::StrCat("largest-", row.side);
  b.model = best->config;
  b.dtype = dtype;
  b.batch = row.batch;
  b.seq_len = row.seq_len;
  b.steps = absl::GetFlag(FLAGS_largest_steps);
  b.warmup = 1;
  b.activation_checkpointing = true;
  for (row.tries = 1;; ++row.tries) {
    std::fprintf(stderr, "bench_gpu: largest %s, try %d: %s, %s parameters\n", row.side.c_str(),
                 row.tries, DescribeConfig(b.model).c_str(),
                 absl::StrFormat("%.2fB", Gpt2NumParams(b.model) / 1e9).c_str());
    const absl::Status status = TrainLargest(b, gpu_only, device, &row);
    if (status.ok()) break;
    std::fprintf(stderr, "bench_gpu: largest %s, try %d: %s\n", row.side.c_str(), row.tries,
                 status.ToString().c_str());
    if (!IsOutOfMemory(status) || row.tries == kMaxTries || b.model.num_layers == 1) {
      row.error = std::string(status.message());
      return row;
    }
    b.model.num_layers -= std::max(1, b.model.num_layers / 20);
  }
  row.model = b.model;
  row.params = Gpt2NumParams(b.model);
  row.tflops = Gpt2FlopsPerToken(b.model, b.seq_len) * b.batch * b.seq_len / row.step_s / 1e12;
  row.planned_device_bytes =
      PlanGpt2CudaMemory(b.model, b.batch, b.seq_len, dtype, gpu_only, {}, true, kUnitBuckets)
          .total_bytes();
  return row;
}

// What one model of --model measured, or why it stopped.
struct ModelRun {
  BenchConfig b;
  std::optional<GpuResult> gpu;
  std::optional<OffloadResult> offload;
  std::optional<PipelineTransfer> pipeline;
  std::string error;  // empty if every row ran
};

struct Results {
  std::optional<CudaDeviceInfo> device;
  double peak_flops = 0;
  std::string peak_source;
  std::vector<ModelRun> models;
  std::optional<TransferResult> transfer;
  std::optional<PlanResult> plan;
  std::vector<HostRow> host;
  std::vector<LargestRow> largest;  // offload, then gpu_only
};

std::string Billions(int64_t n) { return absl::StrFormat("%.2fB", static_cast<double>(n) / 1e9); }

double Gbps(int64_t bytes, double seconds) { return seconds > 0 ? bytes / seconds / 1e9 : 0.0; }

// The offload model's parameters over the GPU-only model's, as trained; 0 unless both trained.
double LargestRatio(const std::vector<LargestRow>& rows) {
  int64_t offload = 0, gpu_only = 0;
  for (const LargestRow& l : rows) (l.side == "offload" ? offload : gpu_only) = l.params;
  return offload > 0 && gpu_only > 0 ? static_cast<double>(offload) / gpu_only : 0.0;
}

void ReportModel(const Results& r, const ModelRun& m) {
  const BenchConfig& b = m.b;
  auto row = [](const std::string& what, const std::string& value) {
    std::printf("  %-34s %s\n", what.c_str(), value.c_str());
  };
  std::printf("bench_gpu: %s %s, batch %d x %d tokens, %d timed steps after %d warm-up\n",
              b.model_name.c_str(), std::string(DTypeName(b.dtype)).c_str(), b.batch, b.seq_len,
              b.steps, b.warmup);
  if (m.gpu) {
    const GpuResult& g = *m.gpu;
    row("params", absl::StrCat(g.params));
    row("attention", g.attention);
    row("GPU-resident step", absl::StrFormat("%.4f s", g.step_s));
    row("GPU-resident tokens/s", absl::StrFormat("%.0f", g.tokens_per_s));
    row("MFU", r.peak_flops > 0 ? absl::StrFormat("%.1f%% of %.1f TFLOP/s (%s)", 100 * g.mfu,
                                                  r.peak_flops / 1e12, r.peak_source)
                                : std::string("peak unknown for this GPU: pass --peak_tflops"));
    if (r.peak_flops > 0) {
      row("MFU formula",
          absl::StrFormat("%.4g FLOP/token (6 x matmul weights + 12 L T C) x %.0f tokens/s / "
                          "%.1f TFLOP/s",
                          Gpt2FlopsPerToken(b.model, b.seq_len), g.tokens_per_s,
                          r.peak_flops / 1e12));
    }
    row("loss first / last", absl::StrFormat("%.4f / %.4f", g.first_loss, g.last_loss));
    row("skipped (fp16 overflow)", absl::StrCat(g.skipped));
    row("GPU memory: model + optimizer",
        absl::StrFormat("%.2f + %.2f GiB", g.model_bytes / 1073741824.0,
                        g.optimizer_bytes / 1073741824.0));
  }
  if (m.offload) {
    for (const OffloadRow& o : m.offload->rows) {
      row(absl::StrCat("offload step, ", o.what),
          m.gpu ? absl::StrFormat("%.4f s (%.3fx GPU-resident)", o.step_s, o.step_s / m.gpu->step_s)
                : absl::StrFormat("%.4f s", o.step_s));
      row("  transfers not hidden",
          absl::StrFormat("gradients' D2H %.2f ms after backward; %.0f%% of the weights' H2D "
                          "inside forward",
                          1e3 * o.d2h_exposed_s, 100 * o.h2d_in_forward));
    }
  }
  if (m.pipeline) {
    const PipelineTransfer& p = *m.pipeline;
    if (!p.registered_error.empty()) {
      row("transfers, registered", absl::StrCat("not measured: ", p.registered_error));
    } else {
      row("transfers, registered memory",
          absl::StrFormat("%.0f MB: H2D %.1f GB/s, D2H %.1f GB/s", p.bytes / 1e6,
                          Gbps(p.bytes, p.h2d_s), Gbps(p.bytes, p.d2h_s)));
    }
    row("transfers, pinned ring (pageable)",
        absl::StrFormat("H2D %.1f GB/s, D2H %.1f GB/s", Gbps(p.bytes, p.ring_h2d_s),
                        Gbps(p.bytes, p.ring_d2h_s)));
    if (r.transfer && p.registered_error.empty()) {
      const TransferResult& t = *r.transfer;
      row("  / the pinned bound", absl::StrFormat("H2D %.2f, D2H %.2f (target >= 0.80)",
                                                  Gbps(p.bytes, p.h2d_s) / Gbps(t.bytes, t.h2d_s),
                                                  Gbps(p.bytes, p.d2h_s) / Gbps(t.bytes, t.d2h_s)));
    }
  }
  if (!m.error.empty()) row("stopped", m.error);
  std::printf("\n");
}

// The table, then the machine-readable lines: always last, always in this order.
void Report(const Results& r) {
  auto row = [](const std::string& what, const std::string& value) {
    std::printf("  %-34s %s\n", what.c_str(), value.c_str());
  };
  const DType dtype_of_run = r.models.empty() ? DType::kBf16 : r.models.front().b.dtype;
  const std::string dtype(DTypeName(dtype_of_run));
  std::printf("\n");
  if (r.device) {
    std::printf("bench_gpu: %s\n\n", DescribeCudaDevice(*r.device).c_str());
  }
  for (const ModelRun& m : r.models) ReportModel(r, m);
  if (r.transfer) {
    const TransferResult& t = *r.transfer;
    row("pinned H2D / D2H (cudaMemcpyAsync)",
        absl::StrFormat("%.1f / %.1f GB/s (%lld MiB copies)", Gbps(t.bytes, t.h2d_s),
                        Gbps(t.bytes, t.d2h_s), static_cast<long long>(t.bytes >> 20)));
    row("a step's transfers at that bound",
        absl::StrFormat("%.0f MB each way: %.2f ms in, %.2f ms out", t.step_bytes_each_way / 1e6,
                        1e3 * t.step_bytes_each_way * t.h2d_s / t.bytes,
                        1e3 * t.step_bytes_each_way * t.d2h_s / t.bytes));
  }
  if (r.plan) {
    const PlanResult& p = *r.plan;
    const std::string on = absl::StrFormat(
        "%.1f GiB, %s, batch %d x %d%s%s%s", p.memory_gib, DTypeName(p.dtype), p.batch, p.seq_len,
        p.checkpointing ? ", activation checkpointing" : "",
        p.host_gib > 0 ? absl::StrFormat(", host %.0f GiB", p.host_gib) : "",
        p.gradient_bucket_mb > 0
            ? absl::StrFormat(", gradients in %.0f MiB buckets", p.gradient_bucket_mb)
            : "");
    std::printf("  largest model on %s\n", on.c_str());
    row("  with offload", absl::StrCat(Billions(p.offload_params), " (", p.offload_model,
                                       ", binds: ", p.offload_binds, ")"));
    row("  GPU only", absl::StrCat(Billions(p.gpu_only_params), " (", p.gpu_only_model,
                                   ", binds: ", p.gpu_only_binds, ")"));
    row("size ratio offload / GPU only", absl::StrFormat("%.2fx", p.ratio));
    std::printf("  ZeRO-3, a window of %d blocks:\n", p.window_layers);
    row("  offload + window, 1 GPU", absl::StrCat(Billions(p.window_params), " (", p.window_model,
                                                  ", binds: ", p.window_binds, ")"));
    row(absl::StrCat("  offload + stage 3, ", p.ranks, " GPUs"),
        absl::StrCat(Billions(p.stage3_params), " (", p.stage3_model, ", binds: ", p.stage3_binds,
                     ")"));
  }
  for (const HostRow& h : r.host) {
    const std::string what =
        absl::StrFormat("host Adam, %s (%s params)", h.model, Billions(h.params));
    if (!h.skipped.empty()) {
      row(what, absl::StrCat("skipped: ", h.skipped));
      continue;
    }
    row(what, absl::StrFormat("%.1f ms, roofline %.1f ms (%.2fx), %d threads; %.0f MB each way",
                              h.adam_s * 1e3, h.roofline_s * 1e3, h.roofline_s / h.adam_s,
                              h.threads, h.bytes_each_way / 1e6));
  }
  for (const LargestRow& l : r.largest) {
    const std::string what = absl::StrFormat(
        "largest trained, %s (%s, %d x %d, checkpointing; %.1f GiB free, host %.0f GiB)",
        l.side == "offload" ? "offload" : "GPU only", DTypeName(l.dtype), l.batch, l.seq_len,
        l.device_free_gib, l.host_gib);
    std::printf("  %s\n", what.c_str());
    if (!l.error.empty()) {
      row("  stopped", l.error);
      continue;
    }
    row("  model", absl::StrCat(Billions(l.params), " (", DescribeConfig(l.model), "; planned ",
                                l.planned.num_layers, " layers, binds: ", l.binds, ")"));
    row("  step, model TFLOP/s", absl::StrFormat("%.3f s, %.1f", l.step_s, l.tflops));
    row("  device peak / planned",
        absl::StrFormat("%.2f / %.2f GiB", l.peak_device_bytes / 1073741824.0,
                        l.planned_device_bytes / 1073741824.0));
  }
  if (const double ratio = LargestRatio(r.largest); ratio > 0) {
    row("largest trained, offload / GPU only", absl::StrFormat("%.2fx", ratio));
  }
  std::printf("\n");

  if (r.device) {
    const CudaDeviceInfo& d = *r.device;
    std::printf("gpu device=%d name=%s sm=%d%d sms=%d memory_gib=%.1f peak_tflops=%.1f peak=%s\n",
                d.ordinal, Token(d.name).c_str(), d.compute_major, d.compute_minor, d.sm_count,
                d.total_bytes / 1073741824.0, r.peak_flops / 1e12, Token(r.peak_source).c_str());
  }
  for (const ModelRun& m : r.models) {
    const BenchConfig& b = m.b;
    if (m.gpu) {
      std::printf(
          "gpu model=%s dtype=%s tokens_per_s=%.0f mfu=%.4f step_s=%.5f batch=%d seq_len=%d "
          "params=%lld skipped=%d attention=%s flops_per_token=%.6g peak_tflops=%.1f\n",
          b.model_name.c_str(), dtype.c_str(), m.gpu->tokens_per_s, m.gpu->mfu, m.gpu->step_s,
          b.batch, b.seq_len, static_cast<long long>(m.gpu->params), m.gpu->skipped,
          Token(m.gpu->attention).c_str(), Gpt2FlopsPerToken(b.model, b.seq_len),
          r.peak_flops / 1e12);
    }
    if (m.offload) {
      for (const OffloadRow& o : m.offload->rows) {
        std::printf(
            "gpu offload=%s params=%lld step_s=%.5f vs_gpu=%.3f model=%s dtype=%s batch=%d "
            "seq_len=%d shards=%d d2h_exposed_s=%.5f h2d_in_forward=%.3f\n",
            o.name.c_str(), static_cast<long long>(m.offload->params), o.step_s,
            m.gpu ? o.step_s / m.gpu->step_s : 0.0, b.model_name.c_str(), dtype.c_str(), b.batch,
            b.seq_len, o.name.rfind("server", 0) == 0 ? absl::GetFlag(FLAGS_shards) : 0,
            o.d2h_exposed_s, o.h2d_in_forward);
      }
      const std::optional<double> local = m.offload->StepSeconds("inprocess");
      const std::optional<double> served = m.offload->StepSeconds("server");
      if (local && served && m.gpu) {
        std::printf(
            "gpu offload_ratio model=%s server_vs_inprocess=%.3f inprocess_vs_gpu=%.3f "
            "server_vs_gpu=%.3f\n",
            b.model_name.c_str(), *served / *local, *local / m.gpu->step_s,
            *served / m.gpu->step_s);
      }
    }
    if (m.pipeline && r.transfer) {
      const PipelineTransfer& p = *m.pipeline;
      const TransferResult& t = *r.transfer;
      std::printf(
          "gpu pipeline model=%s bytes=%lld h2d_gbps=%.2f d2h_gbps=%.2f ring_h2d_gbps=%.2f "
          "ring_d2h_gbps=%.2f h2d_vs_bound=%.3f d2h_vs_bound=%.3f registered=%s\n",
          b.model_name.c_str(), static_cast<long long>(p.bytes), Gbps(p.bytes, p.h2d_s),
          Gbps(p.bytes, p.d2h_s), Gbps(p.bytes, p.ring_h2d_s), Gbps(p.bytes, p.ring_d2h_s),
          Gbps(p.bytes, p.h2d_s) / Gbps(t.bytes, t.h2d_s),
          Gbps(p.bytes, p.d2h_s) / Gbps(t.bytes, t.d2h_s),
          p.registered_error.empty() ? "yes" : Token(p.registered_error).c_str());
    }
    if (!m.error.empty()) {
      std::printf("gpu error model=%s what=%s\n", b.model_name.c_str(), Token(m.error).c_str());
    }
  }
  if (r.transfer) {
    const TransferResult& t = *r.transfer;
    std::printf(
        "gpu transfer bytes=%lld h2d_gbps=%.2f d2h_gbps=%.2f step_bytes_each_way=%lld "
        "step_h2d_floor_s=%.5f step_d2h_floor_s=%.5f\n",
        static_cast<long long>(t.bytes), Gbps(t.bytes, t.h2d_s), Gbps(t.bytes, t.d2h_s),
        static_cast<long long>(t.step_bytes_each_way), t.step_bytes_each_way * t.h2d_s / t.bytes,
        t.step_bytes_each_way * t.d2h_s / t.bytes);
  }
  for (const HostRow& h : r.host) {
    if (!h.skipped.empty()) {
      std::printf("gpu host model=%s params=%lld skipped=%s\n", h.model.c_str(),
                  static_cast<long long>(h.params), Token(h.skipped).c_str());
      continue;
    }
    std::printf(
        "gpu host model=%s params=%lld dtype=%s threads=%d adam_s=%.5f roofline_s=%.5f "
        "ratio=%.3f bytes_each_way=%lld\n",
        h.model.c_str(), static_cast<long long>(h.params), dtype.c_str(), h.threads, h.adam_s,
        h.roofline_s, h.roofline_s / h.adam_s, static_cast<long long>(h.bytes_each_way));
  }
  if (r.plan) {
    const PlanResult& p = *r.plan;
    std::printf(
        "gpu plan memory_gib=%.1f offload_params=%lld offload_model=%s gpu_only_params=%lld "
        "gpu_only_model=%s ratio=%.2f batch=%d seq_len=%d dtype=%s checkpointing=%d "
        "host_gib=%.1f offload_binds=%s gpu_only_binds=%s gradient_bucket_mb=%.1f\n",
        p.memory_gib, static_cast<long long>(p.offload_params), p.offload_model.c_str(),
        static_cast<long long>(p.gpu_only_params), p.gpu_only_model.c_str(), p.ratio, p.batch,
        p.seq_len, std::string(DTypeName(p.dtype)).c_str(), p.checkpointing ? 1 : 0, p.host_gib,
        p.offload_binds.c_str(), p.gpu_only_binds.c_str(), p.gradient_bucket_mb);
    std::printf(
        "gpu plan_zero3 memory_gib=%.1f window_layers=%d window_params=%lld window_model=%s "
        "ranks=%d stage3_params=%lld stage3_model=%s\n",
        p.memory_gib, p.window_layers, static_cast<long long>(p.window_params),
        p.window_model.c_str(), p.ranks, static_cast<long long>(p.stage3_params),
        p.stage3_model.c_str());
  }
  for (const LargestRow& l : r.largest) {
    if (!l.error.empty()) {
      std::printf("gpu largest side=%s error=%s planned_model=%s\n", l.side.c_str(),
                  Token(l.error).c_str(),
                  l.planned.num_layers > 0 ? Token(DescribeConfig(l.planned)).c_str() : "none");
      continue;
    }
    std::printf(
        "gpu largest side=%s params=%lld layers=%d channels=%d heads=%d step_s=%.5f tflops=%.2f "
        "peak_device_gib=%.2f planned_device_gib=%.2f binds=%s planned_layers=%d tries=%d "
        "batch=%d seq_len=%d dtype=%s device_free_gib=%.1f host_gib=%.1f\n",
        l.side.c_str(), static_cast<long long>(l.params), l.model.num_layers, l.model.channels,
        l.model.num_heads, l.step_s, l.tflops, l.peak_device_bytes / 1073741824.0,
        l.planned_device_bytes / 1073741824.0, l.binds.c_str(), l.planned.num_layers, l.tries,
        l.batch, l.seq_len, std::string(DTypeName(l.dtype)).c_str(), l.device_free_gib, l.host_gib);
  }
  if (const double ratio = LargestRatio(r.largest); ratio > 0) {
    std::printf("gpu largest ratio=%.3f\n", ratio);
  }
  std::fflush(stdout);
}

// Both sides of --largest, offload first; false unless both trained.
bool RunLargestRows(int device, DType dtype, Results* r) {
  for (const bool gpu_only : {false, true}) {
    r->largest.push_back(RunLargest(gpu_only, device, dtype));
  }
  return LargestRatio(r->largest) > 0;
}

int Fail(const Results& r, const char* what, const absl::Status& status) {
  Report(r);  // what was measured before the failure still counts
  std::fprintf(stderr, "bench_gpu: %s: %s\n", what, status.ToString().c_str());
  return 1;
}

int Run() {
  absl::StatusOr<std::vector<BenchConfig>> configs = ConfigsFromFlags();
  if (!configs.ok()) {
    std::fprintf(stderr, "bench_gpu: %s\n", std::string(configs.status().message()).c_str());
    return 2;
  }
  const DType dtype = configs->front().dtype;
  Results r;
  const double plan_gib = absl::GetFlag(FLAGS_plan_memory_gib);
  const bool largest_only = absl::GetFlag(FLAGS_largest_only);

  if (absl::GetFlag(FLAGS_host_rows) && !largest_only) {
    for (const auto& [name, model] :
         {std::pair<std::string, Gpt2Config>{"gpt2-124m", Gpt2Config{50257, 1024, 12, 12, 768}},
          std::pair<std::string, Gpt2Config>{"gpt2-xl", Gpt2Config{50257, 1024, 48, 25, 1600}}}) {
      std::fprintf(stderr, "bench_gpu: host Adam for %s\n", name.c_str());
      r.host.push_back(RunHostRow(name, model, dtype));
    }
  }
  if (absl::Status available = CudaDeviceAvailable(); !available.ok()) {
    if (plan_gib > 0 && !largest_only) {
      absl::StatusOr<PlanResult> plan = RunPlan(plan_gib, dtype);
      if (!plan.ok()) return Fail(r, "planner", plan.status());
      r.plan = *plan;
    }
    if (plan_gib > 0 || !r.host.empty()) Report(r);
    std::printf("bench_gpu: no GPU, nothing to measure: %s\n",
                std::string(available.message()).c_str());
    return absl::GetFlag(FLAGS_allow_no_gpu) ? 0 : 1;
  }

  const int device = absl::GetFlag(FLAGS_device);
  absl::StatusOr<CudaDeviceInfo> info = UseCudaDevice(device);
  if (!info.ok()) return Fail(r, "device", info.status());
  r.device = *info;
  if (absl::GetFlag(FLAGS_peak_tflops) > 0) {
    r.peak_flops = absl::GetFlag(FLAGS_peak_tflops) * 1e12;
    r.peak_source = "--peak_tflops";
  } else {
    r.peak_flops = info->peak_bf16_flops;
    r.peak_source = info->peak_source;
  }
  std::fprintf(stderr, "bench_gpu: %s\n", DescribeCudaDevice(*info).c_str());
  if (largest_only) {
    const bool trained = RunLargestRows(device, dtype, &r);
    Report(r);
    return trained ? 0 : 1;
  }

  {
    absl::StatusOr<TransferResult> transfer = RunTransfers(static_cast<int64_t>(DTypeSize(dtype)) *
                                                           Gpt2NumParams(configs->front().model));
    if (!transfer.ok()) return Fail(r, "transfers", transfer.status());
    r.transfer = *transfer;
  }

  // Each model on its own: one that does not fit or fails leaves the others' rows standing.
  bool failed = false;
  for (size_t i = 0; i < configs->size(); ++i) {
    ModelRun& m = r.models.emplace_back();
    m.b = (*configs)[i];
    absl::Status status;
    if (absl::StatusOr<GpuResult> gpu = RunGpuResident(m.b, device, r.peak_flops); gpu.ok()) {
      m.gpu = *gpu;
    } else {
      status =
          absl::Status(gpu.status().code(), absl::StrCat("GPU-resident: ", gpu.status().message()));
    }
    if (status.ok() && absl::GetFlag(FLAGS_offload)) {
      OffloadResult offload;
      const absl::Status s =
          RunOffload(m.b, device, i == 0 || absl::GetFlag(FLAGS_all_rows_all_models), &offload);
      m.offload = offload;
      if (!s.ok()) status = absl::Status(s.code(), absl::StrCat("offload: ", s.message()));
    }
    // The transfer rows need neither of the above (a CUDA error that poisoned the context fails
    // them too, saying so).
    if (absl::StatusOr<PipelineTransfer> pipeline = RunPipelineTransfers(m.b); pipeline.ok()) {
      m.pipeline = *pipeline;
    } else if (status.ok()) {
      status = absl::Status(pipeline.status().code(),
                            absl::StrCat("transfers: ", pipeline.status().message()));
    }
    if (!status.ok()) {
      m.error = std::string(status.message());
      failed = true;
      std::fprintf(stderr, "bench_gpu: %s: %s\n", m.b.model_name.c_str(), m.error.c_str());
    }
  }

  if (absl::GetFlag(FLAGS_largest) && !RunLargestRows(device, dtype, &r)) failed = true;

  absl::StatusOr<PlanResult> plan =
      RunPlan(plan_gib > 0 ? plan_gib : info->total_bytes / 1073741824.0, dtype);
  if (!plan.ok()) return Fail(r, "planner", plan.status());
  r.plan = *plan;
  Report(r);
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace offload

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return offload::Run();
}
