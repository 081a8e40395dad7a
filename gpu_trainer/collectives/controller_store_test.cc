// ControllerStore against an in-process fake of the controller's rendezvous (a map per attempt
// behind WorkerService.RendezvousSet/Get): two ranks meet through it and all-reduce, a missing
// key or an absent peer ends in a timeout error rather than a hang, attempts keep their keys
// apart, the bearer token travels with every call, and an unreachable controller fails the call.
#include "gpu_trainer/collectives/controller_store.h"

#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gloo/common/error.h"
#include "gpu_trainer/collectives/gloo_collectives.h"
#include "grpcpp/grpcpp.h"
#include "offload/v1/worker.grpc.pb.h"

namespace offload {
namespace {

constexpr char kToken[] = "s3cret";

// The controller's rendezvous as the contract describes it: set stores, get waits up to
// timeout_ms for every key and answers DEADLINE_EXCEEDED if one is still missing.
class FakeRendezvous final : public v1::WorkerService::Service {
 public:
  grpc::Status RendezvousSet(grpc::ServerContext* context, const v1::RendezvousSetRequest* request,
                             v1::RendezvousSetResponse* response) override {
    absl::MutexLock lock(&mu_);
    Note(*context);
    values_[{request->attempt().job_id(), request->attempt().attempt(), request->key()}] =
        request->value();
    return grpc::Status::OK;
  }

  grpc::Status RendezvousGet(grpc::ServerContext* context, const v1::RendezvousGetRequest* request,
                             v1::RendezvousGetResponse* response) override {
    absl::MutexLock lock(&mu_);
    Note(*context);
    auto all_set = [&] {
      for (const std::string& key : request->keys()) {
        if (values_.count({request->attempt().job_id(), request->attempt().attempt(), key}) == 0) {
          return false;
        }
      }
      return true;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&all_set),
                              absl::Milliseconds(request->timeout_ms()))) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "rendezvous key(s) still missing");
    }
    for (const std::string& key : request->keys()) {
      response->add_values(
          values_[{request->attempt().job_id(), request->attempt().attempt(), key}]);
    }
    return grpc::Status::OK;
  }

  // Calls seen, and how many carried "authorization: Bearer <kToken>".
  std::pair<int, int> calls() {
    absl::MutexLock lock(&mu_);
    return {calls_, authorized_};
  }

 private:
  void Note(const grpc::ServerContext& context) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ++calls_;
    auto it = context.client_metadata().find("authorization");
    if (it != context.client_metadata().end() &&
        std::string(it->second.data(), it->second.size()) == absl::StrCat("Bearer ", kToken)) {
      ++authorized_;
    }
  }

  absl::Mutex mu_;
  std::map<std::tuple<std::string, uint32_t, std::string>, std::string> values_
      ABSL_GUARDED_BY(mu_);
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
  int authorized_ ABSL_GUARDED_BY(mu_) = 0;
};

class ControllerStoreTest : public ::testing::Test {
 protected:
  ControllerStoreTest() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~ControllerStoreTest() override {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }

  std::shared_ptr<grpc::Channel> Channel() {
    return grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_),
                               grpc::InsecureChannelCredentials());
  }

  static v1::AttemptRef Attempt(uint32_t attempt) {
    v1::AttemptRef ref;
    ref.set_job_id("job-7");
    ref.set_attempt(attempt);
    return ref;
  }

  FakeRendezvous service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

GlooOptions Options(int rank, int world_size, absl::Duration timeout) {
  GlooOptions options;
  options.rank = rank;
  options.world_size = world_size;
  options.prefix = "job-7.0";
  options.hostname = "127.0.0.1";
  options.timeout = timeout;
  return options;
}

TEST_F(ControllerStoreTest, TwoRanksMeetThroughTheControllerAndAllReduce) {
  ASSERT_NE(server_, nullptr);
  constexpr int kWorld = 2;
  std::vector<absl::Status> status(kWorld);
  std::vector<std::vector<double>> values(kWorld);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r) {
    ranks.emplace_back([&, r] {
      auto store = std::make_shared<ControllerStore>(Channel(), kToken, Attempt(0),
                                                     std::chrono::seconds(20));
      absl::StatusOr<std::unique_ptr<Collectives>> collectives =
          ConnectGloo(Options(r, kWorld, absl::Seconds(20)), store);
      if (!collectives.ok()) {
        status[r] = collectives.status();
        return;
      }
      values[r] = {1.0 + r, 10.0 * r, -0.5};
      status[r] = (*collectives)->AllReduce(values[r].data(), 3, ReduceOp::kSum);
    });
  }
  for (std::thread& t : ranks) t.join();
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    EXPECT_EQ(values[r], (std::vector<double>{3.0, 10.0, -1.0})) << "rank " << r;
  }
  auto [calls, authorized] = service_.calls();
  EXPECT_GT(calls, 0);
  EXPECT_EQ(authorized, calls);
}

TEST_F(ControllerStoreTest, GetOfAMissingKeyTimesOutWithAnError) {
  ASSERT_NE(server_, nullptr);
  ControllerStore store(Channel(), kToken, Attempt(0), std::chrono::milliseconds(300));
  const absl::Time start = absl::Now();
  try {
    store.get("nobody/sets/this");
    ADD_FAILURE() << "get of a missing key returned";
  } catch (const gloo::IoException& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("timed out"), std::string::npos) << what;
    EXPECT_NE(what.find("nobody/sets/this"), std::string::npos) << what;
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));

  EXPECT_THROW(store.wait({"nobody/sets/this"}, std::chrono::milliseconds(100)), gloo::IoException);
  EXPECT_THROW(store.wait({"nobody/sets/this"}), gloo::IoException);
}

TEST_F(ControllerStoreTest, ARankWhosePeerNeverComesGetsDeadlineExceeded) {
  ASSERT_NE(server_, nullptr);
  auto store =
      std::make_shared<ControllerStore>(Channel(), kToken, Attempt(0), std::chrono::seconds(1));
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<Collectives>> collectives =
      ConnectGloo(Options(0, 2, absl::Seconds(1)), store);
  EXPECT_EQ(collectives.status().code(), absl::StatusCode::kDeadlineExceeded)
      << collectives.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST_F(ControllerStoreTest, KeysBelongToOneAttempt) {
  ASSERT_NE(server_, nullptr);
  ControllerStore first(Channel(), kToken, Attempt(0), std::chrono::milliseconds(200));
  ControllerStore second(Channel(), kToken, Attempt(1), std::chrono::milliseconds(200));
  const std::vector<char> value = {'a', '\0', 'b', '\xff'};
  first.set("rank/0", value);
  EXPECT_EQ(first.get("rank/0"), value);
  first.wait({"rank/0"});
  EXPECT_THROW(second.get("rank/0"), gloo::IoException);
}

TEST_F(ControllerStoreTest, AnUnreachableControllerFailsTheCall) {
  ASSERT_NE(server_, nullptr);
  std::shared_ptr<grpc::Channel> channel = Channel();
  server_->Shutdown(std::chrono::system_clock::now());
  ControllerStore store(channel, kToken, Attempt(0), std::chrono::milliseconds(300));
  const absl::Time start = absl::Now();
  EXPECT_THROW(store.set("rank/0", {'x'}), gloo::IoException);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

}  // namespace
}  // namespace offload
