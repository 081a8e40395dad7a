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

// Untouched memory: pages are placed by whichever thread writes them first.
template <typename T>
T* AllocateUntouched(int64_t n) {
  const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 4095) / 4096 * 4096;
  void* p = std::aligned_alloc(4096, bytes);
  if (p == nullptr) {
    std::fprintf(stderr, "out of memory allocating %zu bytes\n", bytes);
    std::exit(1);
  }
  return static_cast<T*>(p);
}

struct Buffers {
  int64_t n;
  uint16_t* grad;     // (n,) fp16 or bf16
  float* param;       // (n,)
  float* exp_avg;     // (n,)
  float* exp_avg_sq;  // (n,)
  uint16_t* out;      // (n,)
};

// Positive, moderate values: the roofline's `+= g` keeps every stream finite and normal across
// iterations (denormal or NaN operands would time something else than memory).
void FillTile(const Buffers& b, DType grad_dtype, int64_t lo, int64_t hi) {
  uint32_t x = static_cast<uint32_t>(lo) * 2654435761u + 12345u;
  for (int64_t i = lo; i < hi; ++i) {
    x = x * 1664525u + 1013904223u;
    const float u = static_cast<float>(x >> 8) * (1.0f / 16777216.0f);  // [0, 1)
    const float g = 1e-3f + 9e-3f * u;
    b.grad[i] = grad_dtype == DType::kBf16 ? FloatToBf16(g) : FloatToFp16(g);
    b.param[i] = u - 0.5f;
    b.exp_avg[i] = 0.0f;
    b.exp_avg_sq[i] = 1e-6f;
    b.out[i] = 0;
  }
}

AdamSpan SpanOf(const Buffers& b, DType grad_dtype, int64_t lo, int64_t hi) {
  AdamSpan s;
  s.grad = b.grad + lo;
  s.grad_dtype = grad_dtype;
  s.param = b.param + lo;
  s.exp_avg = b.exp_avg + lo;
  s.exp_avg_sq = b.exp_avg_sq + lo;
  s.out = b.out + lo;
  s.out_dtype = grad_dtype;  // fp16 grads -> fp16 copy, bf16 -> bf16
  s.n = hi - lo;
  return s;
}

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

void RunCases(const Flags& flags, int threads) {
  ThreadPool pool(ThreadPool::Options{threads, /*pin=*/true});
  const int nt = pool.num_threads();
  const int64_t n = flags.n;
  Buffers b{n,
            AllocateUntouched<uint16_t>(n),
            AllocateUntouched<float>(n),
            AllocateUntouched<float>(n),
            AllocateUntouched<float>(n),
            AllocateUntouched<uint16_t>(n)};

  AdamHyperParams hp;
  hp.weight_decay = 0.01f;
  for (const DType grad_dtype : {DType::kFp16, DType::kBf16}) {
    // (Re)initialise with the tile-ownership rule: the first pass is also the first touch.
    pool.Run([&](int t) {
      ForEachOwnedTile(0, n, t, nt,
                       [&](int64_t lo, int64_t hi) { FillTile(b, grad_dtype, lo, hi); });
    });
    for (const std::string& name : flags.paths) {
      absl::StatusOr<SimdPath> path = ParseSimdPath(name);
      if (!path.ok()) {
        std::printf("# skip path=%s: %s\n", name.c_str(), path.status().ToString().c_str());
        continue;
      }
      const AdamKernelFn adam = GetAdamKernel(*path);
      const RooflineKernelFn roofline = GetRooflineKernel(*path);
      const int iters = *path == SimdPath::kScalar ? flags.scalar_iters : flags.iters;
      int64_t step = 0;
      auto run_adam = [&] {
        const AdamStepScalars s = ComputeAdamStepScalars(hp, hp.lr, ++step, 1.0f);
        const auto start = std::chrono::steady_clock::now();
        pool.Run([&](int t) {
          ForEachOwnedTile(0, n, t, nt,
                           [&](int64_t lo, int64_t hi) { adam(s, SpanOf(b, grad_dtype, lo, hi)); });
        });
        return Seconds(std::chrono::steady_clock::now() - start);
      };
      auto run_roofline = [&] {
        const auto start = std::chrono::steady_clock::now();
        pool.Run([&](int t) {
          ForEachOwnedTile(0, n, t, nt, [&](int64_t lo, int64_t hi) {
            roofline(SpanOf(b, grad_dtype, lo, hi));
          });
        });
        return Seconds(std::chrono::steady_clock::now() - start);
      };
      run_adam();  // warm-up: page tables, TLBs, frequency
      run_roofline();
      double best_adam = 1e30, best_roofline = 1e30;
      for (int k = 0; k < iters; ++k) {
        best_adam = std::min(best_adam, run_adam());
        best_roofline = std::min(best_roofline, run_roofline());
      }
      const double adam_rate = n / best_adam * 1e-9;
      const double roofline_rate = n / best_roofline * 1e-9;
      std::printf(
          "adam path=%s grad=%s out=%s threads=%d n=%lld gparams_per_s=%.2f "
          "roofline_gparams_per_s=%.2f ratio=%.2f\n",
          std::string(SimdPathName(*path)).c_str(), std::string(DTypeName(grad_dtype)).c_str(),
          std::string(DTypeName(grad_dtype)).c_str(), nt, static_cast<long long>(n), adam_rate,
          roofline_rate, adam_rate / roofline_rate);
      std::fflush(stdout);
    }
  }
  std::free(b.grad);
  std::free(b.param);
  std::free(b.exp_avg);
  std::free(b.exp_avg_sq);
  std::free(b.out);
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
