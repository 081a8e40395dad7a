// For tests: W ranks as threads of this process, each with its own Gloo collectives, joined
// through one in-memory store.
#ifndef OFFLOAD_GPU_TRAINER_COLLECTIVES_GLOO_TEST_UTIL_H_
#define OFFLOAD_GPU_TRAINER_COLLECTIVES_GLOO_TEST_UTIL_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "gloo/rendezvous/hash_store.h"
#include "gpu_trainer/collectives/gloo_collectives.h"
#include "gtest/gtest.h"

namespace offload {

// Runs body(rank, collectives) on W threads and joins them; a rank that cannot connect fails the
// test and runs nothing.
inline void RunOnGlooRanks(int W, absl::Duration timeout,
                           const std::function<void(int rank, Collectives& collectives)>& body,
                           const std::string& prefix = "test") {
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r) {
    threads.emplace_back([&, r] {
      GlooOptions g;
      g.rank = r;
      g.world_size = W;
      g.prefix = prefix;
      g.timeout = timeout;
      absl::StatusOr<std::unique_ptr<Collectives>> collectives = ConnectGloo(g, store);
      ASSERT_TRUE(collectives.ok()) << collectives.status();
      body(r, **collectives);
    });
  }
  for (std::thread& t : threads) t.join();
}

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_COLLECTIVES_GLOO_TEST_UTIL_H_
