// What the metrics cost on the hot path, beside the work they account for (ARCHITECTURE.md section
// 8: metrics must be cheap). A range step of the optimizer server adds a few counter increments and
// one histogram observation (BM_RangeStepAccounting); the smallest unit of work they account
// for is one Adam wave of 2M elements on one thread (BM_AdamWave). The ratio of the two, from
// one run, is in docs/PERFORMANCE.md.
//
//   bench_metrics [--benchmark_filter=...]
#include <cstdint>
#include <vector>

#include "base/metrics/metrics.h"
#include "benchmark/benchmark.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"
#include "cpu_optimizer_server/shard/server_metrics.h"

namespace offload {
namespace {

void BM_CounterIncrement(benchmark::State& state) {
  prometheus::Counter& c = prometheus::BuildCounter()
                               .Name("offload_bench_events_total")
                               .Help("Bench.")
                               .Register(MetricsRegistry())
                               .Add({});
  for (auto _ : state) c.Increment(4096);
  benchmark::DoNotOptimize(c.Value());
}
BENCHMARK(BM_CounterIncrement);

void BM_HistogramObserve(benchmark::State& state) {
  prometheus::Histogram& h = prometheus::BuildHistogram()
                                 .Name("offload_bench_seconds")
                                 .Help("Bench.")
                                 .Register(MetricsRegistry())
                                 .Add({}, DurationBuckets());
  double v = 0.0001;
  for (auto _ : state) {
    h.Observe(v);
    v = v < 100 ? v * 1.7 : 0.0001;
  }
}
BENCHMARK(BM_HistogramObserve);

// One range step of a shard over gRPC in 4 gradient chunks: what StepSession and the transport
// add to it.
void BM_RangeStepAccounting(benchmark::State& state) {
  ServerMetrics& m = ServerMetrics::Get();
  m.Enable();
  for (auto _ : state) {
    for (int chunk = 0; chunk < 4; ++chunk) m.Received(DataPlane::kGrpc, 1 << 20);
    m.Sent(DataPlane::kGrpc, 4 << 20);
    m.StepApplied(2 << 20, 0.01);
  }
}
BENCHMARK(BM_RangeStepAccounting);

// The work a range step's accounting sits beside, at its smallest: one wave (2M elements) of
// the fused Adam pass, on one thread, with the best SIMD path of this machine.
void BM_AdamWave(benchmark::State& state) {
  const int64_t n = int64_t{2} << 20;
  std::vector<uint16_t> grad(n, 0x3c00), out(n);  // (n,) fp16 ones, (n,) fp16
  std::vector<float> param(n, 0.5f), m(n, 0.0f), v(n, 0.0f);
  AdamHyperParams hp;
  const AdamStepScalars s = ComputeAdamStepScalars(hp, 1e-4f, 1, 1.0f);
  AdamSpan span;
  span.grad = grad.data();
  span.grad_dtype = DType::kFp16;
  span.param = param.data();
  span.exp_avg = m.data();
  span.exp_avg_sq = v.data();
  span.out = out.data();
  span.out_dtype = DType::kFp16;
  span.n = n;
  const AdamKernelFn kernel = GetAdamKernel(BestSimdPath());
  for (auto _ : state) {
    kernel(s, span);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK(BM_AdamWave)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace offload
