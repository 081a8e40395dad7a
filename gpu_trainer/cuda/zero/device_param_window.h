// ZeRO-3 on the CUDA backend (ARCHITECTURE.md section 10): the device holds a window of the 16-bit
// weights (param_window.h's slots), not the model. Each use of a unit waits on the compute stream
// for its fill; each release is recorded there, and the fill that follows it in the plan is queued
// at once: with one rank a copy from the whole 16-bit model in host memory (page-locked: straight
// from it; else through the pinned ring) on the host-to-device stream; with W NCCL ranks an
// all-gather on the device of the unit's pieces from the ranks' partitions, each rank's partition
// held on its own GPU. No host waits for one rank; with NCCL the host waits for a slot's previous
// use before gathering into it.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_ZERO_DEVICE_PARAM_WINDOW_H_
#define OFFLOAD_GPU_TRAINER_CUDA_ZERO_DEVICE_PARAM_WINDOW_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gpu_trainer/collectives/collectives.h"
#include "gpu_trainer/cuda/runtime/pinned_staging.h"
#include "gpu_trainer/cuda/zero/param_window.h"
#include "model_spec/gpt2_config.h"

namespace offload {

struct DeviceParamWindowOptions {
  Gpt2Config config;
  int window_layers = 2;
  // NCCL ranks (a communicator of the window's own: its gathers run on the compute thread while
  // the gradients' reduce-scatters run on another); one rank's too, which gathers its whole
  // model from itself (the path's test on one GPU). Null: the host model.
  Collectives* collectives = nullptr;
  int64_t padded_length = 0;  // the flat space the ranks partition (W > 1)
};

// Elements of this rank's partition on the device (with NCCL ranks), else 0.
int64_t DevicePartitionElements(const DeviceParamWindowOptions& options);

class DeviceParamWindow {
 public:
  using RegisteredFn = std::function<bool(const void* p, int64_t bytes)>;
  // window: (PlanParamWindow(...).total_elements,) 16-bit device memory; partition:
  // (DevicePartitionElements,) 16-bit device memory, or null when that is 0. h2d: the model's
  // host-to-device ring; compute: the stream forward and backward run on.
  static absl::StatusOr<std::unique_ptr<DeviceParamWindow>> Create(
      const DeviceParamWindowOptions& options, void* window, void* partition,
      HostToDeviceStaging* h2d, cudaStream_t compute, RegisteredFn registered);
  ~DeviceParamWindow();

  const ParamWindowPlan& plan() const { return plan_; }
  bool gathers() const { return partition_ != nullptr; }

  // One rank: the whole 16-bit model (num_params,) in host memory, read by the fills of every
  // step until the next call; it must not change while a step runs.
  void SetHostWeights(const uint16_t* w16) { host_ = w16; }
  // NCCL ranks: this rank's partition (padded_length / W,) on the host, copied to the device now.
  absl::Status SetPartition(const uint16_t* partition16);

  // Starts a step's sequence of uses (a Forward): the slots' first fills are queued once every
  // kernel queued before has run. A Forward without a Backward after it is followed by the next
  // Forward's BeginStep, which starts again.
  absl::Status BeginStep();
  // Before use i's first kernel: the compute stream waits for its fill; returns the unit's weights
  // on the device, (Gpt2UnitRange(unit).size(),).
  absl::StatusOr<void*> Acquire(int use);
  // After use i's last kernel is queued: its slot may be refilled for the use that follows.
  absl::Status Release(int use);

  int64_t fills() const { return fills_; }  // units filled so far

 private:
  DeviceParamWindow(const DeviceParamWindowOptions& options, HostToDeviceStaging* h2d,
                    cudaStream_t compute, RegisteredFn registered);
  absl::Status Init(void* window, void* partition);
  absl::Status Fill(int use);
  void* UseData(int use) const;  // where use `use`'s unit is in the window

  const DeviceParamWindowOptions options_;
  HostToDeviceStaging* const h2d_;
  const cudaStream_t compute_;
  const RegisteredFn registered_;
  ParamWindowPlan plan_;
  char* window_ = nullptr;
  uint16_t* partition_ = nullptr;  // (P,) on the device, W > 1
  const uint16_t* host_ = nullptr;
  std::vector<cudaEvent_t> filled_;    // (uses,) on the H2D stream after the use's fill
  std::vector<cudaEvent_t> released_;  // (uses,) on the compute stream after the use
  std::vector<bool> fill_queued_;      // (uses,) this step
  cudaEvent_t compute_idle_ = nullptr;
  int64_t fills_ = 0;
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_ZERO_DEVICE_PARAM_WINDOW_H_
