// NCCL collectives (nccl_collectives.h). Without a GPU only the refusals run (a clear error, at
// once); with one GPU every operation runs at W = 1, where each is the identity, on device
// buffers; with two or more GPUs two ranks (threads, a GPU each) check exact sums, uneven pieces
// and that a rank that never comes fails the other within the timeout. W >= 2 needs two GPUs:
// NCCL refuses two ranks on one.
#include "gpu_trainer/cuda/nccl/nccl_collectives.h"

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "gloo/rendezvous/hash_store.h"
#include "gpu_trainer/cuda/runtime/cuda_device.h"
#include "gpu_trainer/cuda/runtime/cuda_test_util.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

template <typename T>
struct Device {
  explicit Device(const std::vector<T>& host) : n(host.size()) {
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, host.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~Device() { cudaFree(p); }
  std::vector<T> Get() const {
    std::vector<T> host(n);
    EXPECT_EQ(cudaMemcpy(host.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
  T* p = nullptr;
  size_t n;
};

int GpuCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

TEST(NcclCollectives, BadOptionsAreRefused) {
  NcclOptions o;
  o.rank = 2;
  o.world_size = 2;
  EXPECT_EQ(ConnectNccl(o, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  o.rank = 1;
  EXPECT_EQ(ConnectNccl(o, nullptr).status().code(), absl::StatusCode::kInvalidArgument)
      << "two ranks and no store";
  o.timeout = absl::ZeroDuration();
  EXPECT_EQ(ConnectNccl(o, std::make_shared<gloo::rendezvous::HashStore>()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(NcclCollectives, WithoutAGpuConnectFailsAtOnceSayingSo) {
  if (CudaDeviceAvailable().ok()) GTEST_SKIP() << "this machine has a GPU";
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<Collectives>> c = ConnectNccl(NcclOptions{}, nullptr);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable) << c.status();
  EXPECT_TRUE(absl::StrContains(c.status().message(), "GPU 0")) << c.status();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 10.0);
}

TEST(NcclCollectives, OneRankEveryOperationIsTheIdentity) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  absl::StatusOr<std::unique_ptr<Collectives>> c = ConnectNccl(NcclOptions{}, nullptr);
  ASSERT_TRUE(c.ok()) << c.status();
  Collectives& nccl = **c;
  EXPECT_EQ(nccl.world_size(), 1);
  Device<float> grads(std::vector<float>{1.5f, -2.0f, 3.25f});
  Device<float> out(std::vector<float>(3, 0.0f));
  ASSERT_TRUE(nccl.ReduceScatter(grads.p, out.p, {3}).ok());
  EXPECT_EQ(out.Get(), (std::vector<float>{1.5f, -2.0f, 3.25f}));
  Device<uint16_t> w(std::vector<uint16_t>{0x3c00, 0x7c00, 0x8001});
  Device<uint16_t> gathered(std::vector<uint16_t>(3, 0));
  ASSERT_TRUE(nccl.AllGather16(w.p, gathered.p, 3).ok());
  EXPECT_EQ(gathered.Get(), (std::vector<uint16_t>{0x3c00, 0x7c00, 0x8001}));
  ASSERT_TRUE(nccl.AllGatherV16(w.p, w.p, {3}).ok());  // in place
  EXPECT_EQ(w.Get(), (std::vector<uint16_t>{0x3c00, 0x7c00, 0x8001}));
  double scalars[3] = {0.25, 7, -1};
  ASSERT_TRUE(nccl.AllReduce(scalars, 3, ReduceOp::kSum).ok());
  EXPECT_EQ(scalars[1], 7);
  std::vector<char> bytes = {'o', 'k'};
  ASSERT_TRUE(nccl.Broadcast(bytes.data(), 2, 0).ok());
  EXPECT_EQ(bytes, (std::vector<char>{'o', 'k'}));
  EXPECT_TRUE(nccl.Barrier().ok());
  EXPECT_EQ(nccl.ReduceScatter(grads.p, out.p, {1, 2}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(nccl.Fork("a/b").status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<Collectives>> fork = nccl.Fork("gather");
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_TRUE((*fork)->Barrier().ok());
  EXPECT_EQ(nccl.Fork("gather").status().code(), absl::StatusCode::kAlreadyExists);
}

// Two ranks, a GPU each: uneven pieces sum exactly (small integers), and a rank that stops
// taking part fails the other within the timeout, after which it refuses everything.
TEST(NcclCollectives, TwoRanksSumUnevenPiecesAndADeadPeerTimesOut) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  if (GpuCount() < 2) GTEST_SKIP() << "needs two GPUs (NCCL refuses two ranks on one)";
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  std::vector<std::vector<float>> reduced(2);
  std::vector<absl::Status> late(2);
  double waited = 0;
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      NcclOptions o;
      o.rank = r;
      o.world_size = 2;
      o.cuda_device = r;
      o.prefix = "test";
      o.timeout = absl::Seconds(2);
      absl::StatusOr<std::unique_ptr<Collectives>> c = ConnectNccl(o, store);
      ASSERT_TRUE(c.ok()) << c.status();
      // Elements 0..4: 3 belong to rank 0, 2 to rank 1; rank r holds (r + 1) * (i + 1).
      std::vector<float> mine(5);
      for (int i = 0; i < 5; ++i) mine[i] = static_cast<float>((r + 1) * (i + 1));
      Device<float> data(mine);
      Device<float> out(std::vector<float>(r == 0 ? 3 : 2, 0.0f));
      ASSERT_TRUE((*c)->ReduceScatter(data.p, out.p, {3, 2}).ok());
      reduced[r] = out.Get();
      if (r == 1) return;  // rank 1 leaves; rank 0's next call must not hang
      const auto start = std::chrono::steady_clock::now();
      double x = 1;
      late[0] = (*c)->AllReduce(&x, 1, ReduceOp::kSum);
      waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      late[1] = (*c)->Barrier();
    });
  }
  for (std::thread& t : ranks) t.join();
  EXPECT_EQ(reduced[0], (std::vector<float>{3, 6, 9}));
  EXPECT_EQ(reduced[1], (std::vector<float>{12, 15}));
  EXPECT_FALSE(late[0].ok());
  EXPECT_LT(waited, 10.0) << late[0];
  EXPECT_EQ(late[1].code(), absl::StatusCode::kFailedPrecondition) << late[1];
}

}  // namespace
}  // namespace offload
