// offload_synthetic_train: drives a training loop against a running cpu_optimizer_server through
// its public API, the way a trainer rank does, on a synthetic objective: the parameters w learn
// a fixed target t under loss = mean((w - t)^2) / 2. The trainer
// computes with the 16-bit weights the server sends back and offloads 16-bit gradients, so the
// loss it prints falls only if the whole round trip works.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "base/host_buffer.h"
#include "base/security/security.h"
#include "base/splitmix64.h"
#include "cpu_optimizer_server/grpc/shard_client.h"
#include "cpu_optimizer_server/tools/range_driver.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "optimizer server address");
ABSL_FLAG(std::string, job, "synthetic", "job id");
ABSL_FLAG(int64_t, n, int64_t{16} << 20, "parameters");
ABSL_FLAG(int, ranges, 1, "ranges (ranks), each stepped by its own stream");
ABSL_FLAG(int, steps, 30, "training steps");
ABSL_FLAG(double, lr, 0.05, "Adam learning rate");
ABSL_FLAG(std::string, dtype, "bf16", "fp16 or bf16 weights and gradients");
ABSL_FLAG(int, channels, 2, "client channels");

namespace offload {
namespace {

int Fail(const char* what, const absl::Status& s) {
  std::fprintf(stderr, "offload_synthetic_train: %s: %s\n", what, s.ToString().c_str());
  return 1;
}

int Run() {
  const int64_t n = absl::GetFlag(FLAGS_n);
  const int num_ranges = std::max(1, absl::GetFlag(FLAGS_ranges));
  const std::string job = absl::GetFlag(FLAGS_job);
  const DType dtype = absl::GetFlag(FLAGS_dtype) == "fp16" ? DType::kFp16 : DType::kBf16;
  auto to16 = [dtype](float f) { return dtype == DType::kFp16 ? FloatToFp16(f) : FloatToBf16(f); };
  auto from16 = [dtype](uint16_t h) {
    return dtype == DType::kFp16 ? Fp16ToFloat(h) : Bf16ToFloat(h);
  };

  ClientOptions options;
  options.address = absl::GetFlag(FLAGS_server);
  options.num_channels = absl::GetFlag(FLAGS_channels);
  // A standalone server's token, as the process tests hand it to their clients (shard_access.h).
  if (const char* token = std::getenv(kShardTokenEnv); token != nullptr) options.token = token;
  auto client = ShardClient::Connect(options);
  if (!client.ok()) return Fail("connect", client.status());

  const std::vector<RangeSpec> ranges = BalancedRanges(n, num_ranges);
  AdamHyperParams adam;  // AdamW, betas (0.9, 0.999), eps 1e-8, no weight decay
  adam.lr = static_cast<float>(absl::GetFlag(FLAGS_lr));
  const v1::CreateJobRequest create = MakeCreateJobRequest(job, ranges, adam, dtype);
  if (auto r = (*client)->CreateJob(create); !r.ok()) return Fail("create job", r.status());

  // Initial weights w0 and target t uniform in [-1, 1), a hash of the element's index: nothing
  // but the 16-bit weights and gradients is stored, 4 bytes per parameter, so n can reach the
  // billions a disk-tier server holds (scripts/disk-tier-run). The weights load in pieces.
  auto uniform = [](uint64_t seed, int64_t i) {
    uint64_t state = seed ^ (static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull);
    return SplitMix64Uniform(&state);
  };
  constexpr uint64_t kWeightSeed = 1234, kTargetSeed = 5678;
  std::vector<uint16_t> weights16(n), grads16(n);
  {
    constexpr int64_t kLoadPiece = int64_t{1} << 26;
    std::vector<float> w0(std::min(n, kLoadPiece));
    for (int64_t at = 0; at < n; at += kLoadPiece) {
      const int64_t m = std::min(kLoadPiece, n - at);
      for (int64_t i = 0; i < m; ++i) {
        w0[i] = uniform(kWeightSeed, at + i);
        weights16[at + i] = to16(w0[i]);
      }
      if (auto s = (*client)->LoadState(job, v1::STATE_TENSOR_MASTER_WEIGHTS, at, w0.data(), m);
          !s.ok()) {
        return Fail("load weights", s);
      }
    }
  }
  std::printf("synthetic training: job=%s params=%lld ranges=%d dtype=%s server=%s\n", job.c_str(),
              static_cast<long long>(n), num_ranges, std::string(DTypeName(dtype)).c_str(),
              options.address.c_str());

  double first_loss = 0, loss = 0, total_s = 0;
  const int steps = absl::GetFlag(FLAGS_steps);
  for (int step = 1; step <= steps; ++step) {
    // "Forward and backward" on the 16-bit weights, as a GPU would compute them.
    const auto t0 = std::chrono::steady_clock::now();
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float diff = from16(weights16[i]) - uniform(kTargetSeed, i);
      sum += static_cast<double>(diff) * diff;
      grads16[i] = to16(diff);  // n * d(loss)/dw
    }
    loss = sum / (2.0 * n);
    if (step == 1) first_loss = loss;
    const auto t1 = std::chrono::steady_clock::now();
    // Adam is invariant to the gradient's scale; folding the 1/n of the mean in would only
    // make eps matter.
    if (auto s = StepAllRanges(client->get(), job, ranges, step, grads16.data(), dtype, adam.lr,
                               1.0f, weights16.data());
        !s.ok()) {
      return Fail("step", s);
    }
    const auto t2 = std::chrono::steady_clock::now();
    const double offload_s = std::chrono::duration<double>(t2 - t1).count();
    total_s += offload_s;
    std::printf(
        "step %3d  loss %.6f  compute_ms %7.1f  offload_step_ms %7.1f  gparams_per_s %.3f\n", step,
        loss, std::chrono::duration<double>(t1 - t0).count() * 1e3, offload_s * 1e3,
        n / offload_s / 1e9);
    std::fflush(stdout);
  }
  std::printf("done: loss %.6f -> %.6f over %d steps, mean offload step %.1f ms (%.3f Gparams/s)\n",
              first_loss, loss, steps, total_s / steps * 1e3, n * steps / total_s / 1e9);
  if (auto s = (*client)->DropJob(job); !s.ok()) return Fail("drop job", s);
  if (!(loss < first_loss)) {
    std::fprintf(stderr, "offload_synthetic_train: loss did not fall\n");
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace offload

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Synthetic training loop against a cpu_optimizer_server.");
  absl::ParseCommandLine(argc, argv);
  offload::KeepFreedMemoryForReuse();
  return offload::Run();
}
