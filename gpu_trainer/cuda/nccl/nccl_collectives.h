// Collectives over NCCL between the ranks of one job, one GPU each (ARCHITECTURE.md section 1;
// the gloo ones are gloo_collectives.h). ReduceScatter, AllGather16 and AllGatherV16 take
// pointers to this rank's GPU memory: the gradient buckets and the 16-bit weights stay on the
// device. AllReduce, BroadcastWithin and Barrier take host memory, staged through a device
// buffer: the step's few scalars, the ranks' settings and the starting weights.
//
// The ranks meet through the rendezvous they already have (a directory's FileStore, the
// controller's store): rank 0 puts NCCL's unique id under `<prefix>/nccl-id` and the others
// wait for it. The communicator is non-blocking, and every operation is waited for on the host
// with a deadline: an NCCL error fails the call UNAVAILABLE, a peer that never comes fails it
// DEADLINE_EXCEEDED within the timeout; either way the communicator is aborted (ncclCommAbort)
// and every later call fails FAILED_PRECONDITION, never a hang. NCCL refuses two ranks on one
// GPU: two CUDA ranks sharing one GPU meet over gloo instead.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_NCCL_NCCL_COLLECTIVES_H_
#define OFFLOAD_GPU_TRAINER_CUDA_NCCL_NCCL_COLLECTIVES_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "gpu_trainer/collectives/collectives.h"

namespace gloo::rendezvous {
class Store;
}  // namespace gloo::rendezvous

namespace offload {

struct NcclOptions {
  int rank = 0;
  int world_size = 1;
  int cuda_device = 0;  // this rank's GPU, made current on the calling thread
  // Key prefix in the store: the job id and attempt, so one store serves several.
  std::string prefix = "nccl";
  // Bounds the wait for the unique id, the communicator's set-up, and each operation.
  absl::Duration timeout = absl::Seconds(60);
};

// UNAVAILABLE without a GPU (the CUDA runtime's reason) or when NCCL fails to set up;
// DEADLINE_EXCEEDED when the other ranks do not come within the timeout.
absl::StatusOr<std::unique_ptr<Collectives>> ConnectNccl(
    const NcclOptions& options, std::shared_ptr<gloo::rendezvous::Store> store);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_NCCL_NCCL_COLLECTIVES_H_
