// Optimizer shards served over gRPC on loopback in the test's own process (every data plane
// offered), for tests of the trainer's optimizer backends and of the trainer itself.
#ifndef OFFLOAD_OPTIMIZER_CLIENT_BACKENDS_LOCAL_SHARDS_TEST_UTIL_H_
#define OFFLOAD_OPTIMIZER_CLIENT_BACKENDS_LOCAL_SHARDS_TEST_UTIL_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/thread_pool.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"
#include "cpu_optimizer_server/grpc/optimizer_service.h"
#include "cpu_optimizer_server/shard/shard_store.h"
#include "gtest/gtest.h"

namespace offload {

class LocalShards {
 public:
  explicit LocalShards(int n) : pool_(ThreadPool::Options{2, false}) {
    for (int i = 0; i < n; ++i) {
      stores_.push_back(std::make_unique<ShardStore>(ShardOptions{}, &pool_, BestSimdPath()));
      ServerOptions options;
      options.listen_address = "127.0.0.1:0";
      auto server = OptimizerServer::Start(options, stores_.back().get());
      EXPECT_TRUE(server.ok()) << server.status();
      addresses_.push_back(absl::StrCat("127.0.0.1:", (*server)->port()));
      servers_.push_back(std::move(*server));
    }
  }
  const std::vector<std::string>& addresses() const { return addresses_; }

 private:
  ThreadPool pool_;
  std::vector<std::unique_ptr<ShardStore>> stores_;
  std::vector<std::unique_ptr<OptimizerServer>> servers_;
  std::vector<std::string> addresses_;
};

}  // namespace offload

#endif  // OFFLOAD_OPTIMIZER_CLIENT_BACKENDS_LOCAL_SHARDS_TEST_UTIL_H_
