// Collectives over Gloo's TCP transport for the CPU backend's data-parallel trainer ranks: the
// ranks meet through a rendezvous store (a shared directory in production, an in-memory store in
// tests), connect a full mesh of TCP pairs, then run the operations of collectives.h with a
// per-operation timeout. Gloo's exceptions never leave this file: every failure is a Status,
// and the first one leaves the object broken (see collectives.h).
#ifndef OFFLOAD_GPU_TRAINER_COLLECTIVES_GLOO_COLLECTIVES_H_
#define OFFLOAD_GPU_TRAINER_COLLECTIVES_GLOO_COLLECTIVES_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "gpu_trainer/collectives/collectives.h"

namespace gloo {
namespace rendezvous {
class Store;
}  // namespace rendezvous
}  // namespace gloo

namespace offload {

struct GlooOptions {
  int rank = 0;
  int world_size = 1;
  // A directory every rank can reach (Gloo's FileStore). Unused by the overload given a store.
  std::string rendezvous;
  // Key prefix, e.g. job id + attempt, so one store (directory) serves several jobs and attempts.
  // A FileStore refuses a key that already exists, so a retry needs a new prefix.
  std::string prefix;
  // Address this rank listens on for its peers.
  std::string hostname = "127.0.0.1";
  // Bounds the rendezvous and, separately, each collective operation. (Gloo's FileStore counts
  // its wait in whole seconds, so a rendezvous in a directory may overrun it by up to 1 s.)
  absl::Duration timeout = absl::Seconds(60);
};

// Meets the other world_size - 1 ranks in the directory options.rendezvous and connects to them.
// With world_size 1 nothing is connected: every operation is a local copy.
absl::StatusOr<std::unique_ptr<Collectives>> ConnectGloo(const GlooOptions& options);

// The same over a given store, e.g. a gloo::rendezvous::HashStore shared by ranks that are
// threads of one process (tests).
absl::StatusOr<std::unique_ptr<Collectives>> ConnectGloo(
    const GlooOptions& options, std::shared_ptr<gloo::rendezvous::Store> store);

// Values other than Gloo's own addresses that travel through the ranks' rendezvous store, such
// as NCCL's unique id: one rank puts a value under a key, the others wait for it (up to
// `timeout`, then DEADLINE_EXCEEDED naming the key) and read it. A FileStore refuses a key that
// exists, so keys carry the job's prefix and are put once.
absl::Status StorePut(gloo::rendezvous::Store& store, const std::string& key,
                      const std::string& value);
absl::StatusOr<std::string> StoreAwait(gloo::rendezvous::Store& store, const std::string& key,
                                       absl::Duration timeout);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_COLLECTIVES_GLOO_COLLECTIVES_H_
