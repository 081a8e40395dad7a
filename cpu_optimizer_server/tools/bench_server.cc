// bench_server: parameters per second through a full optimizer step over gRPC on loopback
// (16-bit gradients in, commit, 16-bit parameters out), against the Adam kernel alone on the same
// state, threads and machine, measured in the same process:
//
//   server transport=grpc n=67108864 ranges=1 gparams_per_s=... kernel_gparams_per_s=... ratio=...
//
// and the same full step through the other data planes on the same job and server (rows
// transport=shm, zero-copy, and transport=shm-copy, through the trainer's own buffers, see
// StepAllRangesVia; and where the build has UCX, transport=ucx; UCX_TLS applies, both sides of
// the exchange reading it in this process), each against the same kernel-alone time:
//
//   server transport=shm grad=fp16 n=... ranges=1 threads=... gparams_per_s=... ratio=...
//   step_ms=...
//
// The server runs in this process but every byte crosses a real TCP connection on 127.0.0.1.
// The same run also moves a step's bytes (16-bit gradients in, then 16-bit parameters out)
// through a plain TCP socket pair on loopback: the bound the medium sets on any TCP transport,
// printed as tcp_bound_gparams_per_s.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_split.h"
#include "base/host_buffer.h"
#include "cpu_optimizer_server/grpc/optimizer_client.h"
#include "cpu_optimizer_server/grpc/optimizer_service.h"
#include "cpu_optimizer_server/shard/shard_store.h"
#include "cpu_optimizer_server/shm/shm_transport.h"
#include "cpu_optimizer_server/tools/range_driver.h"
#include "cpu_optimizer_server/tools/tcp_bound.h"
#include "cpu_optimizer_server/transport/step_transport.h"
#ifdef OFFLOAD_HAVE_UCX
#include "cpu_optimizer_server/ucx/ucx_transport.h"
#endif

ABSL_FLAG(int64_t, n, int64_t{64} << 20, "parameters in the job");
ABSL_FLAG(int, ranges, 1, "ranges the job is cut into, each stepped by its own stream (rank)");
ABSL_FLAG(int, threads, 0, "Adam worker threads (0: all cores)");
ABSL_FLAG(int, channels, 2, "client channels (connections)");
ABSL_FLAG(int64_t, chunk_kib, 4096, "gradient chunk payload");
ABSL_FLAG(int, steps, 5, "timed steps (after one warm-up); the best is reported");
ABSL_FLAG(std::string, simd, "auto", "kernel path");
ABSL_FLAG(std::string, grad, "fp16", "fp16 or bf16 gradients and parameters");
ABSL_FLAG(std::string, transports, "grpc,shm,shm-copy,ucx",
          "data planes to step through (ucx only where the build has UCX)");

namespace offload {
namespace {

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Step `step` of every range at once through `transport`, one thread per range (as ranks would):
// the same exchange as StepAllRanges, through any data plane. zero_copy (shared memory): each
// range's gradients are written into the plane's gradient area, standing for the trainer's own
// rounding, which writes them once on every plane; the longest such write is returned in
// *produce_s for the caller to take out of the step, as no other plane counts it. The parameters
// are taken where the shard wrote them.
absl::Status StepAllRangesVia(StepTransport* transport, bool zero_copy, const std::string& job_id,
                              const std::vector<RangeSpec>& ranges, uint64_t step,
                              const uint16_t* grads, DType dtype, double lr, uint16_t* params,
                              double* produce_s) {
  std::vector<absl::Status> status(ranges.size());
  std::vector<double> produced(ranges.size(), 0.0);
  auto one = [&](size_t i) {
    const RangeSpec& r = ranges[i];
    auto stream = transport->OpenStep(job_id, static_cast<uint32_t>(i), r.offset, r.length, step);
    if (!stream.ok()) {
      status[i] = stream.status();
      return;
    }
    if (!zero_copy) {
      status[i] = (*stream)->SendGradients(r.offset, grads + r.offset, dtype, r.length);
      if (!status[i].ok()) return;
      status[i] = (*stream)->Commit(lr, 1.0f, false, params + r.offset).status();
      return;
    }
    status[i] = ExchangeInPlace(**stream, r.offset, grads + r.offset, dtype, r.length,
                                /*send=*/true, lr, /*skip=*/false, &produced[i])
                    .status();
  };
  std::vector<std::thread> threads;
  for (size_t i = 1; i < ranges.size(); ++i) threads.emplace_back(one, i);
  one(0);
  for (std::thread& t : threads) t.join();
  *produce_s = *std::max_element(produced.begin(), produced.end());
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

int Run() {
  const int64_t n = absl::GetFlag(FLAGS_n);
  const int num_ranges = std::max(1, absl::GetFlag(FLAGS_ranges));
  const DType dtype = absl::GetFlag(FLAGS_grad) == "bf16" ? DType::kBf16 : DType::kFp16;
  absl::StatusOr<SimdPath> path = ParseSimdPath(absl::GetFlag(FLAGS_simd));
  if (!path.ok()) {
    std::fprintf(stderr, "bench_server: %s\n", path.status().ToString().c_str());
    return 2;
  }
  ThreadPool::Options pool_options;
  pool_options.num_threads = absl::GetFlag(FLAGS_threads);
  ThreadPool pool(pool_options);
  ShardOptions shard_options;
  shard_options.memory_limit_bytes = int64_t{20} << 30;
  ShardStore store(shard_options, &pool, *path);
  ServerOptions server_options;
  server_options.listen_address = "127.0.0.1:0";
  auto server = OptimizerServer::Start(server_options, &store);
  if (!server.ok()) {
    std::fprintf(stderr, "bench_server: %s\n", server.status().ToString().c_str());
    return 1;
  }
  ClientOptions client_options;
  client_options.address = "127.0.0.1:" + std::to_string((*server)->port());
  client_options.num_channels = absl::GetFlag(FLAGS_channels);
  client_options.chunk_bytes = absl::GetFlag(FLAGS_chunk_kib) << 10;
  auto client = OptimizerClient::Connect(client_options);
  if (!client.ok()) {
    std::fprintf(stderr, "bench_server: %s\n", client.status().ToString().c_str());
    return 1;
  }

  // The job: n parameters cut into equal ranges, weights N(0, 1), gradients N(0, 0.01).
  const std::vector<RangeSpec> ranges = BalancedRanges(n, num_ranges);
  AdamHyperParams adam;
  adam.lr = 1e-4f;
  adam.weight_decay = 0.01f;
  if (auto r = (*client)->CreateJob(MakeCreateJobRequest("bench", ranges, adam, dtype)); !r.ok()) {
    std::fprintf(stderr, "bench_server: %s\n", r.status().ToString().c_str());
    return 1;
  }
  std::vector<float> weights(n);
  std::vector<uint16_t> grads(n), params(n);
  {
    std::mt19937 rng(1);
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (int64_t i = 0; i < n; ++i) {
      weights[i] = d(rng);
      const float g = 0.01f * d(rng);
      grads[i] = dtype == DType::kBf16 ? FloatToBf16(g) : FloatToFp16(g);
    }
  }
  if (auto s = (*client)->LoadState("bench", v1::STATE_TENSOR_MASTER_WEIGHTS, 0, weights.data(), n);
      !s.ok()) {
    std::fprintf(stderr, "bench_server: %s\n", s.ToString().c_str());
    return 1;
  }
  weights.clear();
  weights.shrink_to_fit();

  // Kernel alone: the same pool pass over the job's state as the commits run, no network.
  std::shared_ptr<Job> job = *store.FindJob("bench");
  double kernel_best = 1e30;
  {
    std::vector<uint16_t> out(n);
    const AdamStepScalars scalars = ComputeAdamStepScalars(adam, adam.lr, 1, 1.0f);
    const AdamKernelFn kernel = store.adam_kernel();
    for (int it = 0; it < absl::GetFlag(FLAGS_steps) + 1; ++it) {
      const auto t0 = std::chrono::steady_clock::now();
      for (const auto& range : job->ranges) {
        RangeState* r = range.get();
        const int64_t base = r->spec.offset;
        store.ParallelTiles(0, r->spec.length, [&](int64_t lo, int64_t hi) {
          AdamSpan span{
              grads.data() + base + lo, dtype, r->param + lo, r->exp_avg + lo, r->exp_avg_sq + lo,
              out.data() + base + lo,   dtype, hi - lo};
          kernel(scalars, span);
        });
      }
      const double s = Seconds(t0, std::chrono::steady_clock::now());
      if (it > 0) kernel_best = std::min(kernel_best, s);
    }
  }

  const std::string transports = absl::GetFlag(FLAGS_transports);
  auto wanted = [&](const char* plane) {
    for (absl::string_view t : absl::StrSplit(transports, ',')) {
      if (t == plane) return true;
    }
    return false;
  };
  const double kernel_rate = n / kernel_best / 1e9;
  int rc = 0;
  // Full steps through the service, one stream per range in parallel (as ranks would).
  int step = 0;
  if (wanted("grpc")) {
    double step_best = 1e30;
    for (int it = 0; it <= absl::GetFlag(FLAGS_steps); ++it) {
      ++step;
      const auto t0 = std::chrono::steady_clock::now();
      const absl::Status status = StepAllRanges(client->get(), "bench", ranges, step, grads.data(),
                                                dtype, adam.lr, 1.0f, params.data());
      const double s = Seconds(t0, std::chrono::steady_clock::now());
      if (!status.ok()) {
        std::fprintf(stderr, "bench_server: step %d: %s\n", step, status.ToString().c_str());
        return 1;
      }
      if (it > 0) step_best = std::min(step_best, s);
    }
    double tcp_best = 1e30;
    for (int it = 0; it < absl::GetFlag(FLAGS_steps); ++it) {
      tcp_best = std::min(tcp_best, TcpBothWaysSeconds(n * DTypeSize(dtype)));
    }
    const double step_rate = n / step_best / 1e9;
    std::printf(
        "server transport=grpc grad=%s n=%lld ranges=%d threads=%d channels=%d chunk_kib=%lld "
        "gparams_per_s=%.3f kernel_gparams_per_s=%.3f ratio=%.2f step_ms=%.1f "
        "tcp_bound_gparams_per_s=%.3f ratio_to_tcp=%.2f\n",
        std::string(DTypeName(dtype)).c_str(), static_cast<long long>(n), num_ranges,
        pool.num_threads(), absl::GetFlag(FLAGS_channels),
        static_cast<long long>(absl::GetFlag(FLAGS_chunk_kib)), step_rate, kernel_rate,
        step_rate / kernel_rate, step_best * 1e3, n / tcp_best / 1e9,
        step_rate / (n / tcp_best / 1e9));
  }

  // The same full steps through the other data planes, on the same job, server and state.
  for (const char* plane : {"shm", "shm-copy", "ucx"}) {
    if (!wanted(plane)) continue;
    const bool zero_copy = std::string(plane) == "shm";
    absl::StatusOr<std::unique_ptr<StepTransport>> transport =
        absl::UnimplementedError("this build has no UCX");
    if (std::string(plane) != "ucx") {
      absl::Status probe = ProbeShm(client->get());
      transport = probe.ok() ? CreateShmTransport(client->get()) : probe;
#ifdef OFFLOAD_HAVE_UCX
    } else {
      absl::Status probe = ProbeUcx(client->get());
      UcxOptions ucx;
      ucx.chunk_bytes = absl::GetFlag(FLAGS_chunk_kib) << 10;
      transport = probe.ok() ? CreateUcxTransport(client->get(), ucx) : probe;
#endif
    }
    if (!transport.ok()) {
      std::fprintf(stderr, "bench_server: transport=%s: %s\n", plane,
                   transport.status().ToString().c_str());
      rc = 1;
      continue;
    }
    double best = 1e30;
    absl::Status status;
    for (int it = 0; it <= absl::GetFlag(FLAGS_steps) && status.ok(); ++it) {
      ++step;
      double produce_s = 0;
      const auto t0 = std::chrono::steady_clock::now();
      status = StepAllRangesVia(transport->get(), zero_copy, "bench", ranges, step, grads.data(),
                                dtype, adam.lr, params.data(), &produce_s);
      const double s = Seconds(t0, std::chrono::steady_clock::now()) - produce_s;
      if (it > 0) best = std::min(best, s);  // the first step attaches the plane
    }
    if (!status.ok()) {
      std::fprintf(stderr, "bench_server: transport=%s step %d: %s\n", plane, step,
                   status.ToString().c_str());
      rc = 1;
      continue;
    }
    const double rate = n / best / 1e9;
    std::printf(
        "server transport=%s grad=%s n=%lld ranges=%d threads=%d gparams_per_s=%.3f "
        "kernel_gparams_per_s=%.3f ratio=%.2f step_ms=%.1f\n",
        plane, std::string(DTypeName(dtype)).c_str(), static_cast<long long>(n), num_ranges,
        pool.num_threads(), rate, kernel_rate, rate / kernel_rate, best * 1e3);
  }
  return rc;
}

}  // namespace
}  // namespace offload

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  offload::KeepFreedMemoryForReuse();
  return offload::Run();
}
