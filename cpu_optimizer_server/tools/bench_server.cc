// bench_server: a full optimizer step of a job through each data plane (ARCHITECTURE.md section 9),
// against the TCP socket pair moving the same bytes and against the Adam kernel alone, all
// measured in the same run.
//
// The job is --n parameters (16-bit gradients and parameters in --grad, fp32 state on the shard)
// cut into --ranges balanced ranges; every exchange below runs all ranges at once, one stream and
// one thread per range, as the ranks of a trainer would, and is timed from before the first
// OpenStep to the end of the last range. Each plane runs on its own in-process server with only
// that plane offered (or on the server at --server, see below), on a job of its own, and is
// measured in --runs runs after one warm-up round; each run times, in this order, with the same
// job and transport:
//   tcp:    the bound (tcp_bound.h): n * 2 bytes from a writer to a reader thread over one
//           loopback TCP connection, then as many bytes back, in 4 MiB calls: the 16-bit
//           gradients in and the 16-bit parameters out of a step over a plain socket pair.
//   kernel: the Adam kernel alone over the job's state in the shard, tiled on the shard's pool as
//           a commit tiles it, reading the trainer's gradients and writing 16-bit parameters:
//           the work of a step with no transfer around it.
//   in:     step s: OpenStep + SendGradients(the whole range) + Commit(skip=true) per range. The
//           shard answers a skipping commit only after it has taken every gradient before it, and
//           runs no Adam and sends no parameters: the gradients' journey in.
//   out:    a replay of step s per range with no gradients: no Adam, the parameters back.
//   step:   step s + 1: gradients in, commit, Adam, parameters back (the parameters stream back
//           wave by wave while later waves compute).
//   early:  step s + 2, as `step` but with the gradients sent in --call_kib calls, each followed
//           by an update during backward (UpdateEarly) of the elements it carried, so the shard's
//           Adam on one call's elements runs while the next call's bytes are on the wire, and the
//           commit has only the conversion to 16 bits and the parameters left. The shard copies
//           the state an early update overwrites aside first (for the commit to roll back), so
//           early does more memory work than step and gains only where transfer and Adam can
//           overlap (idle cores, a medium that is not the CPU). The shard may decline an early
//           update (the commit then does it); a note under the plane's row says so.
// On shared memory's zero-copy plane (shm) in, step and early write each range's gradients into
// the segment first; that write stands for the trainer's own rounding of its gradients, which
// every plane does once (elsewhere into its own buffer), so its time (the longest over the ranges,
// ExchangeResult::produce_s) is taken out of in, step and early, as bench_transport does.
//
// Printed: a header line (the job, the threads, the runs, where the server is), then a table
// with one row per plane: the medians over the runs of in_ms, out_ms, kernel_ms, step_ms,
// early_ms and tcp_ms, and ratios, each the median over the runs of the run's own ratio with its
// spread [min-max] across the runs:
//   step_vs_tcp  = tcp / step and early_vs_tcp = tcp / early: the step against the TCP pair
//                  moving its bytes (the target for grpc and ucx-tcp: at least 0.7);
//   overlap      = early / (in + kernel + out): the overlapped step against the sum of its parts,
//                  below 1 where the parts overlap;
//   step_overlap = step / (in + kernel + out): the same for the plain step, whose commit already
//                  sends each wave of parameters while Adam computes the next;
//   step_vs_kernel = kernel / step, for the planes whose medium is memory (shm, shm-copy, and ucx
//                  on one host): how close the step comes to the kernel alone.
// Then one line per plane:
//
//   server transport=grpc grad=fp16 n=67108864 ranges=1 threads=2 runs=5 step_ms=... early_ms=...
//   in_ms=... out_ms=... kernel_ms=... tcp_ms=... step_vs_tcp=... step_vs_tcp_min=...
//   step_vs_tcp_max=... early_vs_tcp=... early_vs_tcp_min=... early_vs_tcp_max=...
//   step_overlap=... step_overlap_min=... step_overlap_max=... overlap=... overlap_min=...
//   overlap_max=... [step_vs_kernel=... step_vs_kernel_min=... _max=...]
//
// Planes (--transports): grpc (gradients written into StepStream::GradientArea) and grpc-copy;
// shm (zero-copy: StepStream::GradientArea and CommitInPlace) and shm-copy (SendGradients and
// Commit from and into the trainer's buffers); and where the build has UCX, ucx (UCX chooses its
// transports: TCP on one host unless UCX_TLS says sm,self) and ucx-tcp (UCX_TLS=tcp for the server
// and the trainer in this process).
//
// Across a network path (two network namespaces joined by a veth, or two hosts; scripts/
// bench-netns): --server=HOST:PORT uses the cpu_optimizer_server there, on a job
// "bench-server-<plane>" (dropped first), and --tcp_peer=HOST:PORT the TCP bound peer beside it
// (bench_transport --serve_tcp_bound=PORT) in place of loopback. The kernel alone then cannot run
// on the server's state: it is timed in this process, on this process's pool (--threads), over
// local state of n elements with the same kernel (--simd), which the header line says; ucx there
// has only the network, so it counts as a TCP plane. UCX_TLS=tcp for ucx-tcp is then set for this
// process only: the server offers what its own environment lets it.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "base/host_buffer.h"
#include "base/status_macros.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"
#include "cpu_optimizer_server/grpc/optimizer_service.h"
#include "cpu_optimizer_server/grpc/shard_client.h"
#include "cpu_optimizer_server/shard/shard_store.h"
#include "cpu_optimizer_server/tools/bench_planes.h"
#include "cpu_optimizer_server/tools/range_driver.h"
#include "cpu_optimizer_server/tools/run_stats.h"
#include "cpu_optimizer_server/tools/tcp_bound.h"
#include "cpu_optimizer_server/transport/step_transport.h"

ABSL_FLAG(int64_t, n, int64_t{64} << 20, "parameters in the job");
ABSL_FLAG(int, ranges, 1, "ranges the job is cut into, each stepped by its own stream (rank)");
ABSL_FLAG(int, threads, 0, "Adam worker threads (0: all cores)");
ABSL_FLAG(int, channels, 2, "client channels (connections)");
ABSL_FLAG(int64_t, chunk_kib, 4096, "gRPC chunk payload and UCX chunk");
ABSL_FLAG(int64_t, call_kib, 4096,
          "early: KiB of gradients per SendGradients call, each followed by an update during "
          "backward");
ABSL_FLAG(int, runs, 5, "timed runs per plane (after one warm-up); medians and spread reported");
ABSL_FLAG(std::string, simd, "auto", "kernel path");
ABSL_FLAG(std::string, grad, "fp16", "fp16 or bf16 gradients and parameters");
ABSL_FLAG(std::string, transports, "grpc,shm,ucx,ucx-tcp",
          "planes to measure: grpc, shm, shm-copy, ucx, ucx-tcp (ucx ones only where the build "
          "has UCX)");
ABSL_FLAG(std::string, server, "",
          "a cpu_optimizer_server to measure against (host:port) instead of one in this process");
ABSL_FLAG(std::string, tcp_peer, "",
          "with --server: the TCP bound peer (host:port) on the server's side of the path");

namespace offload {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Step `step` of every range at once through `transport`, one thread per range (as ranks would),
// each range's exchange as `options` says (ExchangeRange). Returns the seconds from before the
// first OpenStep to the end of the last range; *produce_s gets the longest zero-copy write of
// the gradients (ExchangeResult::produce_s, 0 elsewhere), which the caller takes out of them since
// the ranges write at once, and *early_updated (if not null) the elements the shard kept updated
// during backward, since it may decline and then the commit does all the work. Returns the first
// range's error, if any.
absl::StatusOr<double> AllRanges(StepTransport* transport, const std::string& job,
                                 const std::vector<RangeSpec>& ranges, uint64_t step,
                                 const ExchangeOptions& options, const uint16_t* grads, DType dtype,
                                 uint16_t* params, double* produce_s,
                                 int64_t* early_updated = nullptr) {
  std::vector<absl::Status> status(ranges.size());
  std::vector<double> produced(ranges.size(), 0.0);
  std::vector<int64_t> early(ranges.size(), 0);
  auto one = [&](size_t i) {
    const RangeSpec& r = ranges[i];
    absl::StatusOr<std::unique_ptr<StepStream>> stream =
        transport->OpenStep(job, static_cast<uint32_t>(i), r.offset, r.length, step);
    if (!stream.ok()) {
      status[i] = stream.status();
      return;
    }
    absl::StatusOr<ExchangeResult> result = ExchangeRange(
        **stream, r.offset, grads + r.offset, dtype, r.length, params + r.offset, options);
    if (!result.ok()) {
      status[i] = result.status();
      return;
    }
    produced[i] = result->produce_s;
    early[i] = static_cast<int64_t>(result->result.early_updated());
  };
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (size_t i = 1; i < ranges.size(); ++i) threads.emplace_back(one, i);
  one(0);
  for (std::thread& t : threads) t.join();
  const double seconds = Seconds(t0, Clock::now());
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  *produce_s = *std::max_element(produced.begin(), produced.end());
  if (early_updated != nullptr) {
    *early_updated = 0;
    for (int64_t e : early) *early_updated += e;
  }
  return seconds;
}

// One run of one plane, in seconds; in, step and early without the zero-copy write.
struct Sample {
  double bound_s = 0, kernel_s = 0, in_s = 0, out_s = 0, step_s = 0, early_s = 0;
  double produce_s = 0;       // zero-copy: writing the gradients into the segment (the step's)
  int64_t early_updated = 0;  // of early's elements, those the shard updated during backward
  double step_vs_tcp() const { return bound_s / step_s; }
  double early_vs_tcp() const { return bound_s / early_s; }
  double overlap() const { return early_s / (in_s + kernel_s + out_s); }
  double step_overlap() const { return step_s / (in_s + kernel_s + out_s); }
  double step_vs_kernel() const { return kernel_s / step_s; }
};

// Where the kernel-alone pass runs: one range's fp32 state.
struct KernelRange {
  int64_t offset, length;
  float *param, *exp_avg, *exp_avg_sq;
};

class Bench {
 public:
  Bench(int64_t n, int num_ranges, DType dtype, SimdPath path, ThreadPool* pool)
      : n_(n),
        ranges_(BalancedRanges(n, num_ranges)),
        dtype_(dtype),
        path_(path),
        pool_(pool),
        grads_(n),
        params_(n, 0) {
    std::mt19937 rng(1);
    std::normal_distribution<float> d(0.0f, 1.0f);
    weights_.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      weights_[i] = d(rng);
      const float g = 0.01f * d(rng);
      grads_[i] = dtype == DType::kBf16 ? FloatToBf16(g) : FloatToFp16(g);
    }
    adam_.lr = 1e-4;
    adam_.weight_decay = 0.01;
  }

  // Everything for one plane: its own server (only that plane offered), client, job and
  // transport, torn down before the next plane so no two shards hold the state at once.
  absl::StatusOr<std::vector<Sample>> Measure(const BenchPlane& plane, int runs) {
    ScopedPlaneEnv env(plane);
    return MeasureWithEnv(plane, runs);
  }

 private:
  double Bound() {
    const std::string peer = absl::GetFlag(FLAGS_tcp_peer);
    return peer.empty() ? TcpBothWaysSeconds(n_ * 2) : TcpBothWaysSecondsTo(peer, n_ * 2);
  }

  // The Adam pass of a commit alone: the store's kernel over each range's state, tiled on the
  // store's pool as the commit tiles it, from the trainer's gradients into its parameter buffer
  // (nothing reads it meanwhile). The state drifts by a step each time, which costs the same.
  double KernelSeconds(const ShardStore& store, const std::vector<KernelRange>& state) {
    const AdamStepScalars scalars = ComputeAdamStepScalars(adam_, adam_.lr, 1, 1.0f);
    const AdamKernelFn kernel = store.adam_kernel();
    const auto t0 = Clock::now();
    for (const KernelRange& r : state) {
      store.ParallelTiles(0, r.length, [&](int64_t lo, int64_t hi) {
        AdamSpan span{
            grads_.data() + r.offset + lo,  dtype_, r.param + lo, r.exp_avg + lo, r.exp_avg_sq + lo,
            params_.data() + r.offset + lo, dtype_, hi - lo};
        kernel(scalars, span);
      });
    }
    return Seconds(t0, Clock::now());
  }

  // Remote mode: the job's state lives on the server, so the kernel runs over state of its
  // shape here, made once (on the first plane) as the shard makes it: a HostBuffer (transparent
  // huge pages) first touched tile by tile by the pool threads that update it.
  absl::StatusOr<std::vector<KernelRange>> LocalState(const ShardStore& store) {
    if (local_state_.data() == nullptr) {
      OFFLOAD_ASSIGN_OR_RETURN(local_state_, HostBuffer::Allocate(3 * n_ * sizeof(float)));
      float* const state = static_cast<float*>(local_state_.data());
      store.ParallelTiles(0, n_, [&](int64_t lo, int64_t hi) {
        std::copy(weights_.data() + lo, weights_.data() + hi, state + lo);
        std::fill(state + n_ + lo, state + n_ + hi, 0.0f);
        std::fill(state + 2 * n_ + lo, state + 2 * n_ + hi, 0.0f);
      });
    }
    std::vector<KernelRange> state;
    for (const RangeSpec& r : ranges_) {
      float* base = static_cast<float*>(local_state_.data()) + r.offset;
      state.push_back({r.offset, r.length, base, base + n_, base + 2 * n_});
    }
    return state;
  }

  absl::StatusOr<std::vector<Sample>> MeasureWithEnv(const BenchPlane& plane, int runs) {
    ShardOptions shard_options;
    shard_options.memory_limit_bytes = int64_t{20} << 30;
    // In remote mode this store holds no job: it only tiles the kernel-alone pass on this pool.
    ShardStore store(shard_options, pool_, path_);
    std::unique_ptr<OptimizerServer> server;
    ClientOptions client_options;
    client_options.address = absl::GetFlag(FLAGS_server);
    const bool remote = !client_options.address.empty();
    if (!remote) {
      ServerOptions server_options;
      server_options.listen_address = "127.0.0.1:0";
      server_options.enable_shm = plane.kind == "shm";
      server_options.enable_ucx = plane.kind == "ucx";
      OFFLOAD_ASSIGN_OR_RETURN(server, OptimizerServer::Start(server_options, &store));
      client_options.address = "127.0.0.1:" + std::to_string(server->port());
    }
    client_options.num_channels = absl::GetFlag(FLAGS_channels);
    client_options.chunk_bytes = absl::GetFlag(FLAGS_chunk_kib) << 10;
    OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<ShardClient> client,
                             ShardClient::Connect(client_options));
    // A job of its own per plane, so a remote server's earlier runs do not matter.
    const std::string job = "bench-server-" + plane.name;
    client->DropJob(job).IgnoreError();
    OFFLOAD_RETURN_IF_ERROR(
        client->CreateJob(MakeCreateJobRequest(job, ranges_, adam_, dtype_)).status());
    OFFLOAD_RETURN_IF_ERROR(
        client->LoadState(job, v1::STATE_TENSOR_MASTER_WEIGHTS, 0, weights_.data(), n_));

    std::vector<KernelRange> kernel_state;
    if (remote) {
      OFFLOAD_ASSIGN_OR_RETURN(kernel_state, LocalState(store));
    } else {
      OFFLOAD_ASSIGN_OR_RETURN(std::shared_ptr<Job> state, store.FindJob(job));
      for (const auto& range : state->ranges) {
        const RangeState& r = *range;
        kernel_state.push_back({r.spec.offset, r.spec.length, r.param,
                                static_cast<float*>(r.exp_avg),
                                static_cast<float*>(r.exp_avg_sq)});  // fp32 state
      }
    }

    OFFLOAD_ASSIGN_OR_RETURN(
        std::unique_ptr<StepTransport> owned,
        OpenBenchPlane(plane, client.get(), absl::GetFlag(FLAGS_chunk_kib) << 10));
    StepTransport* transport = owned != nullptr ? owned.get() : client.get();

    auto phase = [&](uint64_t step, ExchangeMode mode, double* produce_s,
                     int64_t* early_updated = nullptr) {
      ExchangeOptions options;
      options.mode = mode;
      options.grad_area = plane.grad_area;
      options.params_in_place = plane.params_in_place;
      options.lr = adam_.lr;
      if (mode == ExchangeMode::kEarly) {
        options.call_elements = absl::GetFlag(FLAGS_call_kib) * 1024 / 2;
      }
      return AllRanges(transport, job, ranges_, step, options, grads_.data(), dtype_,
                       params_.data(), produce_s, early_updated);
    };
    std::vector<Sample> samples;
    uint64_t step = 1;
    // Round 0 is the warm-up: it attaches the plane and touches every buffer on both sides.
    for (int round = 0; round <= runs; ++round, step += 3) {
      Sample sample;
      double produce_s = 0;
      sample.bound_s = Bound();
      if (sample.bound_s < 0) return absl::UnavailableError("the TCP bound failed");
      sample.kernel_s = KernelSeconds(store, kernel_state);
      OFFLOAD_ASSIGN_OR_RETURN(sample.in_s, phase(step, ExchangeMode::kIn, &produce_s));
      sample.in_s -= produce_s;
      OFFLOAD_ASSIGN_OR_RETURN(sample.out_s, phase(step, ExchangeMode::kOut, &produce_s));
      OFFLOAD_ASSIGN_OR_RETURN(sample.step_s, phase(step + 1, ExchangeMode::kStep, &produce_s));
      sample.step_s -= produce_s;
      sample.produce_s = produce_s;
      OFFLOAD_ASSIGN_OR_RETURN(
          sample.early_s, phase(step + 2, ExchangeMode::kEarly, &produce_s, &sample.early_updated));
      sample.early_s -= produce_s;
      if (round > 0) samples.push_back(sample);
    }
    owned.reset();
    client->DropJob(job).IgnoreError();
    return samples;
  }

  const int64_t n_;
  const std::vector<RangeSpec> ranges_;
  const DType dtype_;
  const SimdPath path_;
  ThreadPool* const pool_;
  AdamHyperParams adam_;
  std::vector<float> weights_;
  std::vector<uint16_t> grads_, params_;  // (n,) each: the trainer's side of the job
  HostBuffer local_state_;                // remote mode: (3, n) fp32 weights and moments
};

int Run() {
  const int64_t n = absl::GetFlag(FLAGS_n);
  const int num_ranges = std::max(1, absl::GetFlag(FLAGS_ranges));
  const int runs = std::max(1, absl::GetFlag(FLAGS_runs));
  const bool remote = !absl::GetFlag(FLAGS_server).empty();
  const DType dtype = absl::GetFlag(FLAGS_grad) == "bf16" ? DType::kBf16 : DType::kFp16;
  absl::StatusOr<SimdPath> path = ParseSimdPath(absl::GetFlag(FLAGS_simd));
  if (!path.ok()) {
    std::fprintf(stderr, "bench_server: %s\n", path.status().ToString().c_str());
    return 2;
  }
  if (n < num_ranges) {
    std::fprintf(stderr, "bench_server: --n must be at least --ranges\n");
    return 2;
  }
  ThreadPool::Options pool_options;
  pool_options.num_threads = absl::GetFlag(FLAGS_threads);
  ThreadPool pool(pool_options);

  absl::StatusOr<std::vector<BenchPlane>> parsed =
      ParseBenchPlanes(absl::GetFlag(FLAGS_transports), remote, "bench_server");
  if (!parsed.ok()) {
    std::fprintf(stderr, "bench_server: %s\n", std::string(parsed.status().message()).c_str());
    return 2;
  }
  const std::vector<BenchPlane> planes = *std::move(parsed);

  Bench bench(n, num_ranges, dtype, *path, &pool);
  struct Row {
    BenchPlane plane;
    std::vector<Sample> samples;
  };
  std::vector<Row> rows;
  int rc = 0;
  for (const BenchPlane& plane : planes) {
    absl::StatusOr<std::vector<Sample>> r = bench.Measure(plane, runs);
    if (!r.ok()) {
      std::fprintf(stderr, "bench_server: %s: %s\n", plane.name.c_str(),
                   r.status().ToString().c_str());
      rc = 1;
      continue;
    }
    rows.push_back({plane, *r});
  }

  const std::string dtype_name(DTypeName(dtype));
  const std::string simd_name(SimdPathName(*path));
  std::printf(
      "job: n=%lld parameters in %d range(s), a stream per range in parallel; %s gradients and "
      "parameters; threads=%d; %d runs after a warm-up, medians, ratios as median [min-max] of "
      "the runs' own; %s\n",
      static_cast<long long>(n), num_ranges, dtype_name.c_str(), pool.num_threads(), runs,
      remote ? absl::StrFormat(
                   "server %s (job bench-server-<plane>), tcp bound to %s; the kernel alone is "
                   "timed in this process (threads=%d, simd=%s) on local state of n elements with "
                   "the same kernel, not on the server",
                   absl::GetFlag(FLAGS_server),
                   absl::GetFlag(FLAGS_tcp_peer).empty() ? "loopback (no --tcp_peer)"
                                                         : absl::GetFlag(FLAGS_tcp_peer),
                   pool.num_threads(), simd_name)
                   .c_str()
             : absl::StrFormat("server in this process on loopback (simd=%s), kernel alone on its "
                               "pool and state",
                               simd_name)
                   .c_str());
  auto spread_of = [](const std::vector<Sample>& samples, double (Sample::*field)() const) {
    std::vector<double> v;
    for (const Sample& s : samples) v.push_back((s.*field)());
    return SpreadOf(v);
  };
  auto ms_of = [](const std::vector<Sample>& samples, double Sample::*field) {
    std::vector<double> v;
    for (const Sample& s : samples) v.push_back(s.*field);
    return SpreadOf(v).median * 1e3;
  };
  auto with_spread = [](const Spread& s) {
    return absl::StrFormat("%.2f [%.2f-%.2f]", s.median, s.min, s.max);
  };
  std::printf("%-8s %8s %8s %9s %8s %8s %8s  %-17s %-17s %-17s %-17s %-17s\n", "plane", "in_ms",
              "out_ms", "kernel_ms", "step_ms", "early_ms", "tcp_ms", "step_vs_tcp", "early_vs_tcp",
              "step_overlap", "overlap", "step_vs_kernel");
  for (const Row& row : rows) {
    const auto& s = row.samples;
    std::printf(
        "%-8s %8.1f %8.1f %9.1f %8.1f %8.1f %8.1f  %-17s %-17s %-17s %-17s %-17s\n",
        row.plane.name.c_str(), ms_of(s, &Sample::in_s), ms_of(s, &Sample::out_s),
        ms_of(s, &Sample::kernel_s), ms_of(s, &Sample::step_s), ms_of(s, &Sample::early_s),
        ms_of(s, &Sample::bound_s), with_spread(spread_of(s, &Sample::step_vs_tcp)).c_str(),
        with_spread(spread_of(s, &Sample::early_vs_tcp)).c_str(),
        with_spread(spread_of(s, &Sample::step_overlap)).c_str(),
        with_spread(spread_of(s, &Sample::overlap)).c_str(),
        row.plane.memory_medium ? with_spread(spread_of(s, &Sample::step_vs_kernel)).c_str() : "-");
    int64_t fewest_early = n;
    for (const Sample& x : s) fewest_early = std::min(fewest_early, x.early_updated);
    if (fewest_early < n) {
      // The shard declined some updates during backward: early_ms is then not the overlapped
      // step it stands for.
      std::printf("%-8s   the shard updated only %lld of %lld elements during backward in a run\n",
                  row.plane.name.c_str(), static_cast<long long>(fewest_early),
                  static_cast<long long>(n));
    }
    if (row.plane.grad_area) {
      std::printf(
          "%-8s   writing the gradients into the plane's area (not in in/step/early): %.1f ms\n",
          row.plane.name.c_str(), ms_of(s, &Sample::produce_s));
    }
  }
  for (const Row& row : rows) {
    const auto& s = row.samples;
    auto ratio = [&](const char* name, double (Sample::*field)() const) {
      const Spread r = spread_of(s, field);
      return absl::StrFormat(" %s=%.2f %s_min=%.2f %s_max=%.2f", name, r.median, name, r.min, name,
                             r.max);
    };
    std::printf(
        "server transport=%s grad=%s n=%lld ranges=%d threads=%d runs=%d step_ms=%.1f "
        "early_ms=%.1f in_ms=%.1f out_ms=%.1f kernel_ms=%.1f tcp_ms=%.1f%s%s%s%s%s\n",
        row.plane.name.c_str(), dtype_name.c_str(), static_cast<long long>(n), num_ranges,
        pool.num_threads(), runs, ms_of(s, &Sample::step_s), ms_of(s, &Sample::early_s),
        ms_of(s, &Sample::in_s), ms_of(s, &Sample::out_s), ms_of(s, &Sample::kernel_s),
        ms_of(s, &Sample::bound_s), ratio("step_vs_tcp", &Sample::step_vs_tcp).c_str(),
        ratio("early_vs_tcp", &Sample::early_vs_tcp).c_str(),
        ratio("step_overlap", &Sample::step_overlap).c_str(),
        ratio("overlap", &Sample::overlap).c_str(),
        row.plane.memory_medium ? ratio("step_vs_kernel", &Sample::step_vs_kernel).c_str() : "");
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
