// What bench_gpu measures (bench_gpu.cc runs it), and the report it prints: the table of
// ARCHITECTURE.md section 9's GPU rows and one machine-readable line per row
// (bench_gpu_report.cc). Results hold everything measured so far, so a run that stops early still
// reports what it has.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_BENCH_GPU_REPORT_H_
#define OFFLOAD_GPU_TRAINER_CUDA_BENCH_GPU_REPORT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_replace.h"
#include "base/dtype.h"
#include "gpu_trainer/cuda/runtime/cuda_device.h"
#include "model_spec/gpt2_config.h"

namespace offload::bench_gpu {

// A name as one token of the machine-readable lines.
inline std::string Token(const std::string& s) { return absl::StrReplaceAll(s, {{" ", "_"}}); }

struct BenchConfig {
  std::string model_name;
  Gpt2Config model;
  DType dtype = DType::kBf16;
  int batch = 0;
  int seq_len = 0;
  int steps = 0;
  int warmup = 0;
  bool activation_checkpointing = false;  // both the GPU-resident and the offload rows
};

struct GpuResult {
  int64_t params = 0;
  double step_s = 0;
  double tokens_per_s = 0;
  double mfu = 0;  // 0 when the peak is unknown
  float first_loss = 0, last_loss = 0;
  int skipped = 0;
  int64_t model_bytes = 0, optimizer_bytes = 0;
  int64_t peak_device_bytes = 0;  // SampleDeviceBytes after the set-up and after each step
  std::string attention;          // which attention ran (Gpt2Cuda::attention_path)
};

// One offload configuration: where the optimizer runs, over which data plane, with or without
// the delayed parameter update.
struct OffloadRow {
  std::string name;  // the machine-readable line's offload=NAME
  std::string what;  // the table's words
  double step_s = 0;
  // The last step's transfers against its compute, from the trace: the gradients' copies still
  // running after the GPU finished backward ("d2h_exposed"), and the share of the weights' upload
  // (on the GPU's clock) that ran while the forward that waited for it was on the GPU.
  double d2h_exposed_s = 0, h2d_in_forward = 0;
  int64_t peak_device_bytes = 0;  // SampleDeviceBytes after Start and after each step
};

struct OffloadResult {
  int64_t params = 0;
  std::vector<OffloadRow> rows;  // in the order they ran; inprocess first
  // The step time of row `name`, if it ran.
  std::optional<double> StepSeconds(const std::string& name) const {
    for (const OffloadRow& r : rows) {
      if (r.name == name) return r.step_s;
    }
    return std::nullopt;
  }
};

// The pinned bound of an offload step's transfers: cudaMemcpyAsync between page-locked host
// memory and the device, timed with events, best of `repeats`; and the bytes a step moves.
struct TransferResult {
  int64_t bytes = 0;  // per copy
  double h2d_s = 0, d2h_s = 0;
  int64_t step_bytes_each_way = 0;  // 16-bit gradients out, 16-bit weights in
};

// The offload step's own transfers of one model at full size, outside a step: its 16-bit weights
// up unit by unit and its gradients down range by range (transfer_schedule.h) through the staging
// classes the model uses, from and into registered (page-locked) host buffers as the trainer's
// are, and through the pinned ring from pageable ones for comparison. Wall time from the first
// copy queued to the last landed, best of a few.
struct PipelineTransfer {
  std::string model;
  int64_t bytes = 0;                      // each way
  double h2d_s = 0, d2h_s = 0;            // registered: cudaMemcpyAsync in place
  double ring_h2d_s = 0, ring_d2h_s = 0;  // pageable: through the pinned ring
  std::string registered_error;           // why registration failed, if it did
};

struct PlanResult {
  double memory_gib = 0;
  int batch = 0, seq_len = 0;
  DType dtype = DType::kBf16;
  bool checkpointing = false;
  double host_gib = 0;            // 0: no limit
  double gradient_bucket_mb = 0;  // 0: every gradient on the GPU
  std::string offload_binds = "-", gpu_only_binds = "-", window_binds = "-", stage3_binds = "-";
  int64_t offload_params = 0, gpu_only_params = 0;  // 0: nothing fits
  std::string offload_model = "none", gpu_only_model = "none";
  double ratio = 0;  // offload_params / gpu_only_params; 0 when either is 0
  // ZeRO-3 plans, with offload: one rank with a parameter window (the 16-bit model in pinned host
  // memory), and plan_ranks ranks each holding its partition and the window.
  int window_layers = 0, ranks = 0;
  int64_t window_params = 0, stage3_params = 0;
  std::string window_model = "none", stage3_model = "none";
};

struct HostRow {
  std::string model;
  int64_t params = 0;
  int threads = 0;
  int64_t bytes_each_way = 0;  // 16-bit gradients in, 16-bit weights out
  double adam_s = 0, roofline_s = 0;
  std::string skipped;  // why it was not measured; empty if it was
};

// One side of --largest: what the planner chose and what trained.
struct LargestRow {
  std::string side;  // "offload" or "gpu_only"
  DType dtype = DType::kBf16;
  int batch = 0, seq_len = 0;
  double device_free_gib = 0, host_gib = 0;  // what the planner was given; host 0: no limit
  Gpt2Config planned;                        // the planner's answer
  std::string binds = "-";                   // which side stops one more layer of it
  Gpt2Config model;                          // what trained: planned, or fewer layers
  int64_t params = 0;                        // of `model`; 0 when nothing trained
  int tries = 0;
  double step_s = 0, tflops = 0;     // model FLOPs (Gpt2FlopsPerToken) over the step time
  int64_t peak_device_bytes = 0;     // SampleDeviceBytes, the most seen
  int64_t planned_device_bytes = 0;  // the planner's total for `model`
  std::string error;                 // why nothing trained; empty when it did
};

// What one model of --model measured, or why it stopped.
struct ModelRun {
  BenchConfig b;
  std::optional<GpuResult> gpu;
  std::optional<OffloadResult> offload;
  std::optional<PipelineTransfer> pipeline;
  std::string error;  // empty if every row ran
};

struct Results {
  int shards = 1;  // --shards: the optimizer shards of the offload=server* rows
  std::optional<CudaDeviceInfo> device;
  double peak_flops = 0;
  std::string peak_source;
  std::vector<ModelRun> models;
  std::optional<TransferResult> transfer;
  std::optional<PlanResult> plan;
  std::vector<HostRow> host;
  std::vector<LargestRow> largest;  // offload, then gpu_only
};

// The offload model's parameters over the GPU-only model's, as trained; 0 unless both trained.
double LargestRatio(const std::vector<LargestRow>& rows);

// Prints the table and the machine-readable lines of what `r` holds.
void Report(const Results& r);

}  // namespace offload::bench_gpu

#endif  // OFFLOAD_GPU_TRAINER_CUDA_BENCH_GPU_REPORT_H_
