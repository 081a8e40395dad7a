// The step exchange behind one interface (ARCHITECTURE.md section 4): gradient chunks in, a commit,
// updated 16-bit parameter chunks out, for one range of one shard. Three data planes implement
// it: gRPC (shard_client.h, anywhere, the default), shared memory (shm_transport.h, a trainer
// and a shard on one host) and UCX (ucx_transport.h, RDMA-capable, across hosts). Session set-up,
// validation errors and the death of a peer travel on gRPC whatever the data plane.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_TRANSPORT_STEP_TRANSPORT_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_TRANSPORT_STEP_TRANSPORT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "cpu_optimizer_server/shard/range_steps.h"
#include "offload/v1/optimizer.pb.h"

namespace offload {

// One step of one range: open (done by StepTransport::OpenStep), gradient chunks, commit. The
// shard validates everything as the gRPC service does; a stream that ends without a commit
// leaves the shard unchanged.
class StepStream {
 public:
  virtual ~StepStream() = default;  // abandons the step unless it was committed
  // Sends n gradients of flat elements [offset, offset + n), which must lie in the range.
  virtual absl::Status SendGradients(int64_t offset, const void* data, DType dtype, int64_t n,
                                     bool accumulate = false) = 0;
  // Commits and receives the updated 16-bit parameters of the whole range into params_out
  // (range length,), whose first element is the range's first element. group_lr: empty for `lr`
  // in every parameter group of the job, else one lr per group (StepCommit.group_lr; at most
  // kMaxParamGroups). range_steps: per-element skips and bias-correction steps, flat offsets
  // inside the range, sorted, not overlapping (StepCommit.range_steps); empty for none.
  // Overrides repeat the defaults, so a call reads the same through any type.
  virtual absl::StatusOr<v1::StepResult> Commit(double lr, float grad_multiplier, bool skip,
                                                void* params_out,
                                                absl::Span<const double> group_lr = {},
                                                absl::Span<const RangeStep> range_steps = {}) = 0;
  // Ends the step without committing (the shard drops the gradients).
  virtual void Abandon() = 0;

  // The update during backward (StepSession::UpdateEarly; ARCHITECTURE.md section 4.3): Adam now
  // on flat elements [offset, offset + n) of the range, all of whose gradients were sent, with
  // the arguments the commit is expected to carry: lr / group_lr / grad_multiplier as Commit's,
  // and t the bias-correction step of those elements (0: the range's next). The commit keeps it
  // where it agrees and redoes it exactly otherwise, so the bits never depend on it. Every plane
  // carries it asynchronously, queued behind the gradients (the shared-memory UPDATE command,
  // the gRPC StepUpdate message, the UCX UPDATE message), so the shard's Adam runs while the
  // next chunks are still on the wire; its error surfaces at the next call or the commit, and
  // the shard may decline it silently. UNIMPLEMENTED where a plane lacks it: the commit then
  // updates those elements as always.
  virtual absl::Status UpdateEarly(int64_t /*offset*/, int64_t /*n*/, uint64_t /*t*/, double /*lr*/,
                                   float /*grad_multiplier*/,
                                   absl::Span<const double> /*group_lr*/) {
    return absl::UnimplementedError("this data plane has no update during backward");
  }

  // Zero-copy sending, where the plane has it (null elsewhere): the range's gradient area,
  // (range length,) 16-bit values in the job's dtype, in memory the plane sends from as it is:
  // shared memory's segment, which the shard reads in place, or gRPC's send buffers (UCX has none:
  // it sends from the caller's memory without a copy anyway). A caller that writes a chunk's
  // gradients at their range-relative position there sends them with SendGradients(offset, that
  // position, ...) and the plane copies no byte. What is there when SendGradients is called is
  // what the shard takes, and it must not change until the commit returns or the step ends.
  // Valid until then; accumulate chunks still travel by copy.
  virtual void* GradientArea() { return nullptr; }
  // Which memory GradientArea() points into: another value means other memory, even at the same
  // address (a segment mapped again after its shard came back), so that a caller that page-locked
  // the old one (cudaHostRegister) knows to lock the new one. 0 where there is no area.
  virtual uint64_t GradientAreaId() { return 0; }

  // Receives wave k of a zero-copy commit: n 16-bit parameters of range-relative elements
  // [begin, begin + n), at `params` in the plane's memory, valid until the next OpenStep of the
  // range. Waves arrive in order, each begins where the last ended, and together they cover the
  // range unless the step was skipped.
  using ParamWaveFn = std::function<void(int64_t begin, int64_t n, const void* params)>;
  // As Commit, but the updated parameters are handed over where they land instead of copied
  // (shared memory), so the caller reads them straight into their use (a host-to-device copy,
  // a conversion) while the shard computes the next wave. Shared memory only; UNIMPLEMENTED
  // elsewhere.
  virtual absl::StatusOr<v1::StepResult> CommitInPlace(
      double /*lr*/, float /*grad_multiplier*/, bool /*skip*/, const ParamWaveFn& /*on_wave*/,
      absl::Span<const double> /*group_lr*/ = {},
      absl::Span<const RangeStep> /*range_steps*/ = {}) {
    return absl::UnimplementedError("this data plane has no zero-copy commit");
  }
};

// The data plane to one shard.
class StepTransport {
 public:
  virtual ~StepTransport() = default;
  virtual absl::string_view name() const = 0;  // "grpc", "shm" or "ucx"
  // Opens the step of range `range_index` (flat [range_offset, + range_length)).
  virtual absl::StatusOr<std::unique_ptr<StepStream>> OpenStep(const std::string& job_id,
                                                               uint32_t range_index,
                                                               int64_t range_offset,
                                                               int64_t range_length,
                                                               uint64_t step) = 0;
};

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_TRANSPORT_STEP_TRANSPORT_H_
