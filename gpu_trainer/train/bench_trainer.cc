// bench_trainer: training-step throughput of the CPU backend against the naive reference
// kernels, and the step time with the optimizer behind local gRPC shards against the same
// optimizer in process. Both pairs run in the same process, one after the other, on the same
// data and weights, so their ratios hold even on a noisy shared machine.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "cpu_optimizer_server/grpc/optimizer_service.h"
#include "cpu_optimizer_server/shard/shard_store.h"
#include "gpu_trainer/model/cpu_runtime.h"
#include "gpu_trainer/train/trainer.h"
#include "model_spec/param_layout.h"
#include "model_spec/partition.h"
#include "optimizer_client/backends/inprocess_optimizer.h"
#include "optimizer_client/backends/remote_optimizer.h"

ABSL_FLAG(std::string, data, std::string(OFFLOAD_SOURCE_DIR) + "/data/tinyshakespeare.txt",
          "training text");
ABSL_FLAG(int, layers, 4, "layers");
ABSL_FLAG(int, heads, 4, "heads");
ABSL_FLAG(int, channels, 128, "channels");
ABSL_FLAG(int, batch, 16, "sequences per step");
ABSL_FLAG(int, seq_len, 128, "tokens per sequence");
ABSL_FLAG(int, steps, 10, "timed steps per configuration");
ABSL_FLAG(int, warmup, 2, "untimed steps first");
ABSL_FLAG(int, shards, 1, "optimizer shards");
ABSL_FLAG(std::string, dtype, "fp16", "fp16 or bf16");
ABSL_FLAG(bool, dpu, false,
          "the server run uses the delayed parameter update (after the warm-up steps); the "
          "in-process baseline stays synchronous");
ABSL_FLAG(std::string, transport, "grpc",
          "data plane to the local shards: grpc, shm, ucx, or auto (as gpu_trainer chooses)");

namespace offload {
namespace {

TrainerOptions BenchOptions() {
  TrainerOptions o;
  o.model = Gpt2Config{256, absl::GetFlag(FLAGS_seq_len), absl::GetFlag(FLAGS_layers),
                       absl::GetFlag(FLAGS_heads), absl::GetFlag(FLAGS_channels)};
  o.data = absl::GetFlag(FLAGS_data);
  o.batch = absl::GetFlag(FLAGS_batch);
  o.seq_len = absl::GetFlag(FLAGS_seq_len);
  o.steps = 1 << 30;
  o.param_dtype = absl::GetFlag(FLAGS_dtype) == "bf16" ? DType::kBf16 : DType::kFp16;
  o.adam.set_kind(v1::OPTIMIZER_KIND_ADAMW);
  o.adam.set_lr(1e-3f);
  o.adam.set_beta1(0.9f);
  o.adam.set_beta2(0.95f);
  o.adam.set_eps(1e-8f);
  o.schedule.set_max_lr(1e-3f);
  o.schedule.set_min_lr(1e-4f);
  o.schedule.set_warmup_steps(0);
  o.schedule.set_total_steps(1 << 30);
  return o;
}

// Seconds per training step, after the warm-up steps.
absl::StatusOr<double> TimeSteps(const TrainerOptions& o, OptimizerBackend* backend) {
  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(o, backend));
  if (absl::StatusOr<std::string> s = trainer->Start(); !s.ok()) return s.status();
  for (int i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) {
    if (auto r = trainer->Step(); !r.ok()) return r.status();
  }
  const int steps = absl::GetFlag(FLAGS_steps);
  const absl::Time start = absl::Now();
  for (int i = 0; i < steps; ++i) {
    if (auto r = trainer->Step(); !r.ok()) return r.status();
  }
  // With DPU the last update is still running: it is part of the work timed.
  OFFLOAD_RETURN_IF_ERROR(trainer->Flush());
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start) / steps;
  OFFLOAD_RETURN_IF_ERROR(backend->DropJob());
  return seconds;
}

int Run() {
  TrainerOptions o = BenchOptions();
  const int shards = absl::GetFlag(FLAGS_shards);
  absl::StatusOr<v1::PartitionMap> map = MakePartitionMap(Gpt2NumParams(o.model), 1, shards);
  if (!map.ok()) {
    std::fprintf(stderr, "bench_trainer: %s\n", map.status().ToString().c_str());
    return 1;
  }
  const std::string model =
      absl::StrCat("L", o.model.num_layers, "-C", o.model.channels, "-T", o.seq_len, "-B", o.batch);
  const double tokens = static_cast<double>(o.batch) * o.seq_len;
  auto check = [](const absl::StatusOr<double>& r) {
    if (!r.ok()) std::fprintf(stderr, "bench_trainer: %s\n", r.status().ToString().c_str());
    return r.ok();
  };

  // 1. Fast kernels vs the naive reference, both with the optimizer in process.
  InProcessOptimizer in_process(*map, 0, BestSimdPath());
  o.kernels = CpuKernelSet::kNaive;
  absl::StatusOr<double> naive = TimeSteps(o, &in_process);
  if (!check(naive)) return 1;
  o.kernels = CpuKernelSet::kFast;
  absl::StatusOr<double> fast = TimeSteps(o, &in_process);
  if (!check(fast)) return 1;
  std::printf(
      "trainer backend=cpu model=%s params=%lld tokens_per_s=%.0f naive_tokens_per_s=%.0f "
      "ratio=%.2f gflops=%.1f blas=%s\n",
      model.c_str(), static_cast<long long>(map->num_params()), tokens / *fast, tokens / *naive,
      *naive / *fast, Gpt2FlopsPerToken(o.model, o.seq_len) * tokens / *fast / 1e9,
      BlasCoreName().c_str());

  // 2. The optimizer behind gRPC shards on loopback vs in process, fast kernels both.
  ThreadPool pool(ThreadPool::Options{});
  std::vector<std::unique_ptr<ShardStore>> stores;
  std::vector<std::unique_ptr<OptimizerServer>> servers;
  std::vector<std::string> addresses;
  for (int s = 0; s < shards; ++s) {
    stores.push_back(std::make_unique<ShardStore>(ShardOptions{}, &pool, BestSimdPath()));
    ServerOptions options;
    options.listen_address = "127.0.0.1:0";
    auto server = OptimizerServer::Start(options, stores.back().get());
    if (!server.ok()) {
      std::fprintf(stderr, "bench_trainer: %s\n", server.status().ToString().c_str());
      return 1;
    }
    addresses.push_back(absl::StrCat("127.0.0.1:", (*server)->port()));
    servers.push_back(std::move(*server));
  }
  absl::StatusOr<TransportChoice> transport = ParseTransportChoice(absl::GetFlag(FLAGS_transport));
  if (!transport.ok()) {
    std::fprintf(stderr, "bench_trainer: %s\n", transport.status().ToString().c_str());
    return 1;
  }
  auto remote = RemoteOptimizer::Connect(*map, addresses, ClientOptions{}, *transport);
  if (!remote.ok()) {
    std::fprintf(stderr, "bench_trainer: %s\n", remote.status().ToString().c_str());
    return 1;
  }
  TrainerOptions served_options = o;
  served_options.dpu = absl::GetFlag(FLAGS_dpu);
  served_options.dpu_warmup_steps = static_cast<uint64_t>(absl::GetFlag(FLAGS_warmup));
  absl::StatusOr<double> served = TimeSteps(served_options, remote->get());
  if (!check(served)) return 1;
  absl::StatusOr<double> local = TimeSteps(o, &in_process);
  if (!check(local)) return 1;
  std::printf(
      "offload mode=server transport=%s dpu=%d shards=%d model=%s step_s=%.4f "
      "inprocess_step_s=%.4f ratio=%.3f\n",
      (*remote)->TransportNames().c_str(), served_options.dpu ? 1 : 0, shards, model.c_str(),
      *served, *local, *served / *local);
  return 0;
}

}  // namespace
}  // namespace offload

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return offload::Run();
}
