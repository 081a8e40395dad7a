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
#include "gpu_trainer/cuda/bench_gpu_report.h"
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

namespace offload::bench_gpu {
namespace {

constexpr uint64_t kSeed = 1337;
constexpr float kMaxGradNorm = 1.0f;  // the Trainer's default clipping, so both rows clip alike

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
// ---- 1. GPU-resident training -------------------------------------------------------------

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

// ---- 4. The host's share of an offload step --------------------------------------------

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
  r.shards = absl::GetFlag(FLAGS_shards);
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
}  // namespace offload::bench_gpu

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return offload::bench_gpu::Run();
}
