#include "cpu_optimizer_server/adam/adam_roofline.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace offload {
namespace {

// Untouched memory: pages are placed by whichever thread writes them first.
template <typename T>
T* AllocateUntouched(int64_t n) {
  const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 4095) / 4096 * 4096;
  return static_cast<T*>(std::aligned_alloc(4096, bytes));
}

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

}  // namespace

absl::StatusOr<std::unique_ptr<AdamRooflineBuffers>> AdamRooflineBuffers::Allocate(int64_t n) {
  if (n <= 0) return absl::InvalidArgumentError("AdamRooflineBuffers: n must be positive");
  std::unique_ptr<AdamRooflineBuffers> b(new AdamRooflineBuffers());
  b->n_ = n;
  b->grad_ = AllocateUntouched<uint16_t>(n);
  b->param_ = AllocateUntouched<float>(n);
  b->exp_avg_ = AllocateUntouched<float>(n);
  b->exp_avg_sq_ = AllocateUntouched<float>(n);
  b->out_ = AllocateUntouched<uint16_t>(n);
  if (b->grad_ == nullptr || b->param_ == nullptr || b->exp_avg_ == nullptr ||
      b->exp_avg_sq_ == nullptr || b->out_ == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the Adam state of ", n, " elements (", (n * 16) >> 20, " MiB)"));
  }
  return b;
}

AdamRooflineBuffers::~AdamRooflineBuffers() {
  std::free(grad_);
  std::free(param_);
  std::free(exp_avg_);
  std::free(exp_avg_sq_);
  std::free(out_);
}

void AdamRooflineBuffers::Fill(DType grad_dtype, ThreadPool& pool, DType state_dtype) {
  const int nt = pool.num_threads();
  pool.Run([&](int t) {
    ForEachOwnedTile(0, n_, t, nt, [&](int64_t lo, int64_t hi) {
      uint32_t x = static_cast<uint32_t>(lo) * 2654435761u + 12345u;
      for (int64_t i = lo; i < hi; ++i) {
        x = x * 1664525u + 1013904223u;
        const float u = static_cast<float>(x >> 8) * (1.0f / 16777216.0f);  // [0, 1)
        const float g = 1e-3f + 9e-3f * u;
        grad_[i] = grad_dtype == DType::kBf16 ? FloatToBf16(g) : FloatToFp16(g);
        param_[i] = u - 0.5f;
        if (state_dtype == DType::kBf16) {
          reinterpret_cast<uint16_t*>(exp_avg_)[i] = 0;
          reinterpret_cast<uint16_t*>(exp_avg_sq_)[i] = FloatToBf16(1e-6f);
        } else {
          exp_avg_[i] = 0.0f;
          exp_avg_sq_[i] = 1e-6f;
        }
        out_[i] = 0;
      }
    });
  });
}

AdamSpan AdamRooflineBuffers::Span(DType grad_dtype, int64_t lo, int64_t hi,
                                   DType state_dtype) const {
  AdamSpan s;
  s.grad = grad_ + lo;
  s.grad_dtype = grad_dtype;
  s.param = param_ + lo;
  if (state_dtype == DType::kBf16) {
    s.exp_avg = reinterpret_cast<uint16_t*>(exp_avg_) + lo;
    s.exp_avg_sq = reinterpret_cast<uint16_t*>(exp_avg_sq_) + lo;
  } else {
    s.exp_avg = exp_avg_ + lo;
    s.exp_avg_sq = exp_avg_sq_ + lo;
  }
  s.state_dtype = state_dtype;
  s.first_element = lo;
  s.out = out_ + lo;
  s.out_dtype = grad_dtype;  // fp16 grads -> fp16 copy, bf16 -> bf16
  s.n = hi - lo;
  return s;
}

AdamVsRoofline MeasureAdamVsRoofline(const AdamRooflineBuffers& b, DType grad_dtype, SimdPath path,
                                     ThreadPool& pool, int iters, DType state_dtype) {
  const int nt = pool.num_threads();
  const int64_t n = b.n();
  const AdamKernelFn adam = GetAdamKernel(path);
  const RooflineKernelFn roofline = GetRooflineKernel(path);
  AdamHyperParams hp;
  hp.weight_decay = 0.01f;
  int64_t step = 0;
  auto run_adam = [&] {
    const AdamStepScalars s = ComputeAdamStepScalars(hp, hp.lr, ++step, 1.0f);
    const uint32_t key = StochasticRoundingKey(step);
    const auto start = std::chrono::steady_clock::now();
    pool.Run([&](int t) {
      ForEachOwnedTile(0, n, t, nt, [&](int64_t lo, int64_t hi) {
        AdamSpan span = b.Span(grad_dtype, lo, hi, state_dtype);
        span.rounding_key = key;
        adam(s, span);
      });
    });
    return Seconds(std::chrono::steady_clock::now() - start);
  };
  auto run_roofline = [&] {
    const auto start = std::chrono::steady_clock::now();
    pool.Run([&](int t) {
      ForEachOwnedTile(0, n, t, nt, [&](int64_t lo, int64_t hi) {
        roofline(b.Span(grad_dtype, lo, hi, state_dtype));
      });
    });
    return Seconds(std::chrono::steady_clock::now() - start);
  };
  run_adam();  // warm-up: page tables, TLBs, frequency
  run_roofline();
  AdamVsRoofline best{1e30, 1e30};
  for (int k = 0; k < std::max(1, iters); ++k) {
    best.adam_passes_s.push_back(run_adam());
    best.roofline_passes_s.push_back(run_roofline());
    best.adam_s = std::min(best.adam_s, best.adam_passes_s.back());
    best.roofline_s = std::min(best.roofline_s, best.roofline_passes_s.back());
  }
  return best;
}

}  // namespace offload
