// Driving a whole job on one shard from a client: the job's flat parameters cut into balanced
// ranges (one per rank), and one step over all of them with a stream per range running in
// parallel, as the ranks of a trainer would. Used by the synthetic trainer and bench_server.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_TOOLS_RANGE_DRIVER_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_TOOLS_RANGE_DRIVER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"
#include "cpu_optimizer_server/grpc/shard_client.h"
#include "cpu_optimizer_server/shard/shard_store.h"
#include "cpu_optimizer_server/transport/step_transport.h"

namespace offload {

// [0, n) cut into k contiguous ranges whose lengths differ by at most one element.
std::vector<RangeSpec> BalancedRanges(int64_t n, int k);

v1::CreateJobRequest MakeCreateJobRequest(const std::string& job_id,
                                          const std::vector<RangeSpec>& ranges,
                                          const AdamHyperParams& adam, DType param_dtype);

// Step `step` of every range at once: sends grads (n,) in `dtype`, commits with lr and
// grad_multiplier, receives the updated 16-bit parameters into params (n,). Both arrays are
// indexed by flat element. Returns the first range's error, if any.
absl::Status StepAllRanges(ShardClient* client, const std::string& job_id,
                           const std::vector<RangeSpec>& ranges, uint64_t step,
                           const uint16_t* grads, DType dtype, double lr, float grad_multiplier,
                           uint16_t* params);

// What one range's exchange on a step stream does (ExchangeRange).
enum class ExchangeMode {
  kIn,     // gradients in, then a skipping commit: no Adam, no parameters back
  kOut,    // no gradients; a replay of the range's last step: the parameters back, no Adam
  kStep,   // gradients in, commit, parameters back
  kEarly,  // as kStep, with an update during backward (UpdateEarly) behind each chunk, so the
           // shard's Adam on one chunk runs while the next is on the wire
};

struct ExchangeOptions {
  ExchangeMode mode = ExchangeMode::kStep;
  // Gradients travel in SendGradients calls of this many elements (the plane cuts them further
  // into its own chunks); 0: one call for the range.
  int64_t call_elements = 0;
  // Zero-copy sending (shared memory, gRPC): the gradients are written into the plane's gradient
  // area and sent from there. The write stands for the trainer's own rounding, which every plane
  // does once, so the benches leave it out of what they time: its seconds go to
  // ExchangeResult::produce_s.
  bool grad_area = false;
  // Shared memory's zero-copy commit: the parameters are taken where the shard wrote them
  // (CommitInPlace), not copied into `params`.
  bool params_in_place = false;
  double lr = 1e-4;
};

struct ExchangeResult {
  v1::StepResult result;
  double produce_s = 0;
};

// One exchange of the range [offset, + n) on an open `stream`: grads (n,) in dtype from the
// trainer's buffer, parameters into params (n,) (unused when params_in_place). Checks the shard's
// answer fits the mode (skipped, replayed or applied, and the whole range back).
absl::StatusOr<ExchangeResult> ExchangeRange(StepStream& stream, int64_t offset,
                                             const uint16_t* grads, DType dtype, int64_t n,
                                             uint16_t* params, const ExchangeOptions& options);

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_TOOLS_RANGE_DRIVER_H_
