#include "gpu_trainer/cuda/bench_gpu_report.h"

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gpu_trainer/cuda/memory_planner.h"

namespace offload::bench_gpu {
namespace {

std::string Billions(int64_t n) { return absl::StrFormat("%.2fB", static_cast<double>(n) / 1e9); }

double Gbps(int64_t bytes, double seconds) { return seconds > 0 ? bytes / seconds / 1e9 : 0.0; }

void ReportModel(const Results& r, const ModelRun& m) {
  const BenchConfig& b = m.b;
  auto row = [](const std::string& what, const std::string& value) {
    std::printf("  %-34s %s\n", what.c_str(), value.c_str());
  };
  std::printf("bench_gpu: %s %s, batch %d x %d tokens, %d timed steps after %d warm-up\n",
              b.model_name.c_str(), std::string(DTypeName(b.dtype)).c_str(), b.batch, b.seq_len,
              b.steps, b.warmup);
  if (m.gpu) {
    const GpuResult& g = *m.gpu;
    row("params", absl::StrCat(g.params));
    row("attention", g.attention);
    row("GPU-resident step", absl::StrFormat("%.4f s", g.step_s));
    row("GPU-resident tokens/s", absl::StrFormat("%.0f", g.tokens_per_s));
    row("MFU", r.peak_flops > 0 ? absl::StrFormat("%.1f%% of %.1f TFLOP/s (%s)", 100 * g.mfu,
                                                  r.peak_flops / 1e12, r.peak_source)
                                : std::string("peak unknown for this GPU: pass --peak_tflops"));
    if (r.peak_flops > 0) {
      row("MFU formula",
          absl::StrFormat("%.4g FLOP/token (6 x matmul weights + 12 L T C) x %.0f tokens/s / "
                          "%.1f TFLOP/s",
                          Gpt2FlopsPerToken(b.model, b.seq_len), g.tokens_per_s,
                          r.peak_flops / 1e12));
    }
    row("loss first / last", absl::StrFormat("%.4f / %.4f", g.first_loss, g.last_loss));
    row("skipped (fp16 overflow)", absl::StrCat(g.skipped));
    row("GPU memory: model + optimizer",
        absl::StrFormat("%.2f + %.2f GiB", g.model_bytes / 1073741824.0,
                        g.optimizer_bytes / 1073741824.0));
  }
  if (m.offload) {
    for (const OffloadRow& o : m.offload->rows) {
      row(absl::StrCat("offload step, ", o.what),
          m.gpu ? absl::StrFormat("%.4f s (%.3fx GPU-resident)", o.step_s, o.step_s / m.gpu->step_s)
                : absl::StrFormat("%.4f s", o.step_s));
      row("  transfers not hidden",
          absl::StrFormat("gradients' D2H %.2f ms after backward; %.0f%% of the weights' H2D "
                          "inside forward",
                          1e3 * o.d2h_exposed_s, 100 * o.h2d_in_forward));
    }
  }
  if (m.pipeline) {
    const PipelineTransfer& p = *m.pipeline;
    if (!p.registered_error.empty()) {
      row("transfers, registered", absl::StrCat("not measured: ", p.registered_error));
    } else {
      row("transfers, registered memory",
          absl::StrFormat("%.0f MB: H2D %.1f GB/s, D2H %.1f GB/s", p.bytes / 1e6,
                          Gbps(p.bytes, p.h2d_s), Gbps(p.bytes, p.d2h_s)));
    }
    row("transfers, pinned ring (pageable)",
        absl::StrFormat("H2D %.1f GB/s, D2H %.1f GB/s", Gbps(p.bytes, p.ring_h2d_s),
                        Gbps(p.bytes, p.ring_d2h_s)));
    if (r.transfer && p.registered_error.empty()) {
      const TransferResult& t = *r.transfer;
      row("  / the pinned bound", absl::StrFormat("H2D %.2f, D2H %.2f (target >= 0.80)",
                                                  Gbps(p.bytes, p.h2d_s) / Gbps(t.bytes, t.h2d_s),
                                                  Gbps(p.bytes, p.d2h_s) / Gbps(t.bytes, t.d2h_s)));
    }
  }
  if (!m.error.empty()) row("stopped", m.error);
  std::printf("\n");
}

// The table, then the machine-readable lines: always last, always in this order.

}  // namespace

double LargestRatio(const std::vector<LargestRow>& rows) {
  int64_t offload = 0, gpu_only = 0;
  for (const LargestRow& l : rows) (l.side == "offload" ? offload : gpu_only) = l.params;
  return offload > 0 && gpu_only > 0 ? static_cast<double>(offload) / gpu_only : 0.0;
}

void Report(const Results& r) {
  auto row = [](const std::string& what, const std::string& value) {
    std::printf("  %-34s %s\n", what.c_str(), value.c_str());
  };
  const DType dtype_of_run = r.models.empty() ? DType::kBf16 : r.models.front().b.dtype;
  const std::string dtype(DTypeName(dtype_of_run));
  std::printf("\n");
  if (r.device) {
    std::printf("bench_gpu: %s\n\n", DescribeCudaDevice(*r.device).c_str());
  }
  for (const ModelRun& m : r.models) ReportModel(r, m);
  if (r.transfer) {
    const TransferResult& t = *r.transfer;
    row("pinned H2D / D2H (cudaMemcpyAsync)",
        absl::StrFormat("%.1f / %.1f GB/s (%lld MiB copies)", Gbps(t.bytes, t.h2d_s),
                        Gbps(t.bytes, t.d2h_s), static_cast<long long>(t.bytes >> 20)));
    row("a step's transfers at that bound",
        absl::StrFormat("%.0f MB each way: %.2f ms in, %.2f ms out", t.step_bytes_each_way / 1e6,
                        1e3 * t.step_bytes_each_way * t.h2d_s / t.bytes,
                        1e3 * t.step_bytes_each_way * t.d2h_s / t.bytes));
  }
  if (r.plan) {
    const PlanResult& p = *r.plan;
    const std::string on = absl::StrFormat(
        "%.1f GiB, %s, batch %d x %d%s%s%s", p.memory_gib, DTypeName(p.dtype), p.batch, p.seq_len,
        p.checkpointing ? ", activation checkpointing" : "",
        p.host_gib > 0 ? absl::StrFormat(", host %.0f GiB", p.host_gib) : "",
        p.gradient_bucket_mb > 0
            ? absl::StrFormat(", gradients in %.0f MiB buckets", p.gradient_bucket_mb)
            : "");
    std::printf("  largest model on %s\n", on.c_str());
    row("  with offload", absl::StrCat(Billions(p.offload_params), " (", p.offload_model,
                                       ", binds: ", p.offload_binds, ")"));
    row("  GPU only", absl::StrCat(Billions(p.gpu_only_params), " (", p.gpu_only_model,
                                   ", binds: ", p.gpu_only_binds, ")"));
    row("size ratio offload / GPU only", absl::StrFormat("%.2fx", p.ratio));
    std::printf("  ZeRO-3, a window of %d blocks:\n", p.window_layers);
    row("  offload + window, 1 GPU", absl::StrCat(Billions(p.window_params), " (", p.window_model,
                                                  ", binds: ", p.window_binds, ")"));
    row(absl::StrCat("  offload + stage 3, ", p.ranks, " GPUs"),
        absl::StrCat(Billions(p.stage3_params), " (", p.stage3_model, ", binds: ", p.stage3_binds,
                     ")"));
  }
  for (const HostRow& h : r.host) {
    const std::string what =
        absl::StrFormat("host Adam, %s (%s params)", h.model, Billions(h.params));
    if (!h.skipped.empty()) {
      row(what, absl::StrCat("skipped: ", h.skipped));
      continue;
    }
    row(what, absl::StrFormat("%.1f ms, roofline %.1f ms (%.2fx), %d threads; %.0f MB each way",
                              h.adam_s * 1e3, h.roofline_s * 1e3, h.roofline_s / h.adam_s,
                              h.threads, h.bytes_each_way / 1e6));
  }
  for (const LargestRow& l : r.largest) {
    const std::string what = absl::StrFormat(
        "largest trained, %s (%s, %d x %d, checkpointing; %.1f GiB free, host %.0f GiB)",
        l.side == "offload" ? "offload" : "GPU only", DTypeName(l.dtype), l.batch, l.seq_len,
        l.device_free_gib, l.host_gib);
    std::printf("  %s\n", what.c_str());
    if (!l.error.empty()) {
      row("  stopped", l.error);
      continue;
    }
    row("  model", absl::StrCat(Billions(l.params), " (", DescribeConfig(l.model), "; planned ",
                                l.planned.num_layers, " layers, binds: ", l.binds, ")"));
    row("  step, model TFLOP/s", absl::StrFormat("%.3f s, %.1f", l.step_s, l.tflops));
    row("  device peak / planned",
        absl::StrFormat("%.2f / %.2f GiB", l.peak_device_bytes / 1073741824.0,
                        l.planned_device_bytes / 1073741824.0));
  }
  if (const double ratio = LargestRatio(r.largest); ratio > 0) {
    row("largest trained, offload / GPU only", absl::StrFormat("%.2fx", ratio));
  }
  std::printf("\n");

  if (r.device) {
    const CudaDeviceInfo& d = *r.device;
    std::printf("gpu device=%d name=%s sm=%d%d sms=%d memory_gib=%.1f peak_tflops=%.1f peak=%s\n",
                d.ordinal, Token(d.name).c_str(), d.compute_major, d.compute_minor, d.sm_count,
                d.total_bytes / 1073741824.0, r.peak_flops / 1e12, Token(r.peak_source).c_str());
  }
  for (const ModelRun& m : r.models) {
    const BenchConfig& b = m.b;
    if (m.gpu) {
      std::printf(
          "gpu model=%s dtype=%s tokens_per_s=%.0f mfu=%.4f step_s=%.5f batch=%d seq_len=%d "
          "params=%lld skipped=%d attention=%s flops_per_token=%.6g peak_tflops=%.1f\n",
          b.model_name.c_str(), dtype.c_str(), m.gpu->tokens_per_s, m.gpu->mfu, m.gpu->step_s,
          b.batch, b.seq_len, static_cast<long long>(m.gpu->params), m.gpu->skipped,
          Token(m.gpu->attention).c_str(), Gpt2FlopsPerToken(b.model, b.seq_len),
          r.peak_flops / 1e12);
    }
    if (m.offload) {
      for (const OffloadRow& o : m.offload->rows) {
        std::printf(
            "gpu offload=%s params=%lld step_s=%.5f vs_gpu=%.3f model=%s dtype=%s batch=%d "
            "seq_len=%d shards=%d d2h_exposed_s=%.5f h2d_in_forward=%.3f\n",
            o.name.c_str(), static_cast<long long>(m.offload->params), o.step_s,
            m.gpu ? o.step_s / m.gpu->step_s : 0.0, b.model_name.c_str(), dtype.c_str(), b.batch,
            b.seq_len, o.name.rfind("server", 0) == 0 ? r.shards : 0, o.d2h_exposed_s,
            o.h2d_in_forward);
      }
      const std::optional<double> local = m.offload->StepSeconds("inprocess");
      const std::optional<double> served = m.offload->StepSeconds("server");
      if (local && served && m.gpu) {
        std::printf(
            "gpu offload_ratio model=%s server_vs_inprocess=%.3f inprocess_vs_gpu=%.3f "
            "server_vs_gpu=%.3f\n",
            b.model_name.c_str(), *served / *local, *local / m.gpu->step_s,
            *served / m.gpu->step_s);
      }
    }
    if (m.pipeline && r.transfer) {
      const PipelineTransfer& p = *m.pipeline;
      const TransferResult& t = *r.transfer;
      std::printf(
          "gpu pipeline model=%s bytes=%lld h2d_gbps=%.2f d2h_gbps=%.2f ring_h2d_gbps=%.2f "
          "ring_d2h_gbps=%.2f h2d_vs_bound=%.3f d2h_vs_bound=%.3f registered=%s\n",
          b.model_name.c_str(), static_cast<long long>(p.bytes), Gbps(p.bytes, p.h2d_s),
          Gbps(p.bytes, p.d2h_s), Gbps(p.bytes, p.ring_h2d_s), Gbps(p.bytes, p.ring_d2h_s),
          Gbps(p.bytes, p.h2d_s) / Gbps(t.bytes, t.h2d_s),
          Gbps(p.bytes, p.d2h_s) / Gbps(t.bytes, t.d2h_s),
          p.registered_error.empty() ? "yes" : Token(p.registered_error).c_str());
    }
    if (!m.error.empty()) {
      std::printf("gpu error model=%s what=%s\n", b.model_name.c_str(), Token(m.error).c_str());
    }
  }
  if (r.transfer) {
    const TransferResult& t = *r.transfer;
    std::printf(
        "gpu transfer bytes=%lld h2d_gbps=%.2f d2h_gbps=%.2f step_bytes_each_way=%lld "
        "step_h2d_floor_s=%.5f step_d2h_floor_s=%.5f\n",
        static_cast<long long>(t.bytes), Gbps(t.bytes, t.h2d_s), Gbps(t.bytes, t.d2h_s),
        static_cast<long long>(t.step_bytes_each_way), t.step_bytes_each_way * t.h2d_s / t.bytes,
        t.step_bytes_each_way * t.d2h_s / t.bytes);
  }
  for (const HostRow& h : r.host) {
    if (!h.skipped.empty()) {
      std::printf("gpu host model=%s params=%lld skipped=%s\n", h.model.c_str(),
                  static_cast<long long>(h.params), Token(h.skipped).c_str());
      continue;
    }
    std::printf(
        "gpu host model=%s params=%lld dtype=%s threads=%d adam_s=%.5f roofline_s=%.5f "
        "ratio=%.3f bytes_each_way=%lld\n",
        h.model.c_str(), static_cast<long long>(h.params), dtype.c_str(), h.threads, h.adam_s,
        h.roofline_s, h.roofline_s / h.adam_s, static_cast<long long>(h.bytes_each_way));
  }
  if (r.plan) {
    const PlanResult& p = *r.plan;
    std::printf(
        "gpu plan memory_gib=%.1f offload_params=%lld offload_model=%s gpu_only_params=%lld "
        "gpu_only_model=%s ratio=%.2f batch=%d seq_len=%d dtype=%s checkpointing=%d "
        "host_gib=%.1f offload_binds=%s gpu_only_binds=%s gradient_bucket_mb=%.1f\n",
        p.memory_gib, static_cast<long long>(p.offload_params), p.offload_model.c_str(),
        static_cast<long long>(p.gpu_only_params), p.gpu_only_model.c_str(), p.ratio, p.batch,
        p.seq_len, std::string(DTypeName(p.dtype)).c_str(), p.checkpointing ? 1 : 0, p.host_gib,
        p.offload_binds.c_str(), p.gpu_only_binds.c_str(), p.gradient_bucket_mb);
    std::printf(
        "gpu plan_zero3 memory_gib=%.1f window_layers=%d window_params=%lld window_model=%s "
        "ranks=%d stage3_params=%lld stage3_model=%s\n",
        p.memory_gib, p.window_layers, static_cast<long long>(p.window_params),
        p.window_model.c_str(), p.ranks, static_cast<long long>(p.stage3_params),
        p.stage3_model.c_str());
  }
  for (const LargestRow& l : r.largest) {
    if (!l.error.empty()) {
      std::printf("gpu largest side=%s error=%s planned_model=%s\n", l.side.c_str(),
                  Token(l.error).c_str(),
                  l.planned.num_layers > 0 ? Token(DescribeConfig(l.planned)).c_str() : "none");
      continue;
    }
    std::printf(
        "gpu largest side=%s params=%lld layers=%d channels=%d heads=%d step_s=%.5f tflops=%.2f "
        "peak_device_gib=%.2f planned_device_gib=%.2f binds=%s planned_layers=%d tries=%d "
        "batch=%d seq_len=%d dtype=%s device_free_gib=%.1f host_gib=%.1f\n",
        l.side.c_str(), static_cast<long long>(l.params), l.model.num_layers, l.model.channels,
        l.model.num_heads, l.step_s, l.tflops, l.peak_device_bytes / 1073741824.0,
        l.planned_device_bytes / 1073741824.0, l.binds.c_str(), l.planned.num_layers, l.tries,
        l.batch, l.seq_len, std::string(DTypeName(l.dtype)).c_str(), l.device_free_gib, l.host_gib);
  }
  if (const double ratio = LargestRatio(r.largest); ratio > 0) {
    std::printf("gpu largest ratio=%.3f\n", ratio);
  }
  std::fflush(stdout);
}

// Both sides of --largest, offload first; false unless both trained.

}  // namespace offload::bench_gpu
