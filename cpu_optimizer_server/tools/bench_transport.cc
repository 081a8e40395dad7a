// bench_transport: bytes per second of one partition's exchange through each data plane
// (ARCHITECTURE.md section 9, "data plane"), against the bound of the plane's medium measured in
// the same run: memcpy of the same bytes for shared memory, a plain TCP socket pair on loopback for
// gRPC and UCX over TCP.
//
// A partition is --mib MiB of 16-bit gradients (n = mib * 2^20 / 2 elements, one range); its
// exchange moves those bytes in and as many bytes of 16-bit parameters out. Each plane runs on its
// own in-process server with only that plane offered (or on the server at --server, see below),
// and is measured in --runs runs after a warm-up; each run times, per plane:
//   in:  OpenStep + SendGradients(the whole partition) + Commit(skip=true). A skipping commit
//        runs no Adam and sends no parameters, but the shard answers it only after it has taken
//        (and validated) every gradient chunk before it, so this is the gradients' journey in.
//   out: OpenStep + Commit of a replay of that step with no gradients: the shard runs no Adam and
//        streams the partition's 16-bit parameters back (converted from its fp32 master weights
//        wave by wave while earlier waves travel: that conversion is the only work in it).
//   exchange = in + out of the same run; gbytes_per_s = 2 * partition bytes / exchange.
// The bound moves the same 2 * partition bytes the same way round, timed in the same run just
// before the plane's exchange: two memcpys (in, then out) between buffers that do not overlap,
// or a writer/reader thread pair over one loopback TCP connection, one direction then the other,
// in 4 MiB send/recv calls. A run's ratio is its bound's time over its exchange's; the table
// shows the median of the runs' ratios and their spread (min-max), and the medians of the times.
// For UCX on one host it also shows CMA's rate (process_vm_readv, 4 MiB calls, in then out):
// the single copy UCX 1.13 has between two processes on one host, and the ceiling of its
// shared-memory path. For information the table also shows a full step (gradients in, Adam,
// parameters out).
//
// Across a network path (two network namespaces joined by a veth, or two hosts; scripts/
// bench-netns): --server=HOST:PORT uses the cpu_optimizer_server there, and --tcp_peer=HOST:PORT
// the TCP bound peer beside it (bench_transport --serve_tcp_bound=PORT), in place of loopback.
//
// Shared memory runs two ways. shm is zero-copy (StepStream::GradientArea and CommitInPlace): the
// gradients are written into the segment where the shard reads them, and the parameters are
// handed over where the shard's Adam pass wrote them. The write stands for the trainer's own
// rounding of its gradients, which on every plane writes them once (elsewhere into its own
// buffer): it is timed apart (produce_ms) and not counted in `in`, as no plane counts it; the
// parameters' consumer (a host-to-device copy, a conversion) is likewise the trainer's own work.
// shm-copy goes through SendGradients and Commit from and into the trainer's buffers, a copy each
// way. gRPC runs two ways too: grpc writes the gradients into the plane's gradient area (gRPC's
// send buffers; timed apart as shm's) and the parameters come into the trainer's buffer, as a
// trainer's backend does; grpc-copy sends from the trainer's buffer, a copy on the way in. UCX
// sends from and receives into the trainer's buffers.
//
// Planes: grpc and grpc-copy (bound tcp), shm and shm-copy (bound memcpy), and where the build has
// UCX: ucx (UCX chooses its transports: TCP on one host unless UCX_TLS says sm,self, since the
// endpoints ask for peer error handling; its bound is memcpy all the same, the medium of one host)
// and ucx-tcp (UCX_TLS=tcp for the server and the trainer, bound tcp). After the table, one line
// per plane:
//
//   transport name=shm bytes=134217728 gbytes_per_s=... bound_gbytes_per_s=... ratio=...
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "base/host_buffer.h"
#include "base/status_macros.h"
#include "cpu_optimizer_server/adam/adam_kernel_internal.h"
#include "cpu_optimizer_server/grpc/optimizer_service.h"
#include "cpu_optimizer_server/grpc/shard_client.h"
#include "cpu_optimizer_server/shard/shard_store.h"
#include "cpu_optimizer_server/tools/bench_planes.h"
#include "cpu_optimizer_server/tools/range_driver.h"
#include "cpu_optimizer_server/tools/run_stats.h"
#include "cpu_optimizer_server/tools/tcp_bound.h"
#include "cpu_optimizer_server/transport/step_transport.h"

ABSL_FLAG(int64_t, mib, 64, "partition: MiB of 16-bit gradients (and as many of parameters)");
ABSL_FLAG(int, runs, 5, "timed runs per plane (after one warm-up); medians and spread reported");
ABSL_FLAG(int, threads, 0, "the shard's worker threads (0: all cores)");
ABSL_FLAG(int64_t, chunk_kib, 4096, "gRPC chunk payload and UCX chunk");
ABSL_FLAG(std::string, dtype, "fp16", "fp16 or bf16 gradients and parameters");
ABSL_FLAG(std::string, transports, "grpc,grpc-copy,shm,shm-copy,ucx,ucx-tcp",
          "planes to measure (ucx and ucx-tcp only where the build has UCX)");
ABSL_FLAG(std::string, server, "",
          "a cpu_optimizer_server to measure against (host:port) instead of one in this process");
ABSL_FLAG(std::string, tcp_peer, "",
          "with --server: the TCP bound peer (host:port) on the server's side of the path");
ABSL_FLAG(int, serve_tcp_bound, 0,
          "serve as the TCP bound peer on this port (for another bench's --tcp_peer); no bench");

namespace offload {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Copies `bytes` in (src -> dst) and out (dst2 -> src2): the same bytes the exchange moves.
double MemcpyBothWaysSeconds(std::vector<char>* in_src, std::vector<char>* in_dst,
                             std::vector<char>* out_src, std::vector<char>* out_dst) {
  const auto t0 = Clock::now();
  std::memcpy(in_dst->data(), in_src->data(), in_src->size());
  std::memcpy(out_dst->data(), out_src->data(), out_src->size());
  return Seconds(t0, Clock::now());
}

// The same two copies through the kernel's cross-memory attach, as UCX's cma transport makes
// them: process_vm_readv from this process's own pid, 4 MiB per call. Negative on an error.
double CmaBothWaysSeconds(std::vector<char>* in_src, std::vector<char>* in_dst,
                          std::vector<char>* out_src, std::vector<char>* out_dst) {
  auto copy = [](const std::vector<char>& src, std::vector<char>* dst) {
    constexpr size_t kCall = 4 << 20;
    for (size_t done = 0; done < src.size();) {
      const size_t m = std::min(kCall, src.size() - done);
      iovec local{dst->data() + done, m};
      iovec remote{const_cast<char*>(src.data()) + done, m};
      const ssize_t k = process_vm_readv(getpid(), &local, 1, &remote, 1, 0);
      if (k <= 0) return false;
      done += static_cast<size_t>(k);
    }
    return true;
  };
  const auto t0 = Clock::now();
  if (!copy(*in_src, in_dst) || !copy(*out_src, out_dst)) return -1;
  return Seconds(t0, Clock::now());
}

// One run of one plane.
struct Sample {
  double in_s = 0, out_s = 0, step_s = 0;
  double produce_s = 0;  // zero-copy: writing the gradients into the segment (not in in_s)
  double bound_s = 0;    // the plane's bound, timed just before
  double cma_s = 0;      // memcpy-bound planes: CMA's time for the same bytes (0: not measured)
  double exchange_s() const { return in_s + out_s; }
};

class Bench {
 public:
  Bench(int64_t n, DType dtype, ThreadPool* pool)
      : n_(n), dtype_(dtype), pool_(pool), grads_(n), params_(n) {
    std::mt19937 rng(1);
    std::normal_distribution<float> d(0.0f, 1.0f);
    weights_.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      weights_[i] = d(rng);
      const float g = 0.01f * d(rng);
      grads_[i] = dtype == DType::kBf16 ? FloatToBf16(g) : FloatToFp16(g);
    }
    for (auto* b : {&a_, &b_, &c_, &d_}) b->assign(n * 2, 1);  // touched before any timing
  }

  // Everything for one plane: its own server (only that plane offered), client, job and
  // transport, torn down before the next plane so no two shards hold the state at once.
  absl::StatusOr<std::vector<Sample>> Measure(const BenchPlane& plane, int runs) {
    ScopedPlaneEnv env(plane);
    return MeasureWithEnv(plane, runs);
  }

 private:
  // The plane's bound for one run, in seconds (negative on an error).
  double Bound(const BenchPlane& plane) {
    if (plane.memory_medium) return MemcpyBothWaysSeconds(&a_, &b_, &c_, &d_);
    const std::string peer = absl::GetFlag(FLAGS_tcp_peer);
    return peer.empty() ? TcpBothWaysSeconds(n_ * 2) : TcpBothWaysSecondsTo(peer, n_ * 2);
  }

  absl::StatusOr<std::vector<Sample>> MeasureWithEnv(const BenchPlane& plane, int runs) {
    ShardOptions shard_options;
    shard_options.memory_limit_bytes = int64_t{20} << 30;
    ShardStore store(shard_options, pool_, BestSimdPath());
    std::unique_ptr<OptimizerServer> server;
    ClientOptions client_options;
    client_options.address = absl::GetFlag(FLAGS_server);
    if (client_options.address.empty()) {
      ServerOptions server_options;
      server_options.listen_address = "127.0.0.1:0";
      server_options.enable_shm = plane.kind == "shm";
      server_options.enable_ucx = plane.kind == "ucx";
      OFFLOAD_ASSIGN_OR_RETURN(server, OptimizerServer::Start(server_options, &store));
      client_options.address = "127.0.0.1:" + std::to_string(server->port());
    }
    client_options.chunk_bytes = absl::GetFlag(FLAGS_chunk_kib) << 10;
    OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<ShardClient> client,
                             ShardClient::Connect(client_options));
    // A job of its own per plane, so a remote server's earlier runs do not matter.
    const std::string job = "bench-transport-" + plane.name;
    client->DropJob(job).IgnoreError();
    AdamHyperParams adam;
    adam.lr = 1e-4f;
    OFFLOAD_RETURN_IF_ERROR(
        client->CreateJob(MakeCreateJobRequest(job, {{0, n_}}, adam, dtype_)).status());
    OFFLOAD_RETURN_IF_ERROR(
        client->LoadState(job, v1::STATE_TENSOR_MASTER_WEIGHTS, 0, weights_.data(), n_));

    OFFLOAD_ASSIGN_OR_RETURN(
        std::unique_ptr<StepTransport> owned,
        OpenBenchPlane(plane, client.get(), absl::GetFlag(FLAGS_chunk_kib) << 10));
    StepTransport* transport = owned != nullptr ? owned.get() : client.get();

    std::vector<Sample> samples;
    uint64_t step = 0;
    // Round 0 is the warm-up: it attaches the plane and touches every buffer on both sides.
    for (int round = 0; round <= runs; ++round) {
      Sample sample;
      sample.bound_s = Bound(plane);
      if (sample.bound_s < 0) return absl::UnavailableError("the plane's bound failed");
      if (plane.kind == "ucx" && plane.memory_medium) {
        sample.cma_s = CmaBothWaysSeconds(&a_, &b_, &c_, &d_);
      }
      // in: the gradients, then a skipping commit (no Adam, no parameters).
      ++step;
      auto t0 = Clock::now();
      OFFLOAD_ASSIGN_OR_RETURN(ExchangeResult r,
                               Exchange(transport, job, plane, step, ExchangeMode::kIn));
      sample.in_s = Seconds(t0, Clock::now()) - r.produce_s;
      sample.produce_s = r.produce_s;
      // out: a replay of that step, which only sends the parameters back.
      t0 = Clock::now();
      OFFLOAD_ASSIGN_OR_RETURN(r, Exchange(transport, job, plane, step, ExchangeMode::kOut));
      sample.out_s = Seconds(t0, Clock::now());
      // For information: a full step, Adam included.
      ++step;
      t0 = Clock::now();
      OFFLOAD_ASSIGN_OR_RETURN(r, Exchange(transport, job, plane, step, ExchangeMode::kStep));
      sample.step_s = Seconds(t0, Clock::now()) - r.produce_s;
      if (round > 0) samples.push_back(sample);
    }
    owned.reset();
    client->DropJob(job).IgnoreError();
    return samples;
  }

  absl::StatusOr<ExchangeResult> Exchange(StepTransport* transport, const std::string& job,
                                          const BenchPlane& plane, uint64_t step,
                                          ExchangeMode mode) {
    OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<StepStream> stream,
                             transport->OpenStep(job, 0, 0, n_, step));
    ExchangeOptions options;
    options.mode = mode;
    options.grad_area = plane.grad_area;
    options.params_in_place = plane.params_in_place;
    return ExchangeRange(*stream, 0, grads_.data(), dtype_, n_, params_.data(), options);
  }

  const int64_t n_;
  const DType dtype_;
  ThreadPool* const pool_;
  std::vector<float> weights_;
  std::vector<uint16_t> grads_, params_;  // (n,) each: the trainer's side of the partition
  std::vector<char> a_, b_, c_, d_;       // (2n,) bytes each: the bounds' buffers
};

int Run() {
  if (const int port = absl::GetFlag(FLAGS_serve_tcp_bound); port > 0) return ServeTcpBound(port);
  const int64_t bytes = absl::GetFlag(FLAGS_mib) << 20;  // one direction
  const int64_t n = bytes / 2;
  const int runs = std::max(1, absl::GetFlag(FLAGS_runs));
  const bool remote = !absl::GetFlag(FLAGS_server).empty();
  ThreadPool::Options pool_options;
  pool_options.num_threads = absl::GetFlag(FLAGS_threads);
  ThreadPool pool(pool_options);

  absl::StatusOr<std::vector<BenchPlane>> parsed =
      ParseBenchPlanes(absl::GetFlag(FLAGS_transports), remote, "bench_transport");
  if (!parsed.ok()) {
    std::fprintf(stderr, "bench_transport: %s\n", std::string(parsed.status().message()).c_str());
    return 2;
  }
  const std::vector<BenchPlane> planes = *std::move(parsed);

  const DType dtype = absl::GetFlag(FLAGS_dtype) == "bf16" ? DType::kBf16 : DType::kFp16;
  // The only work in `out` besides the transfer: the shard's fp32 -> 16-bit conversion of the
  // partition, timed alone on the same pool (the replay overlaps it with sending, wave by wave).
  std::vector<double> convert_s;
  {
    ShardStore store(ShardOptions{}, &pool, BestSimdPath());
    std::vector<float> master(n, 0.25f);
    std::vector<uint16_t> out(n);
    // The conversion a replay runs (step_session.cc): the SIMD one of the store's path.
    const internal::FloatToHalfFn to_half = internal::GetFloatToHalf(store.simd_path());
    for (int it = 0; it <= runs; ++it) {
      const auto t0 = Clock::now();
      store.ParallelTiles(0, n, [&](int64_t lo, int64_t hi) {
        if (to_half != nullptr) {
          to_half(master.data() + lo, dtype, out.data() + lo, hi - lo);
        } else {
          ConvertFromFloat(master.data() + lo, hi - lo, dtype, out.data() + lo);
        }
      });
      if (it > 0) convert_s.push_back(Seconds(t0, Clock::now()));
    }
  }
  Bench bench(n, dtype, &pool);
  struct Row {
    BenchPlane plane;
    std::vector<Sample> samples;
  };
  std::vector<Row> rows;
  int rc = 0;
  for (const BenchPlane& plane : planes) {
    absl::StatusOr<std::vector<Sample>> r = bench.Measure(plane, runs);
    if (!r.ok()) {
      std::fprintf(stderr, "bench_transport: %s: %s\n", plane.name.c_str(),
                   r.status().ToString().c_str());
      rc = 1;
      continue;
    }
    rows.push_back({plane, *r});
  }

  const double moved = 2.0 * static_cast<double>(bytes);  // in + out
  auto median_of = [](const std::vector<Sample>& samples, auto field) {
    std::vector<double> v;
    for (const Sample& s : samples) v.push_back(field(s));
    return SpreadOf(v);
  };
  std::printf(
      "partition: %lld MiB of %s gradients in, as many of parameters out (n=%lld, shard "
      "threads=%d); %d runs after a warm-up, medians; GB = 1e9 bytes; %s\n",
      static_cast<long long>(absl::GetFlag(FLAGS_mib)), std::string(DTypeName(dtype)).c_str(),
      static_cast<long long>(n), pool.num_threads(), runs,
      remote ? ("server " + absl::GetFlag(FLAGS_server) + ", tcp bound to " +
                absl::GetFlag(FLAGS_tcp_peer))
                   .c_str()
             : "server in this process on loopback");
  std::printf("the shard's fp32 -> %s conversion of the partition alone (inside out_ms): %.1f ms\n",
              std::string(DTypeName(dtype)).c_str(), SpreadOf(convert_s).median * 1e3);
  std::printf("%-8s %-6s %8s %8s %8s %8s %8s %8s %6s %11s %8s %10s\n", "plane", "bound", "in_ms",
              "out_ms", "xchg_ms", "in_GB/s", "out_GB/s", "GB/s", "ratio", "[min-max]", "step_ms",
              "bound_GB/s");
  for (const Row& row : rows) {
    const auto& s = row.samples;
    const double in = median_of(s, [](const Sample& x) { return x.in_s; }).median;
    const double out = median_of(s, [](const Sample& x) { return x.out_s; }).median;
    const double xchg = median_of(s, [](const Sample& x) { return x.exchange_s(); }).median;
    const double step = median_of(s, [](const Sample& x) { return x.step_s; }).median;
    const double bound = median_of(s, [](const Sample& x) { return x.bound_s; }).median;
    const Spread ratio = median_of(s, [](const Sample& x) { return x.bound_s / x.exchange_s(); });
    char spread[32];
    std::snprintf(spread, sizeof(spread), "%.2f-%.2f", ratio.min, ratio.max);
    std::printf("%-8s %-6s %8.1f %8.1f %8.1f %8.2f %8.2f %8.2f %6.2f %11s %8.1f %10.2f\n",
                row.plane.name.c_str(), row.plane.memory_medium ? "memcpy" : "tcp", in * 1e3,
                out * 1e3, xchg * 1e3, bytes / in / 1e9, bytes / out / 1e9, moved / xchg / 1e9,
                ratio.median, spread, step * 1e3, moved / bound / 1e9);
    if (row.plane.grad_area) {
      std::printf("%-8s   writing the gradients into the plane's area (not in in_ms): %.1f ms\n",
                  row.plane.name.c_str(),
                  median_of(s, [](const Sample& x) { return x.produce_s; }).median * 1e3);
    }
    if (s.front().cma_s > 0) {
      const double cma = median_of(s, [](const Sample& x) { return x.cma_s; }).median;
      const Spread to_cma = median_of(s, [](const Sample& x) { return x.cma_s / x.exchange_s(); });
      std::printf(
          "%-8s   CMA (process_vm_readv, UCX's one copy on one host) %.2f GB/s = %.2f of memcpy; "
          "%s vs CMA %.2f [%.2f-%.2f]\n",
          row.plane.name.c_str(), moved / cma / 1e9, bound / cma, row.plane.name.c_str(),
          to_cma.median, to_cma.min, to_cma.max);
    }
  }
  for (const Row& row : rows) {
    const auto& s = row.samples;
    const double xchg = median_of(s, [](const Sample& x) { return x.exchange_s(); }).median;
    const double bound = median_of(s, [](const Sample& x) { return x.bound_s; }).median;
    const Spread ratio = median_of(s, [](const Sample& x) { return x.bound_s / x.exchange_s(); });
    std::printf(
        "transport name=%s bytes=%lld gbytes_per_s=%.3f bound_gbytes_per_s=%.3f ratio=%.2f "
        "ratio_min=%.2f ratio_max=%.2f runs=%d\n",
        row.plane.name.c_str(), static_cast<long long>(2 * bytes), moved / xchg / 1e9,
        moved / bound / 1e9, ratio.median, ratio.min, ratio.max, runs);
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
