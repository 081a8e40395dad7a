// An Attach stream's set-up is bounded on both ends: a shard ends a stream whose caller never
// sends its AttachOpen or never proves a shm offer, and a trainer gives up on a shard that never
// answers its AttachOpen. Each within the configured set-up timeout, never a hang.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "cpu_optimizer_server/grpc/attach_client.h"
#include "cpu_optimizer_server/grpc/optimizer_service.h"
#include "cpu_optimizer_server/grpc/service_test_util.h"
#include "cpu_optimizer_server/grpc/shard_client.h"

namespace offload {
namespace {

constexpr absl::Duration kSetup = absl::Milliseconds(500);

class ShardSideTest : public ::testing::Test {
 protected:
  ShardSideTest() : pool_(ThreadPool::Options{1, false}) {
    ShardOptions options;
    options.memory_limit_bytes = int64_t{64} << 20;
    options.wave_elements = 2 * kTileElements;
    store_ = std::make_unique<ShardStore>(options, &pool_, BestSimdPath());
    ServerOptions server_options;
    server_options.listen_address = "127.0.0.1:0";
    server_options.max_message_bytes = int64_t{8} << 20;
    server_options.enable_ucx = false;
    server_options.attach_setup_timeout = kSetup;
    auto server = OptimizerServer::Start(server_options, store_.get());
    EXPECT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ = v1::OptimizerShard::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials()));
  }

  // Reads until the shard ends the stream: it must be the shard's own timeout that ended it,
  // well before the client's 30 s deadline.
  static void ExpectTheShardEndsIt(
      grpc::ClientReaderWriter<v1::AttachRequest, v1::AttachResponse>* stream, absl::Time start) {
    v1::AttachResponse ignored;
    EXPECT_FALSE(stream->Read(&ignored));
    const grpc::Status status = stream->Finish();
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    EXPECT_NE(status.error_code(), grpc::StatusCode::OK);
    EXPECT_NE(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << "the client's deadline";
  }

  ThreadPool pool_;
  std::unique_ptr<ShardStore> store_;
  std::unique_ptr<OptimizerServer> server_;
  std::unique_ptr<v1::OptimizerShard::Stub> stub_;
};

TEST_F(ShardSideTest, EndsAnAttachStreamThatNeverOpens) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  const absl::Time start = absl::Now();
  auto stream = stub_->Attach(&context);  // and then nothing
  ExpectTheShardEndsIt(stream.get(), start);
}

TEST_F(ShardSideTest, EndsAShmAttachThatNeverProvesTheOffer) {
  v1::CreateJobRequest create;
  create.set_job_id("job.1");
  v1::ParamRange* range = create.add_ranges();
  range->set_length(1024);
  *create.mutable_adam() = TestAdamW();
  create.set_param_dtype(v1::DTYPE_BF16);
  {
    grpc::ClientContext context;
    v1::CreateJobResponse response;
    ASSERT_TRUE(stub_->CreateJob(&context, create, &response).ok());
  }
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  const absl::Time start = absl::Now();
  auto stream = stub_->Attach(&context);
  v1::AttachRequest open;
  open.mutable_open()->set_job_id("job.1");
  open.mutable_open()->set_plane(v1::DATA_PLANE_SHM);
  ASSERT_TRUE(stream->Write(open));
  v1::AttachResponse offer;
  ASSERT_TRUE(stream->Read(&offer));
  EXPECT_TRUE(offer.has_shm());
  ExpectTheShardEndsIt(stream.get(), start);  // no proof follows
  // The reservation the offer took is back once the handler has returned (the client can see the
  // stream end a moment before that).
  const int64_t state_bytes = (*store_->Jobs().begin())->state_bytes();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (store_->budget()->used() != state_bytes && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(store_->budget()->used(), state_bytes);
}

// A shard that takes the Attach stream and never answers.
class SilentShard final : public v1::OptimizerShard::Service {
 public:
  grpc::Status Attach(grpc::ServerContext* context, AttachStream* stream) override {
    v1::AttachRequest request;
    while (stream->Read(&request)) {
    }
    return grpc::Status::OK;
  }
};

TEST(TrainerSideTest, GivesUpOnAShardThatNeverAnswers) {
  SilentShard service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ClientOptions options;
  options.address = "127.0.0.1:" + std::to_string(port);
  options.attach_setup_timeout = kSetup;
  auto control = ShardClient::Connect(options);
  ASSERT_TRUE(control.ok()) << control.status();
  const absl::Time start = absl::Now();
  {
    AttachClient link(control->get(), "the test's Attach stream");
    v1::AttachRequest open;
    open.mutable_open()->set_plane(v1::DATA_PLANE_SHM);
    ASSERT_TRUE(link.Send(open, "the offer").ok());
    absl::StatusOr<v1::AttachResponse> offer = link.Receive("the offer");
    EXPECT_EQ(offer.status().code(), absl::StatusCode::kDeadlineExceeded) << offer.status();
    EXPECT_NE(offer.status().message().find("did not answer"), std::string::npos) << offer.status();
  }
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, kSetup);
  EXPECT_LT(took, absl::Seconds(10));
  server->Shutdown(std::chrono::system_clock::now());
}

}  // namespace
}  // namespace offload
