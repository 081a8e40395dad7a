// The trainer rank's metrics (docs/METRICS.md, "Trainer rank"): updated once per step and once
// per phase, never per element, so a rank pays a few atomic adds and histogram observations a step.
#ifndef OFFLOAD_GPU_TRAINER_TRAIN_TRAINER_METRICS_H_
#define OFFLOAD_GPU_TRAINER_TRAIN_TRAINER_METRICS_H_

#include <cstdint>
#include <string>

#include "gpu_trainer/train/model_runner.h"
#include "gpu_trainer/train/trainer.h"

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

// After each step: `tokens` this rank trained on, `flops` the model FLOPs they took.
void RecordTrainerStep(const StepReport& report, double step_seconds, double tokens, double flops);

void RecordDeviceMemory(const ModelRunner::DeviceMemory& memory);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_TRAIN_TRAINER_METRICS_H_
