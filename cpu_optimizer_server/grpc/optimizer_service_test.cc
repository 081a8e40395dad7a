// The gRPC service with a real client over loopback: full step round trips, repeated and
// out-of-order commits, every bad input of ARCHITECTURE.md section 4 (each must leave the shard's
// state bit-identical), a client that disconnects mid-stream, and health checking.
#include "cpu_optimizer_server/grpc/optimizer_service.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "cpu_optimizer_server/grpc/service_test_util.h"
#include "cpu_optimizer_server/grpc/shard_client.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"

namespace offload {
namespace {

constexpr char kJob[] = "svc-job";
constexpr int64_t kLen0 = 70001;  // range 0: [0, kLen0)
constexpr int64_t kLen1 = 33333;  // range 1: [kLen0, kLen0 + kLen1)

class OptimizerServiceTest : public ::testing::Test {
 protected:
  OptimizerServiceTest() : pool_(ThreadPool::Options{2, false}) {
    ShardOptions options;
    options.memory_limit_bytes = int64_t{256} << 20;
    options.wave_elements = 2 * kTileElements;
    store_ = std::make_unique<ShardStore>(options, &pool_, BestSimdPath());
    ServerOptions server_options;
    server_options.listen_address = "127.0.0.1:0";
    server_options.max_message_bytes = int64_t{8} << 20;
    auto server = OptimizerServer::Start(server_options, store_.get());
    EXPECT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    address_ = "127.0.0.1:" + std::to_string(server_->port());
    ClientOptions client_options;
    client_options.address = address_;
    client_options.chunk_bytes = 64 << 10;  // many chunks per range
    client_options.max_message_bytes = int64_t{8} << 20;
    auto client = ShardClient::Connect(client_options);
    EXPECT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    channel_ = grpc::CreateChannel(address_, grpc::InsecureChannelCredentials());
    stub_ = v1::OptimizerShard::NewStub(channel_);
    seed_ = std::random_device()();
    rng_.seed(seed_);
  }

  v1::CreateJobRequest CreateRequest() {
    v1::CreateJobRequest r;
    r.set_job_id(kJob);
    v1::ParamRange* a = r.add_ranges();
    a->set_offset(0);
    a->set_length(kLen0);
    v1::ParamRange* b = r.add_ranges();
    b->set_offset(kLen0);
    b->set_length(kLen1);
    *r.mutable_adam() = TestAdamW();
    r.set_param_dtype(v1::DTYPE_BF16);
    return r;
  }

  std::vector<float> Random(int64_t n, float scale) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng_);
    return v;
  }

  void CreateAndLoad() {
    ASSERT_TRUE(client_->CreateJob(CreateRequest()).ok());
    weights_ = Random(kLen0 + kLen1, 1.0f);
    ASSERT_TRUE(
        client_->LoadState(kJob, v1::STATE_TENSOR_MASTER_WEIGHTS, 0, weights_.data(), kLen0 + kLen1)
            .ok());
  }

  std::vector<uint16_t> Bf16Grads(int64_t n) {
    std::vector<float> g = Random(n, 0.1f);
    std::vector<uint16_t> h(n);
    for (int64_t i = 0; i < n; ++i) h[i] = FloatToBf16(g[i]);
    return h;
  }

  // The whole fp32 state plus the step counters, as a client sees it.
  std::string StateFingerprint() {
    std::string all;
    for (v1::StateTensor t :
         {v1::STATE_TENSOR_MASTER_WEIGHTS, v1::STATE_TENSOR_EXP_AVG, v1::STATE_TENSOR_EXP_AVG_SQ}) {
      for (auto [offset, n] : {std::pair<int64_t, int64_t>{0, kLen0}, {kLen0, kLen1}}) {
        std::string bytes(n * 4, '\0');
        EXPECT_TRUE(client_->ReadState(kJob, t, DType::kFp32, offset, n, bytes.data()).ok());
        all += bytes;
      }
    }
    auto describe = client_->DescribeShard();
    EXPECT_TRUE(describe.ok());
    for (const v1::JobStatus& j : describe->jobs()) {
      for (const v1::RangeStatus& r : j.ranges()) all += r.SerializeAsString();
    }
    return all;
  }

  // Runs step `step` of range 0 through the client.
  absl::StatusOr<v1::StepResult> Step0(uint64_t step, const std::vector<uint16_t>& g,
                                       std::vector<uint16_t>* params) {
    auto stream = client_->OpenStep(kJob, 0, 0, kLen0, step);
    if (!stream.ok()) return stream.status();
    if (auto s = (*stream)->SendGradients(0, g.data(), DType::kBf16, kLen0); !s.ok()) return s;
    params->assign(kLen0, 0);
    return (*stream)->Commit(1e-3, 1.0f, false, params->data());
  }

  // Sends raw messages on a step stream and returns the status the server ends it with; counts
  // the parameter chunks that came back into *param_chunks if given.
  grpc::Status RawStep(const std::vector<v1::StepRequest>& messages, int* param_chunks = nullptr) {
    grpc::ClientContext context;
    auto stream = stub_->Step(&context);
    for (const v1::StepRequest& m : messages) {
      if (!stream->Write(m)) break;
    }
    stream->WritesDone();
    v1::StepResponse response;
    int chunks = 0;
    while (stream->Read(&response)) chunks += response.has_params();
    if (param_chunks != nullptr) *param_chunks = chunks;
    return stream->Finish();
  }

  // Sends raw LoadState messages and returns the status.
  grpc::Status RawLoad(const std::vector<v1::LoadStateRequest>& messages) {
    grpc::ClientContext context;
    v1::LoadStateResponse response;
    auto writer = stub_->LoadState(&context, &response);
    for (const v1::LoadStateRequest& m : messages) {
      if (!writer->Write(m)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }
  static v1::LoadStateRequest LoadMessage(uint64_t offset, const std::vector<float>& values) {
    v1::LoadStateRequest r;
    r.set_job_id(kJob);
    v1::StateChunk* c = r.add_chunks();
    c->set_tensor(v1::STATE_TENSOR_MASTER_WEIGHTS);
    c->set_dtype(v1::DTYPE_FP32);
    c->set_offset(offset);
    c->set_data(values.data(), values.size() * 4);
    return r;
  }

  static v1::StepRequest Open(const std::string& job, uint32_t range, uint64_t step) {
    v1::StepRequest r;
    r.mutable_open()->set_job_id(job);
    r.mutable_open()->set_range_index(range);
    r.mutable_open()->set_step(step);
    return r;
  }
  static v1::StepRequest Grad(uint64_t offset, v1::DType dtype, std::string data,
                              bool accumulate = false) {
    v1::StepRequest r;
    r.mutable_grad()->set_offset(offset);
    r.mutable_grad()->set_dtype(dtype);
    r.mutable_grad()->set_accumulate(accumulate);
    r.mutable_grad()->set_data(std::move(data));
    return r;
  }
  static v1::StepRequest Commit(uint64_t step, double lr, float gm, bool skip = false,
                                std::vector<double> group_lr = {}) {
    v1::StepRequest r;
    r.mutable_commit()->set_step(step);
    r.mutable_commit()->set_lr(lr);
    r.mutable_commit()->set_grad_multiplier(gm);
    r.mutable_commit()->set_skip(skip);
    r.mutable_commit()->mutable_group_lr()->Assign(group_lr.begin(), group_lr.end());
    return r;
  }

  ThreadPool pool_;
  std::unique_ptr<ShardStore> store_;
  std::unique_ptr<OptimizerServer> server_;
  std::string address_;
  std::unique_ptr<ShardClient> client_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::OptimizerShard::Stub> stub_;
  uint32_t seed_;
  std::mt19937 rng_;
  std::vector<float> weights_;
};

TEST_F(OptimizerServiceTest, FullStepRoundTripMatchesTheKernel) {
  CreateAndLoad();
  for (uint64_t step = 1; step <= 2; ++step) {
    std::vector<uint16_t> g0 = Bf16Grads(kLen0), g1 = Bf16Grads(kLen1);
    std::vector<uint16_t> p0, p1(kLen1);
    auto r0 = Step0(step, g0, &p0);
    ASSERT_TRUE(r0.ok()) << r0.status();
    EXPECT_TRUE(r0->applied());
    EXPECT_EQ(r0->adam_step(), step);
    // Range 1 with its gradients sent in reverse chunk order.
    auto stream = client_->OpenStep(kJob, 1, kLen0, kLen1, step);
    ASSERT_TRUE(stream.ok());
    const int64_t cut = 20000;
    ASSERT_TRUE(
        (*stream)->SendGradients(kLen0 + cut, g1.data() + cut, DType::kBf16, kLen1 - cut).ok());
    ASSERT_TRUE((*stream)->SendGradients(kLen0, g1.data(), DType::kBf16, cut).ok());
    auto r1 = (*stream)->Commit(1e-3, 1.0f, false, p1.data());
    ASSERT_TRUE(r1.ok()) << r1.status();

    // The reference: the same kernel on a local copy of the state.
    static std::vector<float> p, m, v;
    if (step == 1) {
      p = weights_;
      m.assign(p.size(), 0);
      v.assign(p.size(), 0);
    }
    std::vector<uint16_t> g(g0);
    g.insert(g.end(), g1.begin(), g1.end());
    std::vector<uint16_t> expect(p.size());
    AdamHyperParams hp;
    hp.lr = 1e-3;
    hp.weight_decay = 0.01;
    AdamSpan span{g.data(), DType::kBf16,  p.data(),     m.data(),
                  v.data(), expect.data(), DType::kBf16, static_cast<int64_t>(p.size())};
    GetAdamKernel(BestSimdPath())(ComputeAdamStepScalars(hp, 1e-3, step, 1.0f), span);
    ASSERT_EQ(std::memcmp(p0.data(), expect.data(), kLen0 * 2), 0) << "seed " << seed_;
    ASSERT_EQ(std::memcmp(p1.data(), expect.data() + kLen0, kLen1 * 2), 0) << "seed " << seed_;
    std::vector<float> master(kLen0 + kLen1);
    ASSERT_TRUE(client_
                    ->ReadState(kJob, v1::STATE_TENSOR_MASTER_WEIGHTS, DType::kFp32, 0,
                                kLen0 + kLen1, master.data())
                    .ok());
    ASSERT_EQ(master, p);
    std::vector<uint16_t> master16(kLen0);
    ASSERT_TRUE(client_
                    ->ReadState(kJob, v1::STATE_TENSOR_MASTER_WEIGHTS, DType::kBf16, 0, kLen0,
                                master16.data())
                    .ok());
    EXPECT_EQ(master16, p0);
  }
  auto describe = client_->DescribeShard();
  ASSERT_TRUE(describe.ok());
  ASSERT_EQ(describe->jobs_size(), 1);
  EXPECT_EQ(describe->jobs(0).ranges(0).adam_step(), 2u);
  EXPECT_EQ(describe->jobs(0).ranges(1).completed_step(), 2u);
  EXPECT_FALSE(describe->jobs(0).ranges(0).has_accumulator());
}

TEST_F(OptimizerServiceTest, RepeatedCommitReturnsTheSameParameters) {
  CreateAndLoad();
  std::vector<uint16_t> g = Bf16Grads(kLen0), first, again;
  ASSERT_TRUE(Step0(1, g, &first).ok());
  const std::string state = StateFingerprint();
  auto replay = Step0(1, Bf16Grads(kLen0), &again);  // different gradients: ignored
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_TRUE(replay->replayed());
  EXPECT_FALSE(replay->applied());
  EXPECT_EQ(first, again);
  EXPECT_EQ(StateFingerprint(), state);
}

TEST_F(OptimizerServiceTest, OutOfOrderCommitIsFailedPrecondition) {
  CreateAndLoad();
  const std::string state = StateFingerprint();
  std::vector<uint16_t> g = Bf16Grads(kLen0), params;
  auto result = Step0(3, g, &params);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition) << result.status();
  EXPECT_NE(result.status().message().find("out of order"), std::string::npos);
  EXPECT_EQ(StateFingerprint(), state);
}

TEST_F(OptimizerServiceTest, EveryBadInputIsRefusedAndChangesNothing) {
  CreateAndLoad();
  std::vector<uint16_t> warm = Bf16Grads(kLen0), params;
  ASSERT_TRUE(Step0(1, warm, &params).ok());
  const std::string state = StateFingerprint();
  std::vector<uint16_t> g = Bf16Grads(kLen0);
  const std::string all(reinterpret_cast<const char*>(g.data()), kLen0 * 2);
  const std::string head = all.substr(0, 2000);
  struct Case {
    const char* what;
    grpc::StatusCode code;
    std::vector<v1::StepRequest> messages;
  };
  std::vector<Case> cases = {
      {"unknown job", grpc::NOT_FOUND, {Open("nope", 0, 2)}},
      {"unknown range", grpc::INVALID_ARGUMENT, {Open(kJob, 2, 2)}},
      {"first message not open", grpc::INVALID_ARGUMENT, {Grad(0, v1::DTYPE_BF16, head)}},
      {"open twice", grpc::INVALID_ARGUMENT, {Open(kJob, 0, 2), Open(kJob, 0, 2)}},
      {"dtype unspecified",
       grpc::INVALID_ARGUMENT,
       {Open(kJob, 0, 2), Grad(0, v1::DTYPE_UNSPECIFIED, head)}},
      {"byte length not a whole element",
       grpc::INVALID_ARGUMENT,
       {Open(kJob, 0, 2), Grad(0, v1::DTYPE_BF16, "abc")}},
      {"fp32 bytes not a multiple of 4",
       grpc::INVALID_ARGUMENT,
       {Open(kJob, 0, 2), Grad(0, v1::DTYPE_FP32, "abcdef")}},
      {"offset past the range",
       grpc::OUT_OF_RANGE,
       {Open(kJob, 0, 2), Grad(kLen0, v1::DTYPE_BF16, head)}},
      {"chunk runs past the range",
       grpc::OUT_OF_RANGE,
       {Open(kJob, 0, 2), Grad(kLen0 - 10, v1::DTYPE_BF16, head)}},
      {"huge offset",
       grpc::OUT_OF_RANGE,
       {Open(kJob, 0, 2), Grad(~uint64_t{0}, v1::DTYPE_BF16, head)}},
      {"overlapping chunk",
       grpc::INVALID_ARGUMENT,
       {Open(kJob, 0, 2), Grad(0, v1::DTYPE_BF16, head), Grad(999, v1::DTYPE_BF16, head)}},
      {"NaN lr",
       grpc::INVALID_ARGUMENT,
       {Open(kJob, 0, 2), Grad(0, v1::DTYPE_BF16, all), Commit(2, std::nanf(""), 1.0f)}},
      {"inf grad_multiplier",
       grpc::INVALID_ARGUMENT,
       {Open(kJob, 0, 2), Grad(0, v1::DTYPE_BF16, all), Commit(2, 1e-3f, INFINITY)}},
      {"commit of another step",
       grpc::FAILED_PRECONDITION,
       {Open(kJob, 0, 2), Grad(0, v1::DTYPE_BF16, all), Commit(5, 1e-3f, 1.0f)}},
      {"missing gradients",
       grpc::FAILED_PRECONDITION,
       {Open(kJob, 0, 2), Grad(0, v1::DTYPE_BF16, head), Commit(2, 1e-3f, 1.0f)}},
      {"no commit", grpc::CANCELLED, {Open(kJob, 0, 2), Grad(0, v1::DTYPE_BF16, all)}},
      {"empty message", grpc::INVALID_ARGUMENT, {Open(kJob, 0, 2), v1::StepRequest()}},
      // The job has one parameter group (no groups given).
      {"two group lrs for one group",
       grpc::INVALID_ARGUMENT,
       {Open(kJob, 0, 2), Grad(0, v1::DTYPE_BF16, all), Commit(2, 1e-3f, 1.0f, false, {1, 1})}},
      {"NaN group lr",
       grpc::INVALID_ARGUMENT,
       {Open(kJob, 0, 2), Grad(0, v1::DTYPE_BF16, all),
        Commit(2, 1e-3f, 1.0f, false, {std::nanf("")})}},
      {"negative group lr on a skipped step",
       grpc::INVALID_ARGUMENT,
       {Open(kJob, 0, 2), Grad(0, v1::DTYPE_BF16, all), Commit(2, 1e-3f, 1.0f, true, {-1e-3f})}},
  };
  for (const Case& c : cases) {
    grpc::Status s = RawStep(c.messages);
    EXPECT_EQ(s.error_code(), c.code) << c.what << ": " << s.error_message();
    EXPECT_FALSE(s.error_message().empty()) << c.what;
    EXPECT_EQ(StateFingerprint(), state) << c.what;
  }

  // Bad CreateJob and LoadState requests.
  v1::CreateJobRequest bad = CreateRequest();
  bad.set_job_id("other");
  bad.mutable_adam()->set_beta1(std::nanf(""));
  EXPECT_EQ(client_->CreateJob(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad = CreateRequest();
  bad.set_job_id("other");
  bad.set_param_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(client_->CreateJob(bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->CreateJob(CreateRequest()).status().code(), absl::StatusCode::kAlreadyExists);
  // Parameter groups that overlap, leave a gap, have a bad hyper-parameter or are too many: the
  // refusal names the group, and no job is created.
  auto with_groups = [&](std::vector<std::pair<uint64_t, uint64_t>> spans) {
    v1::CreateJobRequest r = CreateRequest();
    r.set_job_id("grouped");
    for (auto [offset, length] : spans) {
      v1::ParamGroup* g = r.add_groups();
      g->set_offset(offset);
      g->set_length(length);
      *g->mutable_adam() = TestAdamW();
    }
    return r;
  };
  const uint64_t total = kLen0 + kLen1;
  struct GroupCase {
    const char* what;
    v1::CreateJobRequest request;
    const char* names;
  };
  std::vector<GroupCase> group_cases = {
      {"overlap", with_groups({{0, 1000}, {999, total}}), "groups[1]"},
      {"gap", with_groups({{0, 1000}, {1001, total}}), "groups[1] starts at 1001"},
      {"not to the end", with_groups({{0, 1000}, {1000, total - 1001}}), "groups[1]"},
      {"bad eps", with_groups({{0, 1000}, {1000, total}}), "parameter group 1: adam.eps"},
      {"65 groups", with_groups(std::vector<std::pair<uint64_t, uint64_t>>(65, {0, 0})),
       "groups[64]"},
  };
  group_cases[3].request.mutable_groups(1)->mutable_adam()->set_eps(0);
  group_cases[4].request.mutable_groups(64)->set_length(total);
  for (const GroupCase& c : group_cases) {
    absl::StatusOr<v1::CreateJobResponse> r = client_->CreateJob(c.request);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
        << c.what << ": " << r.status();
    EXPECT_NE(r.status().message().find(c.names), std::string::npos)
        << c.what << ": " << r.status();
  }
  std::vector<float> nan_weights(100, 1.0f);
  nan_weights[42] = std::nanf("");
  EXPECT_EQ(
      client_->LoadState(kJob, v1::STATE_TENSOR_MASTER_WEIGHTS, 0, nan_weights.data(), 100).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_
                ->LoadState(kJob, v1::STATE_TENSOR_MASTER_WEIGHTS, kLen0 + kLen1 - 50,
                            weights_.data(), 60)
                .code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(client_->LoadState(kJob, v1::STATE_TENSOR_UNSPECIFIED, 0, weights_.data(), 10).code(),
            absl::StatusCode::kInvalidArgument);
  // A load is all or nothing: good chunks before a bad one are not applied.
  std::vector<float> good(1000, 0.5f);
  EXPECT_EQ(RawLoad({LoadMessage(0, good), LoadMessage(5000, nan_weights)}).error_code(),
            grpc::INVALID_ARGUMENT);
  v1::LoadStateRequest steps = LoadMessage(0, good);
  steps.set_set_steps(true);
  steps.set_completed_step(3);
  steps.set_adam_step(4);  // more updates than steps
  EXPECT_EQ(RawLoad({steps}).error_code(), grpc::INVALID_ARGUMENT);
  steps.set_adam_step(2);
  EXPECT_EQ(RawLoad({LoadMessage(0, good), steps}).error_code(), grpc::INVALID_ARGUMENT)
      << "set_steps after the first message";
  EXPECT_EQ(StateFingerprint(), state);
  auto describe = client_->DescribeShard();
  ASSERT_TRUE(describe.ok());
  EXPECT_EQ(describe->jobs_size(), 1);
}

TEST_F(OptimizerServiceTest, ClientDisconnectingMidStreamAppliesNothing) {
  CreateAndLoad();
  const std::string state = StateFingerprint();
  std::vector<uint16_t> g = Bf16Grads(kLen0);
  {
    auto stream = client_->OpenStep(kJob, 0, 0, kLen0, 1);
    ASSERT_TRUE(stream.ok());
    ASSERT_TRUE((*stream)->SendGradients(0, g.data(), DType::kBf16, kLen0 / 2).ok());
    (*stream)->Abandon();  // cancels the call, as a crashed trainer's connection would
  }
  // The server notices asynchronously; until then the range's lease is still held (ABORTED).
  std::vector<uint16_t> params;
  absl::StatusOr<v1::StepResult> result;
  for (int attempt = 0; attempt < 100; ++attempt) {
    EXPECT_EQ(StateFingerprint(), state);
    result = Step0(1, g, &params);
    if (result.status().code() != absl::StatusCode::kAborted) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->applied());
  EXPECT_EQ(result->adam_step(), 1u);  // the abandoned stream did not count
}

TEST_F(OptimizerServiceTest, SkippedStepSendsNoParametersAndCounts) {
  CreateAndLoad();
  std::vector<float> before(kLen0);
  ASSERT_TRUE(
      client_
          ->ReadState(kJob, v1::STATE_TENSOR_MASTER_WEIGHTS, DType::kFp32, 0, kLen0, before.data())
          .ok());
  std::vector<uint16_t> g = Bf16Grads(kLen0);
  g[5] = 0x7f80;  // bf16 +inf: the trainer saw the overflow and skips
  int param_chunks = -1;
  grpc::Status s = RawStep(
      {Open(kJob, 0, 1),
       Grad(0, v1::DTYPE_BF16, std::string(reinterpret_cast<const char*>(g.data()), kLen0 * 2)),
       Commit(1, 1e-3f, 1.0f, /*skip=*/true)},
      &param_chunks);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(param_chunks, 0);
  std::vector<float> after(kLen0);
  ASSERT_TRUE(
      client_
          ->ReadState(kJob, v1::STATE_TENSOR_MASTER_WEIGHTS, DType::kFp32, 0, kLen0, after.data())
          .ok());
  EXPECT_EQ(std::memcmp(before.data(), after.data(), kLen0 * 4), 0);
  auto describe = client_->DescribeShard();
  ASSERT_TRUE(describe.ok());
  EXPECT_EQ(describe->jobs(0).ranges(0).skipped_steps(), 1u);
  EXPECT_EQ(describe->jobs(0).ranges(0).completed_step(), 1u);
  EXPECT_EQ(describe->jobs(0).ranges(0).adam_step(), 0u);
}

TEST_F(OptimizerServiceTest, DropJobFreesItsMemory) {
  CreateAndLoad();
  auto describe = client_->DescribeShard();
  ASSERT_TRUE(describe.ok());
  EXPECT_GE(describe->memory_used_bytes(), 12u * (kLen0 + kLen1));
  ASSERT_TRUE(client_->DropJob(kJob).ok());
  EXPECT_EQ(client_->DropJob(kJob).code(), absl::StatusCode::kNotFound);
  describe = client_->DescribeShard();
  ASSERT_TRUE(describe.ok());
  EXPECT_EQ(describe->memory_used_bytes(), 0u);
  EXPECT_EQ(describe->jobs_size(), 0);
}

// bf16 moments over the wire: the job holds 8 bytes an element and DescribeShard says so.
TEST_F(OptimizerServiceTest, Bf16StateIsReportedWithItsBytes) {
  v1::CreateJobRequest request = CreateRequest();
  request.set_state_dtype(v1::DTYPE_BF16);
  request.set_state_rounding(v1::STATE_ROUNDING_NEAREST);
  absl::StatusOr<v1::CreateJobResponse> created = client_->CreateJob(request);
  ASSERT_TRUE(created.ok()) << created.status();
  auto stride = [](int64_t n) { return (n + 15) / 16 * 16; };
  EXPECT_EQ(created->state_bytes(), 8u * (stride(kLen0) + stride(kLen1)));
  auto describe = client_->DescribeShard();
  ASSERT_TRUE(describe.ok()) << describe.status();
  ASSERT_EQ(describe->jobs_size(), 1);
  EXPECT_EQ(describe->jobs(0).state_dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(describe->jobs(0).state_rounding(), v1::STATE_ROUNDING_NEAREST);
  EXPECT_EQ(describe->jobs(0).state_bytes(), created->state_bytes());
}

TEST_F(OptimizerServiceTest, RefusesAWaveLargerThanTheMessageLimit) {
  ShardOptions options;
  options.wave_elements = int64_t{8} << 20;  // 16 MiB of 16-bit parameters
  ShardStore store(options, &pool_, BestSimdPath());
  ServerOptions server_options;
  server_options.listen_address = "127.0.0.1:0";
  server_options.max_message_bytes = int64_t{8} << 20;
  auto server = OptimizerServer::Start(server_options, &store);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << server.status();
}

TEST_F(OptimizerServiceTest, ServesStandardHealthChecks) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext context;
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status s = health->Check(&context, request, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
}

// Server reflection, as grpcurl uses it, through a generic call: the request is
// ServerReflectionRequest{list_services: ""} in wire format (field 7, empty string).
TEST_F(OptimizerServiceTest, ServesReflection) {
  grpc::GenericStub stub(channel_);
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto call = stub.PrepareCall(
      &context, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  void* tag;
  bool ok;
  auto next = [&](intptr_t want) {
    EXPECT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(reinterpret_cast<intptr_t>(tag), want);
    return ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(next(1));
  const char request_bytes[] = {0x3a, 0x00};
  grpc::Slice slice(request_bytes, sizeof(request_bytes));
  grpc::ByteBuffer request(&slice, 1);
  call->Write(request, reinterpret_cast<void*>(2));
  ASSERT_TRUE(next(2));
  grpc::ByteBuffer response;
  call->Read(&response, reinterpret_cast<void*>(3));
  ASSERT_TRUE(next(3));
  grpc::Slice all;
  ASSERT_TRUE(response.DumpToSingleSlice(&all).ok());
  const std::string text(reinterpret_cast<const char*>(all.begin()), all.size());
  EXPECT_NE(text.find("offload.v1.OptimizerShard"), std::string::npos);
  EXPECT_NE(text.find("grpc.health.v1.Health"), std::string::npos);
  call->WritesDone(reinterpret_cast<void*>(4));
  next(4);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  next(5);
  EXPECT_TRUE(status.ok()) << status.error_message();
}

}  // namespace
}  // namespace offload
