// The optimizer without a server: one ShardStore per shard of the partition map, driven through
// the same StepSession / StateLoader code the gRPC service runs, so an in-process run and a run
// against local servers compute bit-identical weights.
#ifndef OFFLOAD_OPTIMIZER_CLIENT_BACKENDS_INPROCESS_OPTIMIZER_H_
#define OFFLOAD_OPTIMIZER_CLIENT_BACKENDS_INPROCESS_OPTIMIZER_H_

#include <memory>
#include <vector>

#include "base/thread_pool.h"
#include "cpu_optimizer_server/shard/shard_store.h"
#include "cpu_optimizer_server/shard/step_session.h"
#include "optimizer_client/backends/optimizer_backend.h"

namespace offload {

class InProcessOptimizer final : public OptimizerBackend {
 public:
  // `threads` workers for the Adam pass (0: one per core this process may use), each pinned to
  // one of those cores if pin_threads (its first touch keeps the state on that core's node).
  InProcessOptimizer(v1::PartitionMap map, int threads, SimdPath path, bool pin_threads = false);
  ~InProcessOptimizer() override;

  absl::Status CreateJob(const std::string& job_id, const v1::AdamConfig& adam, DType param_dtype,
                         const std::vector<v1::ParamGroup>& groups = {}) override;
  absl::StatusOr<std::unique_ptr<ShardStateLoad>> BeginShardLoad(
      int shard, const StepCounters* steps) override;
  absl::Status ReadSliceState(int slice, v1::StateTensor tensor, int64_t offset, int64_t n,
                              float* out) override;
  absl::Status DropJob() override;

 private:
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

  ThreadPool pool_;
  std::vector<std::unique_ptr<ShardStore>> stores_;     // one per shard
  std::vector<std::unique_ptr<StepSession>> sessions_;  // per slice, this rank's during a step
  uint64_t step_ = 0;
};

}  // namespace offload

#endif  // OFFLOAD_OPTIMIZER_CLIENT_BACKENDS_INPROCESS_OPTIMIZER_H_
