// Who may call a shard (shard_access.h), through a real server on loopback: every OptimizerShard
// RPC without a credential, with a wrong one, with another attempt's, with an operator token and
// with the right one, on a pool server and on a standalone one; DescribeShard showing a caller
// only its own job; a revoked attempt locked out; and the trainer's client presenting its token.
#include "cpu_optimizer_server/grpc/shard_access.h"

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cpu_optimizer_server/grpc/optimizer_service.h"
#include "cpu_optimizer_server/grpc/service_test_util.h"
#include "cpu_optimizer_server/grpc/shard_client.h"

namespace offload {
namespace {

constexpr int64_t kLen = 4096;

v1::CreateJobRequest CreateRequest(const std::string& job_id) {
  v1::CreateJobRequest r;
  r.set_job_id(job_id);
  v1::ParamRange* range = r.add_ranges();
  range->set_offset(0);
  range->set_length(kLen);
  *r.mutable_adam() = TestAdamW();
  r.set_param_dtype(v1::DTYPE_BF16);
  return r;
}

// Each RPC of the service, called raw with `token` about `job_id`; the status code each ended
// with. The requests are well-formed, so a refusal is about the caller, not the request.
std::map<std::string, grpc::StatusCode> CallEveryRpc(v1::OptimizerShard::Stub* stub,
                                                     const std::string& token,
                                                     const std::string& job_id) {
  std::map<std::string, grpc::StatusCode> codes;
  auto context = [&token] {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    AttachBearer(c.get(), token);
    return c;
  };
  {
    auto c = context();
    v1::CreateJobResponse response;
    codes["CreateJob"] = stub->CreateJob(c.get(), CreateRequest(job_id), &response).error_code();
  }
  {
    auto c = context();
    v1::LoadStateResponse response;
    auto writer = stub->LoadState(c.get(), &response);
    v1::LoadStateRequest request;
    request.set_job_id(job_id);
    v1::StateChunk* chunk = request.add_chunks();
    chunk->set_tensor(v1::STATE_TENSOR_MASTER_WEIGHTS);
    chunk->set_dtype(v1::DTYPE_FP32);
    chunk->set_data(std::string(4 * kLen, '\0'));
    writer->Write(request);
    writer->WritesDone();
    codes["LoadState"] = writer->Finish().error_code();
  }
  {
    auto c = context();
    auto stream = stub->Step(c.get());
    v1::StepRequest open;
    open.mutable_open()->set_job_id(job_id);
    open.mutable_open()->set_step(1);
    stream->Write(open);
    stream->WritesDone();
    v1::StepResponse ignored;
    while (stream->Read(&ignored)) {
    }
    codes["Step"] = stream->Finish().error_code();
  }
  {
    auto c = context();
    v1::ReadStateRequest request;
    request.set_job_id(job_id);
    request.set_tensor(v1::STATE_TENSOR_MASTER_WEIGHTS);
    request.set_dtype(v1::DTYPE_FP32);
    request.mutable_range()->set_length(16);
    auto reader = stub->ReadState(c.get(), request);
    v1::StateChunk ignored;
    while (reader->Read(&ignored)) {
    }
    codes["ReadState"] = reader->Finish().error_code();
  }
  {
    auto c = context();
    v1::DescribeShardResponse response;
    codes["DescribeShard"] =
        stub->DescribeShard(c.get(), v1::DescribeShardRequest(), &response).error_code();
  }
  {
    auto c = context();
    auto stream = stub->Attach(c.get());
    v1::AttachRequest request;
    request.mutable_open()->set_job_id(job_id);
    request.mutable_open()->set_plane(v1::DATA_PLANE_SHM);
    stream->Write(request);
    stream->WritesDone();
    v1::AttachResponse ignored;
    while (stream->Read(&ignored)) {
    }
    codes["Attach"] = stream->Finish().error_code();
  }
  {  // last: with the right credential it drops the job the calls above made
    auto c = context();
    v1::DropJobRequest request;
    request.set_job_id(job_id);
    v1::DropJobResponse response;
    codes["DropJob"] = stub->DropJob(c.get(), request, &response).error_code();
  }
  return codes;
}

class ShardAccessTest : public ::testing::Test {
 protected:
  ShardAccessTest() : pool_(ThreadPool::Options{2, false}) {
    ShardOptions options;
    options.memory_limit_bytes = int64_t{64} << 20;
    options.wave_elements = 2 * kTileElements;
    store_ = std::make_unique<ShardStore>(options, &pool_, BestSimdPath());
  }

  void Serve(ShardAccess::Mode mode, std::vector<std::string> operator_tokens) {
    BearerTokens tokens;
    for (std::string& t : operator_tokens) tokens.Add(std::move(t));
    access_ = std::make_unique<ShardAccess>(mode, std::move(tokens));
    ServerOptions server_options;
    server_options.listen_address = "127.0.0.1:0";
    server_options.max_message_bytes = int64_t{8} << 20;
    server_options.enable_ucx = false;
    server_options.access = access_.get();
    auto server = OptimizerServer::Start(server_options, store_.get());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    address_ = "127.0.0.1:" + std::to_string(server_->port());
    stub_ = v1::OptimizerShard::NewStub(
        grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  }

  std::unique_ptr<ShardClient> Client(const std::string& token) {
    ClientOptions options;
    options.address = address_;
    options.max_message_bytes = int64_t{8} << 20;
    options.token = token;
    auto client = ShardClient::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  // Every RPC ended with `want`.
  void ExpectEvery(const std::string& token, const std::string& job_id, grpc::StatusCode want) {
    for (const auto& [rpc, code] : CallEveryRpc(stub_.get(), token, job_id)) {
      EXPECT_EQ(code, want) << rpc << " with token \"" << token << "\" about " << job_id;
    }
  }
  // Every RPC got past the credential check (it may still fail for its own reasons, such as a
  // job not loaded yet).
  void ExpectLetIn(const std::string& token, const std::string& job_id) {
    for (const auto& [rpc, code] : CallEveryRpc(stub_.get(), token, job_id)) {
      EXPECT_NE(code, grpc::StatusCode::UNAUTHENTICATED) << rpc << " about " << job_id;
      EXPECT_NE(code, grpc::StatusCode::PERMISSION_DENIED) << rpc << " about " << job_id;
    }
  }

  ThreadPool pool_;
  std::unique_ptr<ShardStore> store_;
  std::unique_ptr<ShardAccess> access_;
  std::unique_ptr<OptimizerServer> server_;
  std::string address_;
  std::unique_ptr<v1::OptimizerShard::Stub> stub_;
};

TEST_F(ShardAccessTest, PoolServerTakesEachJobOnlyWithItsAttemptsSecret) {
  Serve(ShardAccess::Mode::kPool, {"operator-token"});
  access_->Grant("job-a.1", "secret-a");
  access_->Grant("job-b.1", "secret-b");

  ExpectEvery("", "job-a.1", grpc::StatusCode::UNAUTHENTICATED);
  ExpectEvery("not-a-secret", "job-a.1", grpc::StatusCode::UNAUTHENTICATED);
  // Another attempt's secret: known, but not for this job. DescribeShard (about no job) lets it
  // in and is left out here.
  for (const auto& [rpc, code] : CallEveryRpc(stub_.get(), "secret-b", "job-a.1")) {
    if (rpc == "DescribeShard") continue;
    EXPECT_EQ(code, grpc::StatusCode::PERMISSION_DENIED) << rpc;
  }
  // A job id nobody was granted, with a real secret.
  for (const auto& [rpc, code] : CallEveryRpc(stub_.get(), "secret-a", "job-c.1")) {
    if (rpc == "DescribeShard") continue;
    EXPECT_EQ(code, grpc::StatusCode::PERMISSION_DENIED) << rpc;
  }
  // The pool's operator token describes the shard but touches no job.
  for (const auto& [rpc, code] : CallEveryRpc(stub_.get(), "operator-token", "job-a.1")) {
    EXPECT_EQ(code,
              rpc == "DescribeShard" ? grpc::StatusCode::OK : grpc::StatusCode::PERMISSION_DENIED)
        << rpc;
  }
  ExpectLetIn("secret-a", "job-a.1");
  EXPECT_TRUE(store_->Jobs().empty());  // nothing but the right secret created anything
}

TEST_F(ShardAccessTest, DescribeShardShowsACallerOnlyItsOwnJob) {
  Serve(ShardAccess::Mode::kPool, {"operator-token"});
  access_->Grant("job-a.1", "secret-a");
  access_->Grant("job-b.1", "secret-b");
  std::unique_ptr<ShardClient> a = Client("secret-a");
  std::unique_ptr<ShardClient> b = Client("secret-b");
  ASSERT_TRUE(a->CreateJob(CreateRequest("job-a.1")).ok());
  ASSERT_TRUE(b->CreateJob(CreateRequest("job-b.1")).ok());

  auto seen = [](ShardClient* client) {
    std::vector<std::string> ids;
    auto describe = client->DescribeShard();
    EXPECT_TRUE(describe.ok()) << describe.status();
    if (describe.ok()) {
      for (const v1::JobStatus& job : describe->jobs()) ids.push_back(job.job_id());
    }
    return ids;
  };
  EXPECT_EQ(seen(a.get()), std::vector<std::string>{"job-a.1"});
  EXPECT_EQ(seen(b.get()), std::vector<std::string>{"job-b.1"});
  std::unique_ptr<ShardClient> op = Client("operator-token");
  EXPECT_EQ(seen(op.get()), (std::vector<std::string>{"job-a.1", "job-b.1"}));
  EXPECT_EQ(Client("")->DescribeShard().status().code(), absl::StatusCode::kUnauthenticated);

  // A's attempt is withdrawn: its secret opens nothing from now on, and B's still works.
  access_->Revoke("job-a.1");
  EXPECT_EQ(a->DescribeShard().status().code(), absl::StatusCode::kUnauthenticated);
  std::vector<float> zeros(kLen);
  EXPECT_EQ(a->LoadState("job-a.1", v1::STATE_TENSOR_MASTER_WEIGHTS, 0, zeros.data(), kLen).code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(b->LoadState("job-b.1", v1::STATE_TENSOR_MASTER_WEIGHTS, 0, zeros.data(), kLen).ok());
}

TEST_F(ShardAccessTest, StandaloneServerTakesAnyJobWithAnOperatorToken) {
  Serve(ShardAccess::Mode::kStandalone, {"token-1", "token-2"});
  ExpectEvery("", "job.0", grpc::StatusCode::UNAUTHENTICATED);
  ExpectEvery("token-3", "job.0", grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(store_->Jobs().empty());
  ExpectLetIn("token-2", "job.0");
  // The trainer's client: the whole round trip with its token on every call.
  std::unique_ptr<ShardClient> client = Client("token-1");
  ASSERT_TRUE(client->CreateJob(CreateRequest("job.1")).ok());
  std::vector<float> weights(kLen, 0.5f);
  ASSERT_TRUE(
      client->LoadState("job.1", v1::STATE_TENSOR_MASTER_WEIGHTS, 0, weights.data(), kLen).ok());
  auto stream = client->OpenStep("job.1", 0, 0, kLen, 1);
  ASSERT_TRUE(stream.ok()) << stream.status();
  std::vector<uint16_t> grads(kLen, 0x3f80);  // bf16 1.0
  ASSERT_TRUE((*stream)->SendGradients(0, grads.data(), DType::kBf16, kLen).ok());
  std::vector<uint16_t> params(kLen);
  auto result = (*stream)->Commit(1e-3f, 1.0f, false, params.data());
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->applied());
  std::vector<float> read(kLen);
  ASSERT_TRUE(
      client
          ->ReadState("job.1", v1::STATE_TENSOR_MASTER_WEIGHTS, DType::kFp32, 0, kLen, read.data())
          .ok());
  EXPECT_LT(read[0], 0.5f);  // the step moved the weight against its gradient
  EXPECT_TRUE(client->DropJob("job.1").ok());
}

TEST_F(ShardAccessTest, StandaloneServerWithoutTokensIsOpen) {
  Serve(ShardAccess::Mode::kStandalone, {});
  ExpectLetIn("", "job.0");
  ExpectLetIn("anything", "job.0");
}

}  // namespace
}  // namespace offload
