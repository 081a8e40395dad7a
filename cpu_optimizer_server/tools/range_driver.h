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
#include "cpu_optimizer_server/grpc/optimizer_client.h"
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
absl::Status StepAllRanges(OptimizerClient* client, const std::string& job_id,
                           const std::vector<RangeSpec>& ranges, uint64_t step,
                           const uint16_t* grads, DType dtype, double lr, float grad_multiplier,
                           uint16_t* params);

// One zero-copy exchange on an open `stream` (step_transport.h) of the range [offset, + n): when
// `send`, grads (n,) in dtype are written into the plane's gradient area and sent from there;
// then a zero-copy commit, whose waves must cover the range unless the step was skipped. The
// write stands for the trainer's own rounding, which every plane does once, so the benches leave
// it out of what they time: its seconds go to *produce_s. UNIMPLEMENTED where the plane has no
// gradient area.
absl::StatusOr<v1::StepResult> ExchangeInPlace(StepStream& stream, int64_t offset,
                                               const uint16_t* grads, DType dtype, int64_t n,
                                               bool send, double lr, bool skip, double* produce_s);

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_TOOLS_RANGE_DRIVER_H_
