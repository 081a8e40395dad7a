// bench_transport: bytes per second of one partition's exchange through each data plane
// (ARCHITECTURE.md section 9, "data plane"), against the bound of the plane's medium measured in
// the same run: memcpy of the same bytes for shared memory, a plain TCP socket pair on loopback for
// gRPC and UCX over TCP.
//
// A partition is --mib MiB of 16-bit gradients (n = mib * 2^20 / 2 elements, one range); its
// exchange moves those bytes in and as many bytes of 16-bit parameters out. What is timed, per
// plane (each on its own in-process server with only that plane offered, best of --repeats):
//   in:  OpenStep + SendGradients(the whole partition) + Commit(skip=true). A skipping commit
//        runs no Adam and sends no parameters, but the shard answers it only after it has taken
//        (and validated) every gradient chunk before it, so this is the gradients' journey in.
//   out: OpenStep + Commit of a replay of that step with no gradients: the shard runs no Adam and
//        streams the partition's 16-bit parameters back (converted from its fp32 master weights
//        wave by wave while earlier waves travel: that conversion is the only work in it).
//   exchange = in + out of the same repeat; gbytes_per_s = 2 * partition bytes / exchange.
// The bound moves the same 2 * partition bytes the same way round: two memcpys (in, then out)
// between buffers that do not overlap, or a writer/reader thread pair over one loopback TCP
// connection, one direction then the other, in 4 MiB send/recv calls.
// For information the table also shows a full step (gradients in, Adam, parameters out).
//
// Shared memory runs two ways. shm is zero-copy (StepStream::GradientArea and CommitInPlace): the
// gradients are written into the segment where the shard reads them, and the parameters are
// handed over where the shard's Adam pass wrote them. The write stands for the trainer's own
// rounding of its gradients, which on every plane writes them once (elsewhere into its own
// buffer): it is timed apart (produce_ms) and not counted in `in`, as no plane counts it; the
// parameters' consumer (a host-to-device copy, a conversion) is likewise the trainer's own work.
// shm-copy goes through SendGradients and Commit from and into the trainer's buffers, a copy each
// way, as the gRPC and UCX planes do.
//
// Planes: grpc (bound tcp), shm and shm-copy (bound memcpy), and where the build has UCX: ucx (UCX
// chooses its transports; on one host that is shared memory, so the bound is memcpy) and ucx-tcp
// (UCX_TLS=tcp for the server and the trainer, bound tcp). After the table, one line per plane:
//
//   transport name=shm bytes=134217728 gbytes_per_s=... bound_gbytes_per_s=... ratio=...
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
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
#include "absl/strings/str_split.h"
#include "base/host_buffer.h"
#include "base/status_macros.h"
#include "cpu_optimizer_server/adam/adam_kernel_internal.h"
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

ABSL_FLAG(int64_t, mib, 64, "partition: MiB of 16-bit gradients (and as many of parameters)");
ABSL_FLAG(int, repeats, 5, "timed exchanges per plane (after one warm-up); the best is reported");
ABSL_FLAG(int, threads, 0, "the shard's worker threads (0: all cores)");
ABSL_FLAG(int64_t, chunk_kib, 4096, "gRPC chunk payload and UCX chunk");
ABSL_FLAG(std::string, dtype, "fp16", "fp16 or bf16 gradients and parameters");
ABSL_FLAG(std::string, transports, "grpc,shm,shm-copy,ucx,ucx-tcp",
          "planes to measure (ucx and ucx-tcp only where the build has UCX)");

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

struct Plane {
  std::string name;     // as printed: grpc, shm, shm-copy, ucx, ucx-tcp
  std::string kind;     // grpc, shm or ucx
  std::string ucx_tls;  // set for the server and the trainer; "" leaves UCX_TLS alone
  bool memcpy_bound;    // else the TCP bound
  bool zero_copy = false;
};

struct Result {
  double in_s = 1e30, out_s = 1e30, exchange_s = 1e30, step_s = 1e30;
  double produce_s = 0;  // zero-copy: writing the gradients into the segment (not in in_s)
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
  }

  // Everything for one plane: its own server (only that plane offered), client, job and
  // transport, torn down before the next plane so no two shards hold the state at once.
  absl::StatusOr<Result> Measure(const Plane& plane, int repeats) {
    if (plane.ucx_tls.empty()) return MeasureWithEnv(plane, repeats);
    const char* old = std::getenv("UCX_TLS");
    const std::string saved = old != nullptr ? old : "";
    setenv("UCX_TLS", plane.ucx_tls.c_str(), 1);
    absl::StatusOr<Result> r = MeasureWithEnv(plane, repeats);
    if (old != nullptr) {
      setenv("UCX_TLS", saved.c_str(), 1);
    } else {
      unsetenv("UCX_TLS");
    }
    return r;
  }

 private:
  absl::StatusOr<Result> MeasureWithEnv(const Plane& plane, int repeats) {
    ShardOptions shard_options;
    shard_options.memory_limit_bytes = int64_t{20} << 30;
    ShardStore store(shard_options, pool_, BestSimdPath());
    ServerOptions server_options;
    server_options.listen_address = "127.0.0.1:0";
    server_options.enable_shm = plane.kind == "shm";
    server_options.enable_ucx = plane.kind == "ucx";
    auto server = OptimizerServer::Start(server_options, &store);
    if (!server.ok()) return server.status();
    ClientOptions client_options;
    client_options.address = "127.0.0.1:" + std::to_string((*server)->port());
    client_options.chunk_bytes = absl::GetFlag(FLAGS_chunk_kib) << 10;
    auto client = OptimizerClient::Connect(client_options);
    if (!client.ok()) return client.status();
    AdamHyperParams adam;
    adam.lr = 1e-4f;
    auto created = (*client)->CreateJob(MakeCreateJobRequest("bench", {{0, n_}}, adam, dtype_));
    if (!created.ok()) return created.status();
    if (absl::Status s =
            (*client)->LoadState("bench", v1::STATE_TENSOR_MASTER_WEIGHTS, 0, weights_.data(), n_);
        !s.ok()) {
      return s;
    }

    std::unique_ptr<StepTransport> owned;
    StepTransport* transport = client->get();
    if (plane.kind == "shm") {
      OFFLOAD_RETURN_IF_ERROR(ProbeShm(client->get()));
      auto t = CreateShmTransport(client->get());
      if (!t.ok()) return t.status();
      owned = *std::move(t);
#ifdef OFFLOAD_HAVE_UCX
    } else if (plane.kind == "ucx") {
      OFFLOAD_RETURN_IF_ERROR(ProbeUcx(client->get()));
      UcxOptions ucx;
      ucx.chunk_bytes = absl::GetFlag(FLAGS_chunk_kib) << 10;
      auto t = CreateUcxTransport(client->get(), ucx);
      if (!t.ok()) return t.status();
      owned = *std::move(t);
#endif
    } else if (plane.kind != "grpc") {
      return absl::UnimplementedError("no plane " + plane.kind + " in this build");
    }
    if (owned != nullptr) transport = owned.get();

    Result best;
    uint64_t step = 0;
    // Round 0 is the warm-up: it attaches the plane and touches every buffer on both sides.
    for (int round = 0; round <= repeats; ++round) {
      // in: the gradients, then a skipping commit (no Adam, no parameters).
      ++step;
      double produce_s = 0;
      auto t0 = Clock::now();
      absl::StatusOr<v1::StepResult> r =
          Exchange(transport, plane.zero_copy, step, /*send=*/true, /*skip=*/true, &produce_s);
      const double in_s = Seconds(t0, Clock::now()) - produce_s;
      if (!r.ok()) return r.status();
      if (!r->skipped()) return absl::InternalError("the skipping commit was not skipped");
      // out: a replay of that step, which only sends the parameters back.
      double unused = 0;
      t0 = Clock::now();
      r = Exchange(transport, plane.zero_copy, step, /*send=*/false, /*skip=*/false, &unused);
      const double out_s = Seconds(t0, Clock::now());
      if (!r.ok()) return r.status();
      if (!r->replayed()) return absl::InternalError("the replay was not a replay");
      // For information: a full step, Adam included.
      ++step;
      double step_produce_s = 0;
      t0 = Clock::now();
      r = Exchange(transport, plane.zero_copy, step, /*send=*/true, /*skip=*/false,
                   &step_produce_s);
      const double step_s = Seconds(t0, Clock::now()) - step_produce_s;
      if (!r.ok()) return r.status();
      if (!r->applied()) return absl::InternalError("the step was not applied");
      if (round == 0) continue;
      if (best.in_s > in_s) best.produce_s = produce_s;
      best.in_s = std::min(best.in_s, in_s);
      best.out_s = std::min(best.out_s, out_s);
      best.exchange_s = std::min(best.exchange_s, in_s + out_s);
      best.step_s = std::min(best.step_s, step_s);
    }
    owned.reset();
    return best;
  }

  // One step stream. zero_copy: the gradients are written into the plane's gradient area (the
  // seconds that takes go to *produce_s) and the parameters are taken where they land.
  absl::StatusOr<v1::StepResult> Exchange(StepTransport* transport, bool zero_copy, uint64_t step,
                                          bool send, bool skip, double* produce_s) {
    auto stream = transport->OpenStep("bench", 0, 0, n_, step);
    if (!stream.ok()) return stream.status();
    if (!zero_copy) {
      if (send) OFFLOAD_RETURN_IF_ERROR((*stream)->SendGradients(0, grads_.data(), dtype_, n_));
      return (*stream)->Commit(1e-4f, 1.0f, skip, params_.data());
    }
    return ExchangeInPlace(**stream, 0, grads_.data(), dtype_, n_, send, 1e-4f, skip, produce_s);
  }

  const int64_t n_;
  const DType dtype_;
  ThreadPool* const pool_;
  std::vector<float> weights_;
  std::vector<uint16_t> grads_, params_;  // (n,) each: the trainer's side of the partition
};

int Run() {
  const int64_t bytes = absl::GetFlag(FLAGS_mib) << 20;  // one direction
  const int64_t n = bytes / 2;
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  ThreadPool::Options pool_options;
  pool_options.num_threads = absl::GetFlag(FLAGS_threads);
  ThreadPool pool(pool_options);

  std::vector<Plane> planes;
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_transports), ',')) {
    if (name == "grpc") {
      planes.push_back({"grpc", "grpc", "", false});
    } else if (name == "shm") {
      planes.push_back({"shm", "shm", "", true, /*zero_copy=*/true});
    } else if (name == "shm-copy") {
      planes.push_back({"shm-copy", "shm", "", true});
    } else if (name == "ucx" || name == "ucx-tcp") {
#ifdef OFFLOAD_HAVE_UCX
      if (name == "ucx") {
        planes.push_back({"ucx", "ucx", "", true});
      } else {
        planes.push_back({"ucx-tcp", "ucx", "tcp", false});
      }
#else
      std::fprintf(stderr, "bench_transport: %s: this build has no UCX, skipped\n",
                   std::string(name).c_str());
#endif
    } else if (!name.empty()) {
      std::fprintf(stderr, "bench_transport: unknown plane %s\n", std::string(name).c_str());
      return 2;
    }
  }

  // The bounds first, on idle buffers of the same size (each touched before timing).
  double memcpy_s = 1e30, tcp_s = 1e30;
  {
    std::vector<char> a(bytes, 1), b(bytes, 2), c(bytes, 3), d(bytes, 4);
    for (int it = 0; it <= repeats; ++it) {
      const double s = MemcpyBothWaysSeconds(&a, &b, &c, &d);
      if (it > 0) memcpy_s = std::min(memcpy_s, s);
    }
  }
  for (int it = 0; it <= repeats; ++it) {
    const double s = TcpBothWaysSeconds(bytes);
    if (s < 0) {
      std::fprintf(stderr, "bench_transport: the TCP bound failed\n");
      return 1;
    }
    if (it > 0) tcp_s = std::min(tcp_s, s);
  }

  const DType dtype = absl::GetFlag(FLAGS_dtype) == "bf16" ? DType::kBf16 : DType::kFp16;
  // The only work in `out` besides the transfer: the shard's fp32 -> 16-bit conversion of the
  // partition, timed alone on the same pool (the replay overlaps it with sending, wave by wave).
  double convert_s = 1e30;
  {
    ShardStore store(ShardOptions{}, &pool, BestSimdPath());
    std::vector<float> master(n, 0.25f);
    std::vector<uint16_t> out(n);
    // The conversion a replay runs (step_session.cc): the SIMD one of the store's path.
    const internal::FloatToHalfFn to_half = internal::GetFloatToHalf(store.simd_path());
    for (int it = 0; it <= repeats; ++it) {
      const auto t0 = Clock::now();
      store.ParallelTiles(0, n, [&](int64_t lo, int64_t hi) {
        if (to_half != nullptr) {
          to_half(master.data() + lo, dtype, out.data() + lo, hi - lo);
        } else {
          ConvertFromFloat(master.data() + lo, hi - lo, dtype, out.data() + lo);
        }
      });
      if (it > 0) convert_s = std::min(convert_s, Seconds(t0, Clock::now()));
    }
  }
  Bench bench(n, dtype, &pool);
  struct Row {
    Plane plane;
    Result result;
  };
  std::vector<Row> rows;
  int rc = 0;
  for (const Plane& plane : planes) {
    absl::StatusOr<Result> r = bench.Measure(plane, repeats);
    if (!r.ok()) {
      std::fprintf(stderr, "bench_transport: %s: %s\n", plane.name.c_str(),
                   r.status().ToString().c_str());
      rc = 1;
      continue;
    }
    rows.push_back({plane, *r});
  }

  const double moved = 2.0 * static_cast<double>(bytes);  // in + out
  std::printf(
      "partition: %lld MiB of %s gradients in, as many of parameters out "
      "(n=%lld, shard threads=%d); best of %d; GB = 1e9 bytes\n",
      static_cast<long long>(absl::GetFlag(FLAGS_mib)), std::string(DTypeName(dtype)).c_str(),
      static_cast<long long>(n), pool.num_threads(), repeats);
  std::printf("the shard's fp32 -> %s conversion of the partition alone (inside out_ms): %.1f ms\n",
              std::string(DTypeName(dtype)).c_str(), convert_s * 1e3);
  std::printf("bounds: memcpy %.2f GB/s, tcp loopback %.2f GB/s (both directions, same bytes)\n",
              moved / memcpy_s / 1e9, moved / tcp_s / 1e9);
  std::printf("%-8s %-6s %8s %8s %8s %8s %8s %8s %6s %8s %10s\n", "plane", "bound", "in_ms",
              "out_ms", "xchg_ms", "in_GB/s", "out_GB/s", "GB/s", "ratio", "step_ms", "produce_ms");
  for (const Row& row : rows) {
    const double bound_s = row.plane.memcpy_bound ? memcpy_s : tcp_s;
    const Result& r = row.result;
    char produce[16] = "-";
    if (row.plane.zero_copy) std::snprintf(produce, sizeof(produce), "%.1f", r.produce_s * 1e3);
    std::printf("%-8s %-6s %8.1f %8.1f %8.1f %8.2f %8.2f %8.2f %6.2f %8.1f %10s\n",
                row.plane.name.c_str(), row.plane.memcpy_bound ? "memcpy" : "tcp", r.in_s * 1e3,
                r.out_s * 1e3, r.exchange_s * 1e3, bytes / r.in_s / 1e9, bytes / r.out_s / 1e9,
                moved / r.exchange_s / 1e9, bound_s / r.exchange_s, r.step_s * 1e3, produce);
  }
  for (const Row& row : rows) {
    const double bound_s = row.plane.memcpy_bound ? memcpy_s : tcp_s;
    std::printf(
        "transport name=%s bytes=%lld gbytes_per_s=%.3f bound_gbytes_per_s=%.3f ratio=%.2f\n",
        row.plane.name.c_str(), static_cast<long long>(2 * bytes),
        moved / row.result.exchange_s / 1e9, moved / bound_s / 1e9,
        bound_s / row.result.exchange_s);
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
