// The optimizer behind servers: one ShardClient per shard (the control plane), a data plane
// per shard (gRPC, shared memory or UCX: transport_factory.h), one step stream per slice.
#ifndef OFFLOAD_OPTIMIZER_CLIENT_BACKENDS_REMOTE_OPTIMIZER_H_
#define OFFLOAD_OPTIMIZER_CLIENT_BACKENDS_REMOTE_OPTIMIZER_H_

#include <memory>
#include <string>
#include <vector>

#include "cpu_optimizer_server/grpc/shard_client.h"
#include "cpu_optimizer_server/transport_factory/transport_factory.h"
#include "optimizer_client/backends/optimizer_backend.h"

namespace offload {

class RemoteOptimizer final : public OptimizerBackend {
 public:
  // One address per shard of the map, in shard order; the data plane of each as `transport`
  // chooses.
  static absl::StatusOr<std::unique_ptr<RemoteOptimizer>> Connect(
      v1::PartitionMap map, const std::vector<std::string>& addresses, const ClientOptions& options,
      TransportChoice transport = TransportChoice::kGrpc);
  ~RemoteOptimizer() override;

  // Where CreateJob asks every shard to keep the job's state (CreateJobRequest.state_tier).
  void SetStateTier(v1::StateTier tier) { state_tier_ = tier; }

  // "shm" or "shm, grpc": the data plane of each shard, in shard order, duplicates folded.
  std::string TransportNames() const;

  absl::Status CreateJob(const std::string& job_id, const v1::AdamConfig& adam, DType param_dtype,
                         const std::vector<v1::ParamGroup>& groups = {}) override;
  absl::StatusOr<std::unique_ptr<ShardStateLoad>> BeginShardLoad(
      int shard, const StepCounters* steps) override;
  absl::Status ReadSliceState(int slice, v1::StateTensor tensor, int64_t offset, int64_t n,
                              float* out) override;
  absl::Status DropJob() override;

 private:
  explicit RemoteOptimizer(v1::PartitionMap map) : OptimizerBackend(std::move(map)) {}
  absl::Status OpenSlice(int slice, uint64_t step) override;
  absl::Status SendSlice(int slice, int64_t offset, const uint16_t* grads, int64_t n,
                         bool accumulate) override;
  absl::Status SendSlice32(int slice, int64_t offset, const float* grads, int64_t n) override;
  absl::StatusOr<StepCounters> CommitSlices(double lr, float grad_multiplier, bool skip,
                                            uint16_t* partition16,
                                            absl::Span<const double> group_lr,
                                            absl::Span<const RangeStep> range_steps) override;
  void AbortSlices() override;
  absl::Status UpdateSlice(int slice, int64_t offset, int64_t n, uint64_t t, double lr,
                           float grad_multiplier, absl::Span<const double> group_lr) override;
  uint16_t* SliceGradientArea(int slice) override;
  uint64_t SliceGradientAreaId(int slice) override;

  std::vector<std::string> addresses_;
  v1::StateTier state_tier_ = v1::STATE_TIER_AUTO;
  std::vector<std::unique_ptr<ShardClient>> clients_;             // one per shard
  std::vector<std::unique_ptr<StepTransport>> owned_transports_;  // shm or UCX, per shard
  std::vector<StepTransport*> transports_;                        // one per shard
  std::vector<std::unique_ptr<StepStream>> streams_;  // per slice, this rank's during a step
  // Per slice: its plane has no update during backward (UNIMPLEMENTED once), so this step asks
  // no more.
  std::vector<bool> no_early_;
};

}  // namespace offload

#endif  // OFFLOAD_OPTIMIZER_CLIENT_BACKENDS_REMOTE_OPTIMIZER_H_
