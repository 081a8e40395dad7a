// Training-step throughput of the CPU backend: fast kernels vs the naive reference, in one
// process (ARCHITECTURE.md section 9: fast >= 2x naive). A step is Forward + Backward on the same
// batch (no optimizer). The two sets alternate step by step so drift of the shared machine hits
// both alike; each reports its best and median step after warm-up steps.
//
//   OMP_NUM_THREADS=2 bench_gpt2 [--layers=4] [--channels=128] [--heads=4] [--vocab=256]
//                                [--seq=64] [--batch=8] [--iters=10] [--warmup=2] [--fast_only]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "gpu_trainer/model/gpt2.h"
#include "model_spec/gpt2_config.h"
#include "model_spec/param_layout.h"

ABSL_FLAG(int, layers, 4, "transformer blocks");
ABSL_FLAG(int, channels, 128, "model width C");
ABSL_FLAG(int, heads, 4, "attention heads");
ABSL_FLAG(int, vocab, 256, "vocabulary size");
ABSL_FLAG(int, seq, 64, "sequence length T (also the context length)");
ABSL_FLAG(int, batch, 8, "batch size B");
ABSL_FLAG(int, iters, 10, "timed steps per kernel set");
ABSL_FLAG(int, warmup, 2, "untimed steps per kernel set first");
ABSL_FLAG(bool, fast_only, false, "time only the fast set (for profiling; no ratio)");

namespace offload {
namespace {

struct Timing {
  std::vector<double> seconds;
  double Best() const { return *std::min_element(seconds.begin(), seconds.end()); }
  double Median() const {
    std::vector<double> s = seconds;
    std::sort(s.begin(), s.end());
    return s[s.size() / 2];
  }
};

int Run() {
  Gpt2Config c;
  c.num_layers = absl::GetFlag(FLAGS_layers);
  c.channels = absl::GetFlag(FLAGS_channels);
  c.num_heads = absl::GetFlag(FLAGS_heads);
  c.vocab_size = absl::GetFlag(FLAGS_vocab);
  c.context_length = absl::GetFlag(FLAGS_seq);
  const int B = absl::GetFlag(FLAGS_batch), T = c.context_length;
  const int iters = std::max(1, absl::GetFlag(FLAGS_iters));
  const int warmup = std::max(0, absl::GetFlag(FLAGS_warmup));

  const CpuKernelSet sets[2] = {CpuKernelSet::kNaive, CpuKernelSet::kFast};
  std::unique_ptr<Gpt2Cpu> models[2];
  for (int s = 0; s < 2; s++) {
    absl::StatusOr<std::unique_ptr<Gpt2Cpu>> m = Gpt2Cpu::Create(c, B, T, sets[s]);
    if (!m.ok()) {
      std::fprintf(stderr, "bench_gpt2: %s\n", m.status().ToString().c_str());
      return 1;
    }
    models[s] = std::move(*m);
  }
  const int64_t n = Gpt2NumParams(c);
  std::vector<float> params(n), grads(n);
  InitGpt2Params(c, 1, params.data());
  std::vector<int32_t> inputs(int64_t{B} * T), targets(int64_t{B} * T);
  for (size_t i = 0; i < inputs.size(); i++) {  // any fixed tokens will do
    inputs[i] = static_cast<int32_t>((i * 7919) % c.vocab_size);
    targets[i] = static_cast<int32_t>((i * 104729 + 1) % c.vocab_size);
  }

  auto step = [&](Gpt2Cpu& model) {
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<float> loss = model.Forward(params.data(), inputs.data(), targets.data(), B, T);
    if (!loss.ok() || !model.Backward(params.data(), 1.0f, grads.data(), nullptr).ok()) {
      std::fprintf(stderr, "bench_gpt2: step failed\n");
      std::exit(1);
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  Timing timings[2];
  for (int i = 0; i < warmup + iters; i++) {
    for (int s = absl::GetFlag(FLAGS_fast_only) ? 1 : 0; s < 2; s++) {
      const double seconds = step(*models[s]);
      if (i >= warmup) timings[s].seconds.push_back(seconds);
    }
  }

  const double tokens = static_cast<double>(B) * T;
  const double flops = Gpt2FlopsPerToken(c, T) * tokens;
  std::printf(
      "GPT-2 L=%d C=%d H=%d V=%d, B=%d T=%d: %lld params, %.3f GFLOP per step, "
      "%d OpenMP threads, best/median of %d steps\n",
      c.num_layers, c.channels, c.num_heads, c.vocab_size, B, T, static_cast<long long>(n),
      flops / 1e9, omp_get_max_threads(), iters);
  std::printf("%-6s %12s %12s %14s %14s %10s\n", "set", "best ms", "median ms", "tokens/s best",
              "tokens/s med", "GFLOP/s");
  const char* names[2] = {"naive", "fast"};
  if (absl::GetFlag(FLAGS_fast_only)) timings[0] = timings[1];
  for (int s = 0; s < 2; s++) {
    std::printf("%-6s %12.2f %12.2f %14.0f %14.0f %10.2f\n", names[s], timings[s].Best() * 1e3,
                timings[s].Median() * 1e3, tokens / timings[s].Best(), tokens / timings[s].Median(),
                flops / timings[s].Best() / 1e9);
  }
  std::printf("fast / naive tokens/s: %.2fx (best), %.2fx (median); target >= 2x\n",
              timings[0].Best() / timings[1].Best(), timings[0].Median() / timings[1].Median());
  return 0;
}

}  // namespace
}  // namespace offload

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return offload::Run();
}
