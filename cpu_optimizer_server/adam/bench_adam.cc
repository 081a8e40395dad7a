// Adam kernel throughput vs its memory roofline, in one process (ARCHITECTURE.md section 9).
//
// For every requested SIMD path x gradient dtype {fp16, bf16} x thread count, the fused pass
// (16-bit grad in -> fp32 p, m, v updated -> 16-bit param copy out, same family as the grad) runs
// over n elements split into ThreadPool tiles by ForEachOwnedTile, on buffers first touched by
// the same tile owners. The roofline kernel (same loads and stores, one add per stream) runs
// alternately with it on the same buffers, so drift of the shared machine hits both alike. Each
// reports the BEST of --iters timed passes after one warm-up pass.
//
//   bench_adam [--n=67108864] [--iters=10] [--scalar_iters=2] [--paths=scalar,avx2,avx512]
//              [--threads=1,2]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "base/dtype.h"
#include "base/thread_pool.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"
#include "cpu_optimizer_server/adam/adam_roofline.h"

namespace offload {
namespace {

struct Flags {
  int64_t n = int64_t{1} << 26;
  int iters = 10;
  int scalar_iters = 2;  // the scalar path is a correctness reference and slow
  std::vector<std::string> paths;
  std::vector<int> threads;
};

void Usage() {
  std::fprintf(stderr,
               "usage: bench_adam [--n=N] [--iters=K] [--scalar_iters=K] "
               "[--paths=scalar,avx2,avx512] [--threads=1,2]\n");
  std::exit(2);
}

bool ParseFlag(absl::string_view arg, absl::string_view name, absl::string_view* value) {
  if (!absl::ConsumePrefix(&arg, "--") || !absl::ConsumePrefix(&arg, name) ||
      !absl::ConsumePrefix(&arg, "=")) {
    return false;
  }
  *value = arg;
  return true;
}

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  const int cores = ThreadPool(ThreadPool::Options{}).num_threads();
  flags.threads = {1};
  if (cores > 1) flags.threads.push_back(cores);
  flags.paths = {"scalar", "avx2", "avx512"};
  for (int a = 1; a < argc; ++a) {
    absl::string_view v;
    if (ParseFlag(argv[a], "n", &v)) {
      if (!absl::SimpleAtoi(v, &flags.n) || flags.n <= 0) Usage();
    } else if (ParseFlag(argv[a], "iters", &v)) {
      if (!absl::SimpleAtoi(v, &flags.iters) || flags.iters <= 0) Usage();
    } else if (ParseFlag(argv[a], "scalar_iters", &v)) {
      if (!absl::SimpleAtoi(v, &flags.scalar_iters) || flags.scalar_iters <= 0) Usage();
    } else if (ParseFlag(argv[a], "paths", &v)) {
      flags.paths = absl::StrSplit(v, ',', absl::SkipEmpty());
    } else if (ParseFlag(argv[a], "threads", &v)) {
      flags.threads.clear();
      for (absl::string_view t : absl::StrSplit(v, ',', absl::SkipEmpty())) {
        int k;
        if (!absl::SimpleAtoi(t, &k) || k <= 0) Usage();
        flags.threads.push_back(k);
      }
    } else {
      Usage();
    }
  }
  return flags;
}

void RunCases(const Flags& flags, int threads) {
  ThreadPool pool(ThreadPool::Options{threads, /*pin=*/true});
  const int nt = pool.num_threads();
  absl::StatusOr<std::unique_ptr<AdamRooflineBuffers>> buffers =
      AdamRooflineBuffers::Allocate(flags.n);
  if (!buffers.ok()) {
    std::fprintf(stderr, "bench_adam: %s\n", buffers.status().ToString().c_str());
    std::exit(1);
  }
  for (const DType grad_dtype : {DType::kFp16, DType::kBf16}) {
    // (Re)initialise with the tile-ownership rule: the first pass is also the first touch.
    (*buffers)->Fill(grad_dtype, pool);
    for (const std::string& name : flags.paths) {
      absl::StatusOr<SimdPath> path = ParseSimdPath(name);
      if (!path.ok()) {
        std::printf("# skip path=%s: %s\n", name.c_str(), path.status().ToString().c_str());
        continue;
      }
      const int iters = *path == SimdPath::kScalar ? flags.scalar_iters : flags.iters;
      const AdamVsRoofline best = MeasureAdamVsRoofline(**buffers, grad_dtype, *path, pool, iters);
      const double adam_rate = flags.n / best.adam_s * 1e-9;
      const double roofline_rate = flags.n / best.roofline_s * 1e-9;
      std::printf(
          "adam path=%s grad=%s out=%s threads=%d n=%lld gparams_per_s=%.2f "
          "roofline_gparams_per_s=%.2f ratio=%.2f\n",
          std::string(SimdPathName(*path)).c_str(), std::string(DTypeName(grad_dtype)).c_str(),
          std::string(DTypeName(grad_dtype)).c_str(), nt, static_cast<long long>(flags.n),
          adam_rate, roofline_rate, adam_rate / roofline_rate);
      std::fflush(stdout);
    }
  }
}

}  // namespace
}  // namespace offload

int main(int argc, char** argv) {
  const offload::Flags flags = offload::ParseFlags(argc, argv);
  std::printf(
      "# bench_adam: best of --iters=%d passes (scalar: %d) after 1 warm-up; adam and "
      "roofline alternate in the same process; best path on this CPU: %s\n",
      flags.iters, flags.scalar_iters,
      std::string(offload::SimdPathName(offload::BestSimdPath())).c_str());
  for (const int threads : flags.threads) offload::RunCases(flags, threads);
  return 0;
}
