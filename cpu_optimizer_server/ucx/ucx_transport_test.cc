// What is particular to the UCX data plane (the step-exchange suite shared by every transport is
// step_exchange_test.cc): a probe, steps through UCX that leave the shard bit-identical to the
// same steps through gRPC, for UCX_TLS=tcp and UCX_TLS=sm,self; a large step that goes
// rendezvous both ways; the same errors as gRPC; a shard that dies while the trainer waits.
#include "cpu_optimizer_server/ucx/ucx_transport.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cpu_optimizer_server/grpc/optimizer_service.h"
#include "cpu_optimizer_server/grpc/service_test_util.h"

namespace offload {
namespace {

constexpr char kGrpcJob[] = "ucx-test-grpc";
constexpr char kUcxJob[] = "ucx-test-ucx";

// Param: the UCX_TLS value, read when each UCP context is created (ucp_config_read).
class UcxTransportTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { setenv("UCX_TLS", GetParam(), 1); }
  void TearDown() override {
    transport_.reset();
    client_.reset();
    server_.reset();
    store_.reset();
    pool_.reset();
    unsetenv("UCX_TLS");
  }

  void Start(int64_t wave_elements, int64_t chunk_bytes) {
    pool_ = std::make_unique<ThreadPool>(ThreadPool::Options{2, false});
    ShardOptions options;
    options.memory_limit_bytes = int64_t{2} << 30;
    options.wave_elements = wave_elements;
    store_ = std::make_unique<ShardStore>(options, pool_.get(), BestSimdPath());
    ServerOptions server_options;
    server_options.listen_address = "127.0.0.1:0";
    server_options.max_message_bytes = int64_t{16} << 20;
    server_options.enable_shm = true;
    server_options.enable_ucx = true;
    auto server = OptimizerServer::Start(server_options, store_.get());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ClientOptions client_options;
    client_options.address = "127.0.0.1:" + std::to_string(server_->port());
    client_options.chunk_bytes = chunk_bytes;
    client_options.max_message_bytes = int64_t{16} << 20;
    auto client = ShardClient::Connect(client_options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    UcxOptions ucx_options;
    ucx_options.chunk_bytes = chunk_bytes;
    auto transport = CreateUcxTransport(client_.get(), ucx_options);
    ASSERT_TRUE(transport.ok()) << transport.status();
    transport_ = *std::move(transport);
  }

  // Two identical jobs, one stepped through gRPC, one through UCX.
  void CreateJobs(const std::vector<int64_t>& lengths, v1::DType param_dtype) {
    int64_t total = 0;
    for (int64_t n : lengths) total += n;
    std::mt19937 rng(1234);
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> weights(total);
    for (float& w : weights) w = d(rng);
    for (const char* job : {kGrpcJob, kUcxJob}) {
      v1::CreateJobRequest r;
      r.set_job_id(job);
      int64_t offset = 0;
      for (int64_t n : lengths) {
        v1::ParamRange* range = r.add_ranges();
        range->set_offset(offset);
        range->set_length(n);
        offset += n;
      }
      *r.mutable_adam() = TestAdamW();
      r.set_param_dtype(param_dtype);
      ASSERT_TRUE(client_->CreateJob(r).ok());
      ASSERT_TRUE(client_
                      ->LoadState(job, v1::STATE_TENSOR_MASTER_WEIGHTS, 0, weights.data(),
                                  static_cast<int64_t>(weights.size()))
                      .ok());
    }
  }

  std::string Fingerprint(const char* job, int64_t total) {
    std::string all;
    for (v1::StateTensor t :
         {v1::STATE_TENSOR_MASTER_WEIGHTS, v1::STATE_TENSOR_EXP_AVG, v1::STATE_TENSOR_EXP_AVG_SQ}) {
      std::string bytes(total * 4, '\0');
      EXPECT_TRUE(client_->ReadState(job, t, DType::kFp32, 0, total, bytes.data()).ok());
      all += bytes;
    }
    auto describe = client_->DescribeShard();
    EXPECT_TRUE(describe.ok());
    for (const v1::JobStatus& j : describe->jobs()) {
      if (j.job_id() != job) continue;
      for (const v1::RangeStatus& r : j.ranges()) {
        v1::RangeStatus copy = r;
        copy.clear_has_accumulator();
        all += copy.SerializeAsString();
      }
    }
    return all;
  }

  struct Outcome {
    absl::Status status;
    v1::StepResult result;
    std::vector<uint16_t> params;
  };

  // One step of one range: bf16 gradients in two halves, then an fp32 micro-batch accumulated on
  // the first quarter, then the commit.
  Outcome RunStep(StepTransport* t, const char* job, uint32_t range, int64_t offset, int64_t n,
                  uint64_t step, const std::vector<uint16_t>& g16, const std::vector<float>& g32) {
    Outcome out;
    auto stream = t->OpenStep(job, range, offset, n, step);
    if (!stream.ok()) {
      out.status = stream.status();
      return out;
    }
    const int64_t half = n / 2;
    out.status = (*stream)->SendGradients(offset, g16.data(), DType::kBf16, half);
    if (out.status.ok()) {
      out.status =
          (*stream)->SendGradients(offset + half, g16.data() + half, DType::kBf16, n - half);
    }
    if (out.status.ok()) {
      out.status = (*stream)->SendGradients(offset, g32.data(), DType::kFp32, n / 4, true);
    }
    if (!out.status.ok()) return out;
    out.params.assign(n, 0);
    absl::StatusOr<v1::StepResult> r = (*stream)->Commit(1e-3f, 0.5f, false, out.params.data());
    out.status = r.status();
    if (r.ok()) out.result = *r;
    return out;
  }

  void CompareSteps(const std::vector<int64_t>& lengths, int steps, bool timed) {
    int64_t total = 0;
    for (int64_t n : lengths) total += n;
    std::mt19937 rng(99);
    std::normal_distribution<float> d(0.0f, 0.1f);
    for (int step = 1; step <= steps; ++step) {
      int64_t offset = 0;
      for (uint32_t r = 0; r < lengths.size(); ++r) {
        const int64_t n = lengths[r];
        std::vector<float> g32(n);
        std::vector<uint16_t> g16(n);
        for (int64_t i = 0; i < n; ++i) {
          g32[i] = d(rng);
          g16[i] = FloatToBf16(d(rng));
        }
        const auto t0 = std::chrono::steady_clock::now();
        Outcome via_grpc = RunStep(client_.get(), kGrpcJob, r, offset, n, step, g16, g32);
        const auto t1 = std::chrono::steady_clock::now();
        Outcome via_ucx = RunStep(transport_.get(), kUcxJob, r, offset, n, step, g16, g32);
        const auto t2 = std::chrono::steady_clock::now();
        if (timed) {
          std::printf(
              "UCX_TLS=%s: step of %lld elements (%.1f MiB in, %.1f MiB out, Adam included): "
              "ucx %.1f ms, grpc %.1f ms\n",
              GetParam(), static_cast<long long>(n), n * 3.0 / (1 << 20), n * 2.0 / (1 << 20),
              std::chrono::duration<double, std::milli>(t2 - t1).count(),
              std::chrono::duration<double, std::milli>(t1 - t0).count());
        }
        ASSERT_TRUE(via_grpc.status.ok()) << via_grpc.status;
        ASSERT_TRUE(via_ucx.status.ok()) << via_ucx.status;
        EXPECT_EQ(via_grpc.result.SerializeAsString(), via_ucx.result.SerializeAsString());
        EXPECT_TRUE(via_grpc.params == via_ucx.params) << "step " << step << " range " << r;
        offset += n;
      }
    }
    EXPECT_TRUE(Fingerprint(kGrpcJob, total) == Fingerprint(kUcxJob, total));
  }

  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<ShardStore> store_;
  std::unique_ptr<OptimizerServer> server_;
  std::unique_ptr<ShardClient> client_;
  std::unique_ptr<StepTransport> transport_;
};

TEST_P(UcxTransportTest, ProbeWorks) {
  Start(2 * kTileElements, 64 << 10);
  EXPECT_TRUE(ProbeUcx(client_.get()).ok());
  EXPECT_EQ(transport_->name(), "ucx");
}

// Chunks of 96 KiB: bf16 halves go rendezvous, the smaller pieces eager; waves of 32 Ki
// parameters (64 KiB) go eager.
TEST_P(UcxTransportTest, StepsEqualGrpcBitForBit) {
  Start(2 * kTileElements, 96 << 10);
  const std::vector<int64_t> lengths = {70001, 33333};
  CreateJobs(lengths, v1::DTYPE_BF16);
  CompareSteps(lengths, 3, false);
}

// 8 Mi elements in 4 MiB chunks, 1 Mi-element waves: rendezvous in both directions.
TEST_P(UcxTransportTest, LargeStepGoesRendezvous) {
  Start(64 * kTileElements, 4 << 20);
  const std::vector<int64_t> lengths = {int64_t{8} << 20};
  CreateJobs(lengths, v1::DTYPE_FP16);
  CompareSteps(lengths, 2, true);
}

TEST_P(UcxTransportTest, ErrorsMatchGrpc) {
  Start(2 * kTileElements, 64 << 10);
  const int64_t n = 50000;
  CreateJobs({n}, v1::DTYPE_BF16);
  std::vector<uint16_t> g(n, FloatToBf16(0.01f));
  std::vector<uint16_t> params(n);
  for (StepTransport* t : {static_cast<StepTransport*>(client_.get()), transport_.get()}) {
    const char* job = t == transport_.get() ? kUcxJob : kGrpcJob;
    SCOPED_TRACE(t->name());
    // A step out of order: UCX says so at the open, gRPC at the latest at the commit.
    {
      absl::Status s;
      auto stream = t->OpenStep(job, 0, 0, n, 5);
      if (stream.ok())
        s = (*stream)->Commit(1e-3f, 1, false, params.data()).status();
      else
        s = stream.status();
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    }
    // Overlapping chunks: INVALID_ARGUMENT, from the send or the commit; nothing applied.
    {
      auto stream = t->OpenStep(job, 0, 0, n, 1);
      ASSERT_TRUE(stream.ok()) << stream.status();
      absl::Status s = (*stream)->SendGradients(0, g.data(), DType::kBf16, n);
      if (s.ok()) s = (*stream)->SendGradients(10, g.data(), DType::kBf16, 100);
      if (s.ok()) s = (*stream)->Commit(1e-3f, 1, false, params.data()).status();
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    }
    // Unknown job.
    {
      absl::Status s;
      auto stream = t->OpenStep("no-such-job", 0, 0, n, 1);
      if (stream.ok())
        s = (*stream)->Commit(1e-3f, 1, false, params.data()).status();
      else
        s = stream.status();
      EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    }
    // An abandoned step leaves the range free for the real one, and a replay returns the same.
    {
      auto stream = t->OpenStep(job, 0, 0, n, 1);
      ASSERT_TRUE(stream.ok()) << stream.status();
      ASSERT_TRUE((*stream)->SendGradients(0, g.data(), DType::kBf16, n / 2).ok());
      (*stream)->Abandon();
    }
    auto step1 = [&]() -> absl::StatusOr<v1::StepResult> {
      auto stream = t->OpenStep(job, 0, 0, n, 1);
      if (!stream.ok()) return stream.status();
      if (auto s = (*stream)->SendGradients(0, g.data(), DType::kBf16, n); !s.ok()) return s;
      return (*stream)->Commit(1e-3f, 1, false, params.data());
    };
    for (int replay = 0; replay < 2; ++replay) {
      absl::StatusOr<v1::StepResult> r = step1();
      // gRPC only: the server's handler of the abandoned stream may still hold the range's lease
      // for a moment after the client cancelled it. (Over UCX the ABANDON is ordered before the
      // next OPEN on the same endpoint, so there is no such window.)
      for (int i = 0; i < 200 && t == client_.get() && !r.ok() &&
                      r.status().code() == absl::StatusCode::kAborted;
           ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        r = step1();
      }
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->replayed(), replay == 1);
    }
  }
  EXPECT_TRUE(Fingerprint(kGrpcJob, n) == Fingerprint(kUcxJob, n));
}

TEST_P(UcxTransportTest, ShardDeathIsUnavailableNotAHang) {
  Start(64 * kTileElements, 4 << 20);
  const int64_t n = int64_t{4} << 20;
  CreateJobs({n}, v1::DTYPE_BF16);
  std::vector<uint16_t> g(n, FloatToBf16(0.01f));
  std::vector<uint16_t> params(n);
  auto stream = transport_->OpenStep(kUcxJob, 0, 0, n, 1);
  ASSERT_TRUE(stream.ok()) << stream.status();
  ASSERT_TRUE((*stream)->SendGradients(0, g.data(), DType::kBf16, n).ok());
  std::thread killer([this] { server_->Shutdown(); });
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<v1::StepResult> r = (*stream)->Commit(1e-3f, 1, false, params.data());
  killer.join();
  // The commit may have raced through before the shutdown; the next step cannot.
  if (!r.ok()) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  }
  stream->reset();
  auto next = transport_->OpenStep(kUcxJob, 0, 0, n, 2);
  EXPECT_FALSE(next.ok());
  if (!next.ok()) {
    EXPECT_EQ(next.status().code(), absl::StatusCode::kUnavailable) << next.status();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
}

INSTANTIATE_TEST_SUITE_P(Tls, UcxTransportTest, ::testing::Values("tcp", "sm,self"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param[0] == 't' ? "tcp" : "sm_self");
                         });

}  // namespace
}  // namespace offload
