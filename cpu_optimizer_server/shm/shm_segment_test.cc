// What is particular to the shared-memory data plane (the step rules themselves are covered by
// step_exchange_test.cc for every transport): the segment's layout and validation, the proof of
// the attach handshake, no segment left in /dev/shm, bit-identical steps against gRPC, micro-
// batches through the chunk slots, and the death of either side.
#include "cpu_optimizer_server/shm/shm_segment.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cpu_optimizer_server/grpc/optimizer_service.h"
#include "cpu_optimizer_server/grpc/service_test_util.h"
#include "cpu_optimizer_server/grpc/shard_client.h"
#include "cpu_optimizer_server/shm/shm_server.h"
#include "cpu_optimizer_server/shm/shm_transport.h"

namespace offload {
namespace {

// Names of this process's segments in /dev/shm.
std::vector<std::string> OurSegments() {
  const std::string prefix = absl::StrCat("offload-", getpid(), "-");
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    const std::string name = entry.path().filename().string();
    if (absl::StartsWith(name, prefix)) names.push_back(name);
  }
  return names;
}

TEST(ShmSegmentTest, CreateOpenAndValidate) {
  ShmLayout layout;
  layout.range_offset = 1000;
  layout.range_length = 12345;
  layout.param_dtype = static_cast<uint32_t>(DType::kBf16);
  layout.chunk_slots = 3;
  layout.chunk_slot_bytes = 4096;
  absl::StatusOr<ShmSegment> created = ShmSegment::Create(layout);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_TRUE(absl::StartsWith(created->name(), absl::StrCat("/offload-", getpid(), "-")));
  absl::StatusOr<ShmSegment> opened = ShmSegment::Open(created->name());
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ(opened->size(), created->size());
  EXPECT_EQ(opened->header()->range_offset, 1000);
  EXPECT_EQ(opened->header()->range_length, 12345);
  EXPECT_EQ(opened->header()->chunk_slots, 3u);
  EXPECT_EQ(std::memcmp(opened->header()->secret, created->header()->secret, kShmSecretBytes), 0);
  // Both mappings see the same memory.
  created->grad_area()[12345 * 2 - 1] = 7;
  created->slot(2)[4095] = 9;
  EXPECT_EQ(opened->grad_area()[12345 * 2 - 1], 7);
  EXPECT_EQ(opened->slot(2)[4095], 9);

  // A bad magic or a header that promises more than the file holds is refused.
  std::vector<char> copy(kShmHeaderBytes * 2);
  std::memcpy(copy.data(), created->header(), kShmHeaderBytes);
  copy[0] = 'X';
  absl::Status bad = ShmSegment::Validate(copy.data(), created->size());
  EXPECT_EQ(bad.code(), absl::StatusCode::kDataLoss) << bad;
  EXPECT_TRUE(absl::StrContains(bad.message(), "magic")) << bad;
  bad = ShmSegment::Validate(created->header(), created->size() - 4096);
  EXPECT_EQ(bad.code(), absl::StatusCode::kDataLoss) << bad;
  bad = ShmSegment::Validate(created->header(), 100);
  EXPECT_EQ(bad.code(), absl::StatusCode::kDataLoss) << bad;

  // A truncated file on disk.
  const std::string name = created->name();
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, kShmHeaderBytes), 0);
  close(fd);
  absl::StatusOr<ShmSegment> truncated = ShmSegment::Open(name);
  EXPECT_EQ(truncated.status().code(), absl::StatusCode::kDataLoss) << truncated.status();

  created->Unlink();
  absl::StatusOr<ShmSegment> gone = ShmSegment::Open(name);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kFailedPrecondition) << gone.status();
  EXPECT_TRUE(OurSegments().empty());
}

TEST(ShmSegmentTest, CreateRemovesItsNameOnDestruction) {
  std::string name;
  {
    absl::StatusOr<ShmSegment> s = ShmSegment::Create(ShmLayout{});
    ASSERT_TRUE(s.ok()) << s.status();
    name = s->name();
    EXPECT_EQ(OurSegments().size(), 1u);
  }
  EXPECT_TRUE(OurSegments().empty());
}

TEST(ShmSegmentTest, ProbeAgainstOptimizerServer) {
  ThreadPool pool(ThreadPool::Options{1, false});
  ShardStore store(ShardOptions{}, &pool, BestSimdPath());
  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  auto server = OptimizerServer::Start(options, &store);
  ASSERT_TRUE(server.ok()) << server.status();
  ClientOptions client_options;
  client_options.address = absl::StrCat("127.0.0.1:", (*server)->port());
  auto client = ShardClient::Connect(client_options);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_TRUE(ProbeShm(client->get()).ok()) << ProbeShm(client->get());
  EXPECT_TRUE(OurSegments().empty());

  // A server without the plane says so.
  ServerOptions no_shm = options;
  no_shm.enable_shm = false;
  auto plain = OptimizerServer::Start(no_shm, &store);
  ASSERT_TRUE(plain.ok()) << plain.status();
  client_options.address = absl::StrCat("127.0.0.1:", (*plain)->port());
  auto plain_client = ShardClient::Connect(client_options);
  ASSERT_TRUE(plain_client.ok());
  EXPECT_EQ(ProbeShm(plain_client->get()).code(), absl::StatusCode::kUnimplemented);
}

constexpr int64_t kLen0 = 70001;
constexpr int64_t kLen1 = 33333;

// A shard whose shm plane has small chunk slots, so a range needs many slot uses.
class ShmTransportTest : public ::testing::Test {
 protected:
  ShmTransportTest() : pool_(ThreadPool::Options{2, false}) {
    ShardOptions options;
    options.memory_limit_bytes = int64_t{256} << 20;
    options.wave_elements = 2 * kTileElements;
    store_ = std::make_unique<ShardStore>(options, &pool_, BestSimdPath());
    ShmOptions shm;
    shm.chunk_slot_bytes = 16 << 10;
    shm.chunk_slots = 2;
    shm.poll_interval = absl::Milliseconds(50);
    shm_server_ = CreateShmServer(store_.get(), shm);
    service_ = std::make_unique<OptimizerService>(store_.get(), int64_t{8} << 20,
                                                  std::vector<DataPlaneServer*>{shm_server_.get()});
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    EXPECT_NE(port, 0);
    ClientOptions client_options;
    client_options.address = absl::StrCat("127.0.0.1:", port);
    client_options.chunk_bytes = 64 << 10;
    auto client = ShardClient::Connect(client_options);
    EXPECT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    ShmOptions trainer;
    trainer.poll_interval = absl::Milliseconds(50);
    auto transport = CreateShmTransport(client_.get(), trainer);
    EXPECT_TRUE(transport.ok()) << transport.status();
    shm_ = *std::move(transport);
    rng_.seed(std::random_device()());
  }
  ~ShmTransportTest() override {
    shm_.reset();
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
  }

  // Creates `job` with two ranges and the same master weights for every job.
  void CreateJob(const std::string& job) {
    v1::CreateJobRequest r;
    r.set_job_id(job);
    r.add_ranges()->set_length(kLen0);
    v1::ParamRange* b = r.add_ranges();
    b->set_offset(kLen0);
    b->set_length(kLen1);
    *r.mutable_adam() = TestAdamW();
    r.set_param_dtype(v1::DTYPE_BF16);
    ASSERT_TRUE(client_->CreateJob(r).ok());
    if (weights_.empty()) weights_ = Random(kLen0 + kLen1, 1.0f);
    ASSERT_TRUE(
        client_->LoadState(job, v1::STATE_TENSOR_MASTER_WEIGHTS, 0, weights_.data(), kLen0 + kLen1)
            .ok());
  }

  std::vector<float> Random(int64_t n, float scale) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng_);
    return v;
  }
  std::vector<uint16_t> Bf16(const std::vector<float>& f) {
    std::vector<uint16_t> h(f.size());
    for (size_t i = 0; i < f.size(); ++i) h[i] = FloatToBf16(f[i]);
    return h;
  }

  std::string State(const std::string& job) {
    std::string all;
    for (v1::StateTensor t :
         {v1::STATE_TENSOR_MASTER_WEIGHTS, v1::STATE_TENSOR_EXP_AVG, v1::STATE_TENSOR_EXP_AVG_SQ}) {
      std::string bytes((kLen0 + kLen1) * 4, '\0');
      EXPECT_TRUE(client_->ReadState(job, t, DType::kFp32, 0, kLen0 + kLen1, bytes.data()).ok());
      all += bytes;
    }
    return all;
  }

  // One step of range 0: micro-batch `a` (bf16, in place), then optionally `b` accumulated
  // (fp32, through the slots).
  absl::StatusOr<v1::StepResult> Step(StepTransport* t, const std::string& job, uint64_t step,
                                      const std::vector<uint16_t>& a, const std::vector<float>* b,
                                      std::vector<uint16_t>* params) {
    auto stream = t->OpenStep(job, 0, 0, kLen0, step);
    if (!stream.ok()) return stream.status();
    // Two calls, so the range arrives as two in-place pieces.
    if (auto s = (*stream)->SendGradients(0, a.data(), DType::kBf16, 1000); !s.ok()) return s;
    if (auto s = (*stream)->SendGradients(1000, a.data() + 1000, DType::kBf16, kLen0 - 1000);
        !s.ok()) {
      return s;
    }
    if (b != nullptr) {
      if (auto s = (*stream)->SendGradients(0, b->data(), DType::kFp32, kLen0, true); !s.ok()) {
        return s;
      }
    }
    params->assign(kLen0, 0);
    return (*stream)->Commit(1e-3f, 0.5f, false, params->data());
  }

  ThreadPool pool_;
  std::unique_ptr<ShardStore> store_;
  std::unique_ptr<DataPlaneServer> shm_server_;
  std::unique_ptr<OptimizerService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<ShardClient> client_;
  std::unique_ptr<StepTransport> shm_;
  std::mt19937 rng_;
  std::vector<float> weights_;
};

// A raw trainer's first step on an Attach stream: the shm AttachOpen for `job`, and the offer.
void OpenRaw(grpc::ClientReaderWriter<v1::AttachRequest, v1::AttachResponse>* stream,
             const std::string& job, v1::AttachResponse* offer) {
  v1::AttachRequest request;
  request.mutable_open()->set_job_id(job);
  request.mutable_open()->set_plane(v1::DATA_PLANE_SHM);
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(stream->Read(offer));
  ASSERT_TRUE(offer->has_shm());
}

TEST_F(ShmTransportTest, StepsMatchGrpcBitForBit) {
  CreateJob("via-grpc");
  CreateJob("via-shm");
  for (uint64_t step = 1; step <= 3; ++step) {
    const std::vector<uint16_t> g = Bf16(Random(kLen0, 0.1f));
    const std::vector<float> micro = Random(kLen0, 0.1f);
    const std::vector<float>* b = step == 2 ? &micro : nullptr;  // step 2 accumulates
    std::vector<uint16_t> over_grpc, over_shm;
    auto r1 = Step(client_.get(), "via-grpc", step, g, b, &over_grpc);
    ASSERT_TRUE(r1.ok()) << r1.status();
    auto r2 = Step(shm_.get(), "via-shm", step, g, b, &over_shm);
    ASSERT_TRUE(r2.ok()) << r2.status();
    EXPECT_EQ(r1->SerializeAsString(), r2->SerializeAsString());
    EXPECT_TRUE(r2->applied());
    EXPECT_EQ(over_grpc, over_shm) << "step " << step;
  }
  EXPECT_EQ(State("via-grpc"), State("via-shm"));
  // A replay returns the same parameters without applying anything.
  const std::vector<uint16_t> g = Bf16(Random(kLen0, 0.1f));
  std::vector<uint16_t> first, again;
  ASSERT_TRUE(Step(shm_.get(), "via-shm", 4, g, nullptr, &first).ok());
  auto replay = Step(shm_.get(), "via-shm", 4, g, nullptr, &again);
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_TRUE(replay->replayed());
  EXPECT_EQ(first, again);
  // The attachment's segment was unlinked as soon as the trainer proved it.
  EXPECT_TRUE(OurSegments().empty());
}

TEST_F(ShmTransportTest, ErrorsEndTheStepLikeGrpc) {
  CreateJob("job");
  const std::vector<uint16_t> g = Bf16(Random(kLen0, 0.1f));
  // Out of order.
  auto wrong = shm_->OpenStep("job", 0, 0, kLen0, 5);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition) << wrong.status();
  // Unknown job / range.
  EXPECT_EQ(shm_->OpenStep("nope", 0, 0, kLen0, 1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(shm_->OpenStep("job", 7, 0, kLen0, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  {
    // An overlapping chunk fails the step, at the latest at the commit.
    auto stream = shm_->OpenStep("job", 0, 0, kLen0, 1);
    ASSERT_TRUE(stream.ok()) << stream.status();
    absl::Status s = (*stream)->SendGradients(0, g.data(), DType::kBf16, kLen0);
    if (s.ok()) s = (*stream)->SendGradients(0, g.data(), DType::kBf16, 10);
    std::vector<uint16_t> params(kLen0);
    if (s.ok()) s = (*stream)->Commit(1e-3f, 1.0f, false, params.data()).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "overlaps")) << s;
  }
  {
    // Out of the range: refused without touching the segment.
    auto stream = shm_->OpenStep("job", 0, 0, kLen0, 1);
    ASSERT_TRUE(stream.ok()) << stream.status();
    absl::Status s = (*stream)->SendGradients(kLen0 - 5, g.data(), DType::kBf16, 10);
    std::vector<uint16_t> params(kLen0);
    if (s.ok()) s = (*stream)->Commit(1e-3f, 1.0f, false, params.data()).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  }
  {
    // A missing gradient.
    auto stream = shm_->OpenStep("job", 0, 0, kLen0, 1);
    ASSERT_TRUE(stream.ok()) << stream.status();
    ASSERT_TRUE((*stream)->SendGradients(0, g.data(), DType::kBf16, kLen0 - 1).ok());
    std::vector<uint16_t> params(kLen0);
    auto r = (*stream)->Commit(1e-3f, 1.0f, false, params.data());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  }
  // Skip: no parameters, the step counts.
  auto stream = shm_->OpenStep("job", 0, 0, kLen0, 1);
  ASSERT_TRUE(stream.ok()) << stream.status();
  std::vector<uint16_t> params(kLen0);
  auto r = (*stream)->Commit(1e-3f, 1.0f, true, params.data());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->skipped());
}

TEST_F(ShmTransportTest, AbandonedStreamLeavesTheStepOpenable) {
  CreateJob("job");
  const std::vector<uint16_t> g = Bf16(Random(kLen0, 0.1f));
  const std::string before = State("job");
  {
    auto stream = shm_->OpenStep("job", 0, 0, kLen0, 1);
    ASSERT_TRUE(stream.ok()) << stream.status();
    ASSERT_TRUE((*stream)->SendGradients(0, g.data(), DType::kBf16, kLen0).ok());
    // A second stream on the same attachment while one is in flight is refused.
    EXPECT_EQ(shm_->OpenStep("job", 0, 0, kLen0, 1).status().code(), absl::StatusCode::kAborted);
  }  // destroyed without a commit: ABANDON
  EXPECT_EQ(State("job"), before);
  std::vector<uint16_t> params;
  auto r = Step(shm_.get(), "job", 1, g, nullptr, &params);
  ASSERT_TRUE(r.ok()) << r.status();
}

TEST_F(ShmTransportTest, TrainerDeathDropsTheStepAndTheSegment) {
  CreateJob("job");
  const std::vector<uint16_t> g = Bf16(Random(kLen0, 0.1f));
  const std::string before = State("job");
  {
    // A trainer that attaches, opens step 1, writes gradients and dies (its stream breaks)
    // without ever sending ABANDON.
    grpc::ClientContext context;
    auto stream = client_->Attach(&context);
    v1::AttachResponse offer;
    ASSERT_NO_FATAL_FAILURE(OpenRaw(stream.get(), "job", &offer));
    EXPECT_EQ(OurSegments().size(), 1u);
    auto segment = ShmSegment::Open(offer.shm().segment_name());
    ASSERT_TRUE(segment.ok()) << segment.status();
    v1::AttachRequest request;
    request.mutable_proof()->set_secret(segment->header()->secret, kShmSecretBytes);
    ASSERT_TRUE(stream->Write(request));
    v1::AttachResponse ready;
    ASSERT_TRUE(stream->Read(&ready));
    ASSERT_TRUE(ready.has_ready());
    EXPECT_TRUE(OurSegments().empty());
    ShmHeader* h = segment->header();
    ShmCommand open{};
    open.kind = static_cast<uint32_t>(ShmCommandKind::kOpen);
    open.step = 1;
    h->ring[0] = open;
    h->cmd_head.store(1, std::memory_order_release);
    ShmWake(&h->cmd_head);
    while (h->reply_seq.load(std::memory_order_acquire) != 1) {
      ShmWait(&h->shard_event, h->shard_event.load(), absl::Milliseconds(10));
    }
    ASSERT_EQ(h->reply.code, 0);
    std::memcpy(segment->grad_area(), g.data(), kLen0 * 2);
    context.TryCancel();
    stream->Finish();
  }
  // The shard drops the step as soon as it notices; the next trainer opens the same step.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  absl::StatusOr<v1::StepResult> r;
  std::vector<uint16_t> params;
  do {
    r = Step(shm_.get(), "job", 1, g, nullptr, &params);
  } while (r.status().code() == absl::StatusCode::kAborted &&
           std::chrono::steady_clock::now() < deadline);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->applied());
  EXPECT_NE(State("job"), before);
  EXPECT_TRUE(OurSegments().empty());
}

TEST_F(ShmTransportTest, WrongSecretIsRefusedAndTheSegmentRemoved) {
  CreateJob("job");
  grpc::ClientContext context;
  auto stream = client_->Attach(&context);
  v1::AttachResponse offer;
  ASSERT_NO_FATAL_FAILURE(OpenRaw(stream.get(), "job", &offer));
  const std::vector<std::string> during = OurSegments();
  ASSERT_EQ(during.size(), 1u);
  EXPECT_EQ("/" + during[0], offer.shm().segment_name());
  v1::AttachRequest request;
  request.mutable_proof()->set_secret(std::string(kShmSecretBytes, 'x'));
  stream->Write(request);
  v1::AttachResponse response;
  EXPECT_FALSE(stream->Read(&response));
  const grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_TRUE(OurSegments().empty());
}

TEST_F(ShmTransportTest, ShardDeathDuringCommitIsUnavailable) {
  CreateJob("job");
  const std::vector<uint16_t> g = Bf16(Random(kLen0, 0.1f));
  auto stream = shm_->OpenStep("job", 0, 0, kLen0, 1);
  ASSERT_TRUE(stream.ok()) << stream.status();
  ASSERT_TRUE((*stream)->SendGradients(0, g.data(), DType::kBf16, kLen0).ok());
  // Hold the range's tensors so the shard's commit cannot finish, then stop the server.
  RangeState* range = (*store_->FindJob("job"))->ranges[0].get();
  range->tensors_mu.lock();
  std::vector<uint16_t> params(kLen0);
  const auto start = std::chrono::steady_clock::now();
  auto commit = std::async(std::launch::async, [&] {
    return (*stream)->Commit(1e-3f, 1.0f, false, params.data()).status();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  std::thread shutdown([&] { server_->Shutdown(std::chrono::system_clock::now()); });
  const bool returned = commit.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  range->tensors_mu.unlock();
  shutdown.join();
  ASSERT_TRUE(returned) << "Commit still waits 5 s after the shard went away";
  const absl::Status s = commit.get();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "went away")) << s;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  stream->reset();
  server_.reset();
}

}  // namespace
}  // namespace offload
