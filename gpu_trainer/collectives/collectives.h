// Collectives between the W trainer ranks of one job (ARCHITECTURE.md section 1): the
// reduce-scatter of gradients into each rank's partition, the all-gather of updated weights,
// all-reduces of a few values (overflow flag, gradient norm, loss), broadcast and barrier. Gloo
// over TCP serves the CPU backend (gloo_collectives.h).
//
// Every call is collective: all ranks make the same calls in the same order with the same sizes.
// A rank that dies or stops answering makes the others' calls fail with UNAVAILABLE or
// DEADLINE_EXCEEDED naming the operation, within the timeout given at connect time; no call
// hangs and none throws. After a failed call the object is unusable (every later call fails).
#ifndef OFFLOAD_GPU_TRAINER_COLLECTIVES_COLLECTIVES_H_
#define OFFLOAD_GPU_TRAINER_COLLECTIVES_COLLECTIVES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace offload {

enum class ReduceOp { kSum, kMax };

class Collectives {
 public:
  virtual ~Collectives() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // One line for the log, e.g. "gloo tcp 127.0.0.1, 2 ranks".
  virtual std::string Describe() const = 0;

  // data (sum(counts),): W consecutive segments, segment r of counts[r] elements (counts has W
  // entries, any may be 0). out (counts[rank()],) := the element-wise sum over all ranks of
  // segment rank(). out may alias data + offset of segment rank(). data is not modified
  // otherwise. The sum is in fp32 in an order fixed by (W, counts), so every run of the same
  // world size gets the same bits.
  virtual absl::Status ReduceScatter(const float* data, float* out,
                                     const std::vector<int64_t>& counts) = 0;
  // in (n,) 16-bit elements from every rank; out (world_size * n,) rank-major. in may alias
  // out + rank() * n.
  virtual absl::Status AllGather16(const uint16_t* in, uint16_t* out, int64_t n) = 0;
  // The all-gather of uneven pieces: ZeRO stage 3 gathers one layer's range of the flat 16-bit
  // parameter buffer, whose elements are owned by consecutive ranks in uneven amounts (some
  // none). counts has W entries >= 0, the same on every rank. in (counts[rank()],) from every
  // rank; out (sum(counts),) := rank-major concatenation, segment r (counts[r],) from rank r. in
  // may alias exactly out + sum(counts[0 .. rank())) (in place) and overlaps out nowhere else.
  // A zero sum communicates nothing.
  virtual absl::Status AllGatherV16(const uint16_t* in, uint16_t* out,
                                    const std::vector<int64_t>& counts) = 0;
  // values (n,) := the element-wise op over all ranks, in place.
  virtual absl::Status AllReduce(double* values, int n, ReduceOp op) = 0;
  // data (bytes,) of `root` copied to every other rank.
  absl::Status Broadcast(void* data, int64_t bytes, int root) {
    return BroadcastWithin(data, bytes, root, absl::ZeroDuration());
  }
  // As Broadcast, waiting up to `timeout` (zero: the connect-time timeout) for the root: for a
  // root that first does slow work of its own, such as rank 0 loading or writing the shards'
  // state while the other ranks wait.
  virtual absl::Status BroadcastWithin(void* data, int64_t bytes, int root,
                                       absl::Duration timeout) = 0;
  virtual absl::Status Barrier() = 0;

  // A new communicator over the same ranks (same rank numbers) whose operations never meet this
  // one's: the trainer gathers parameters on a prefetch thread while another thread
  // reduce-scatters gradients, and two threads sharing one communicator could pair different
  // operations across ranks (each rank orders its calls by whichever thread comes first).
  // Collective like the rest: every rank calls it with the same name, at most once per name on
  // this object (a repeat is refused with ALREADY_EXISTS); the names of a fork's own forks are
  // apart from this object's. name is non-empty and has no '/' (INVALID_ARGUMENT otherwise).
  // The fork lives on its own: it may outlive this object, and its failures do not break this
  // one. A failed fork breaks this object as any failed call does.
  virtual absl::StatusOr<std::unique_ptr<Collectives>> Fork(absl::string_view name) = 0;
};

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_COLLECTIVES_COLLECTIVES_H_
