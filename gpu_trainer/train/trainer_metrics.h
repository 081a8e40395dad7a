// The trainer rank's metrics (docs/METRICS.md, "Trainer rank"): updated once per step and once
// per phase, never per element, so a rank pays a few atomic adds and histogram observations a step.
#ifndef OFFLOAD_GPU_TRAINER_TRAIN_TRAINER_METRICS_H_
#define OFFLOAD_GPU_TRAINER_TRAIN_TRAINER_METRICS_H_

#include <cstdint>
#include <string>

#include "gpu_trainer/train/model_runner.h"
#include "gpu_trainer/train/trainer.h"
#include "prometheus/gauge.h"

namespace offload {

struct TrainerInfo {
  std::string job_id;
  int rank = 0;
  int world_size = 1;
  std::string device;  // cpu or cuda
  std::string model;   // the preset
};

// Registers offload_trainer_info and the per-step metrics.
void SetTrainerInfo(const TrainerInfo& info);

// offload_trainer_info of a torch job's rank while its pool worker runs it, removed at the end: a
// worker runs one attempt after another, and a process of several workers runs several at once.
class TrainerInfoScope {
 public:
  explicit TrainerInfoScope(const TrainerInfo& info);
  ~TrainerInfoScope();
  TrainerInfoScope(const TrainerInfoScope&) = delete;
  TrainerInfoScope& operator=(const TrainerInfoScope&) = delete;

 private:
  prometheus::Gauge* gauge_;
};

// After each step: `tokens` this rank trained on, `flops` the model FLOPs they took.
void RecordTrainerStep(const StepReport& report, double step_seconds, double tokens, double flops);

void RecordDeviceMemory(const ModelRunner::DeviceMemory& memory);

// A phase's duration into offload_trainer_phase_seconds: the PhaseObserver
// (optimizer_client/sender/phase_trace.h) the gpu_trainer program sets at start.
void ObserveTrainerPhaseSeconds(const char* phase, double seconds);

// A torch job's rank, as its pool worker hears of it from the script's reports (a report may
// cover several steps): the counters grow by what happened since the last report, the gauges take
// the newest values. The worker serves them on its own --metrics_address (with --workers=N, the
// counters of its N ranks add up, and the gauges hold the last report).
struct ReportedProgress {
  uint64_t step = 0;
  uint64_t new_steps = 0;
  double new_tokens = 0;
  float loss = 0;
  float loss_scale = 1;
  float lr = 0;
  double grad_norm = 0;
  double tokens_per_s = 0;
};
void RecordReportedProgress(const ReportedProgress& progress);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_TRAIN_TRAINER_METRICS_H_
