#include "gpu_trainer/cuda/zero/device_param_window.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "gpu_trainer/cuda/runtime/cuda_check.h"
#include "model_spec/gradient_buckets.h"
#include "model_spec/param_layout.h"

namespace offload {
namespace {

// Any NCCL communicator, one rank's too (the test of the path on one GPU).
bool Gathers(const DeviceParamWindowOptions& o) { return o.collectives != nullptr; }

}  // namespace

int64_t DevicePartitionElements(const DeviceParamWindowOptions& options) {
  return Gathers(options) ? options.padded_length / options.collectives->world_size() : 0;
}

DeviceParamWindow::DeviceParamWindow(const DeviceParamWindowOptions& options,
                                     HostToDeviceStaging* h2d, cudaStream_t compute,
                                     RegisteredFn registered)
    : options_(options), h2d_(h2d), compute_(compute), registered_(std::move(registered)) {}

absl::StatusOr<std::unique_ptr<DeviceParamWindow>> DeviceParamWindow::Create(
    const DeviceParamWindowOptions& options, void* window, void* partition,
    HostToDeviceStaging* h2d, cudaStream_t compute, RegisteredFn registered) {
  if (options.window_layers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("param_window_layers must be >= 1, got ", options.window_layers));
  }
  if (window == nullptr || h2d == nullptr) {
    return absl::InvalidArgumentError("the parameter window needs device memory and a copy ring");
  }
  if (Gathers(options)) {
    const int W = options.collectives->world_size();
    if (options.padded_length < Gpt2NumParams(options.config) || options.padded_length % W != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("the parameter window: padded_length ", options.padded_length,
                       " does not cover the model in ", W, " equal partitions"));
    }
    if (partition == nullptr) {
      return absl::InvalidArgumentError("the parameter window over NCCL ranks needs a partition");
    }
  }
  std::unique_ptr<DeviceParamWindow> w(
      new DeviceParamWindow(options, h2d, compute, std::move(registered)));
  OFFLOAD_RETURN_IF_ERROR(w->Init(window, partition));
  return w;
}

absl::Status DeviceParamWindow::Init(void* window, void* partition) {
  plan_ = PlanParamWindow(options_.config, options_.window_layers);
  window_ = static_cast<char*>(window);
  if (Gathers(options_)) partition_ = static_cast<uint16_t*>(partition);
  const size_t uses = plan_.uses.size();
  fill_queued_.assign(uses, false);
  for (std::vector<cudaEvent_t>* events : {&filled_, &released_}) {
    events->assign(uses, nullptr);
    for (cudaEvent_t& e : *events) {
      OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
  }
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&compute_idle_, cudaEventDisableTiming));
  return absl::OkStatus();
}

DeviceParamWindow::~DeviceParamWindow() {
  if (compute_ != nullptr) cudaStreamSynchronize(compute_);
  cudaStreamSynchronize(h2d_->stream());
  for (std::vector<cudaEvent_t>* events : {&filled_, &released_}) {
    for (cudaEvent_t e : *events) {
      if (e != nullptr) cudaEventDestroy(e);
    }
  }
  if (compute_idle_ != nullptr) cudaEventDestroy(compute_idle_);
}

void* DeviceParamWindow::UseData(int use) const {
  return window_ + plan_.uses[use].offset * int64_t{sizeof(uint16_t)};
}

absl::Status DeviceParamWindow::SetPartition(const uint16_t* partition16) {
  if (!gathers()) {
    return absl::FailedPreconditionError("the parameter window has no device partition (one rank)");
  }
  if (partition16 == nullptr) return absl::InvalidArgumentError("SetPartition: null");
  // Nothing queued may still gather from the old partition.
  // On the compute stream, synchronised: a plain copy from pageable memory may return before its
  // DMA has landed, and the gathers run on NCCL's stream.
  const int64_t P = DevicePartitionElements(options_);
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(partition_, partition16, P * sizeof(uint16_t),
                                               cudaMemcpyHostToDevice, compute_));
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_));
  return absl::OkStatus();
}

absl::Status DeviceParamWindow::BeginStep() {
  if (!gathers() && host_ == nullptr) {
    return absl::FailedPreconditionError(
        "the parameter window has no weights: SetHostWeights before the first Forward");
  }
  std::fill(fill_queued_.begin(), fill_queued_.end(), false);
  // The first fills overwrite slots whatever was queued before (a Forward without a Backward)
  // may still read.
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(compute_idle_, compute_));
  for (int use : plan_.initial_fills) OFFLOAD_RETURN_IF_ERROR(Fill(use));
  return absl::OkStatus();
}

absl::Status DeviceParamWindow::Fill(int use) {
  const WindowUse& u = plan_.uses[use];
  const ParamRange r = Gpt2UnitRange(options_.config, u.unit);
  void* dst = UseData(use);
  const cudaEvent_t after = u.previous >= 0 ? released_[u.previous] : compute_idle_;
  if (gathers()) {
    Collectives* collectives = options_.collectives;
    const int W = collectives->world_size();
    const int rank = collectives->rank();
    const int64_t P = options_.padded_length / W;
    // NCCL's stream is not ordered after ours: the slot's previous use must be done first.
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(after));
    const std::vector<int64_t> counts = RankCounts(r.begin, r.end, P, W);
    const uint16_t* mine =
        counts[rank] > 0 ? partition_ + (std::max(r.begin, rank * P) - rank * P) : nullptr;
    OFFLOAD_RETURN_IF_ERROR(collectives->AllGatherV16(mine, static_cast<uint16_t*>(dst), counts));
    // The gather is complete on return; the event keeps Acquire the same for both sources.
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(filled_[use], compute_));
  } else {
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(h2d_->stream(), after, 0));
    const uint16_t* src = host_ + r.begin;
    const int64_t bytes = r.size() * int64_t{sizeof(uint16_t)};
    OFFLOAD_RETURN_IF_ERROR(
        h2d_->Copy(dst, src, bytes, filled_[use], registered_ && registered_(src, bytes)));
  }
  fill_queued_[use] = true;
  ++fills_;
  return absl::OkStatus();
}

absl::StatusOr<void*> DeviceParamWindow::Acquire(int use) {
  const WindowUse& u = plan_.uses[use];
  if (u.fill) {
    if (!fill_queued_[use]) {
      return absl::InternalError(absl::StrCat("the parameter window: use ", use, " (unit ", u.unit,
                                              ") was never filled; BeginStep first"));
    }
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_, filled_[use], 0));
  }
  return UseData(use);
}

absl::Status DeviceParamWindow::Release(int use) {
  OFFLOAD_CUDA_RETURN_IF_ERROR(cudaEventRecord(released_[use], compute_));
  const int next = plan_.fill_after_release[use];
  if (next >= 0) OFFLOAD_RETURN_IF_ERROR(Fill(next));
  return absl::OkStatus();
}

}  // namespace offload
