// Which GPU each CUDA trainer rank of one host computes on (ARCHITECTURE.md section 9): local
// rank i takes GPU i unless the user chose one for every rank (--cuda_device). Over NCCL each rank
// needs a GPU of its own, so a host with fewer GPUs than ranks is refused before anything starts;
// over gloo the ranks stage their gradients on the host and may share GPUs (rank i -> GPU i % G).
// offload_local applies it to the ranks it starts, a trainer pool worker to the rank it runs.
#ifndef OFFLOAD_SERVICES_SPAWN_RANK_DEVICES_H_
#define OFFLOAD_SERVICES_SPAWN_RANK_DEVICES_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace offload {

// What a rank's gpu_trainer flags say about its device, read as absl reads them: "--f=v" or
// "--f v", the last one given wins.
struct RankDeviceSettings {
  bool cuda = false;               // --device=cuda
  bool nccl = false;               // --collectives=nccl
  bool cuda_device_given = false;  // --cuda_device: the user's choice, kept for every rank
};
RankDeviceSettings ReadRankDeviceSettings(const std::vector<std::string>& trainer_args);

// The flag to add to local rank `local_rank` of the `local_ranks` CUDA ranks on a host with
// `gpus` GPUs ("--cuda_device=K"), or "" when none is to be added (not CUDA, or --cuda_device
// given). FAILED_PRECONDITION, before any rank starts, for more NCCL ranks than GPUs, naming both
// numbers and what to do instead. With no GPU visible over gloo every rank gets GPU 0 and says
// itself that there is none.
absl::StatusOr<std::string> CudaDeviceFlag(const RankDeviceSettings& settings, int local_rank,
                                           int local_ranks, int gpus);

// CudaDeviceFlag for each of the num_ranks ranks of one host given trainer_args, the GPUs
// counted by VisibleGpuCount() (only with --device=cuda); the first refusal.
absl::StatusOr<std::vector<std::string>> CudaDeviceFlags(
    const std::vector<std::string>& trainer_args, int num_ranks);

// The GPUs this host's processes may use: the entries of CUDA_VISIBLE_DEVICES when it is set (up
// to the first that names no device, as CUDA reads it), else the NVIDIA driver's entries in
// /proc/driver/nvidia/gpus; 0 without a driver.
int VisibleGpuCount();
// The same from given values (tests): cuda_visible_devices null when unset.
int VisibleGpuCount(const char* cuda_visible_devices, const std::string& driver_gpus_dir);

}  // namespace offload

#endif  // OFFLOAD_SERVICES_SPAWN_RANK_DEVICES_H_
