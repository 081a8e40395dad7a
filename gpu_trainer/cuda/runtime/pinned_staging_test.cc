// The pinned staging rings: transfers far larger than the ring arrive intact, in order, with
// callbacks in submission order, and a device-to-host copy waits for the event it is given.
#include "gpu_trainer/cuda/runtime/pinned_staging.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <numeric>
#include <vector>

#include "gpu_trainer/cuda/runtime/cuda_test_util.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

using testing_util::DeviceArray;

TEST(PinnedStaging, RefusesABudgetOfLessThanTwoChunks) {
  // Checked before any CUDA call, so it runs without a GPU too.
  StagingOptions options;
  options.budget_bytes = 4096;
  options.chunk_bytes = 4096;
  EXPECT_EQ(DeviceToHostStaging::Create(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HostToDeviceStaging::Create(options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PinnedStaging, RoundTripsMoreThanTheRingHolds) {
  OFFLOAD_SKIP_WITHOUT_CUDA();
  StagingOptions options;
  options.budget_bytes = 3 * 1000;  // three slots of an odd size: chunks straddle elements
  options.chunk_bytes = 1000;
  auto h2d = HostToDeviceStaging::Create(options);
  auto d2h = DeviceToHostStaging::Create(options);
  ASSERT_TRUE(h2d.ok()) << h2d.status();
  ASSERT_TRUE(d2h.ok()) << d2h.status();

  const int64_t n = 123457;  // int32 values, ~480 KB: hundreds of chunks through three slots
  std::vector<int32_t> source(n);
  std::iota(source.begin(), source.end(), -5000);
  DeviceArray<int32_t> device(n);
  cudaEvent_t arrived;
  ASSERT_EQ(cudaEventCreate(&arrived), cudaSuccess);
  ASSERT_TRUE((*h2d)->Copy(device.get(), source.data(), n * 4, arrived).ok());

  // Three requests out of the same device buffer, each after the upload's event.
  std::vector<int32_t> back(n, 0);
  std::vector<int> order;
  const int64_t cut1 = 1001, cut2 = 77777;
  (*d2h)->Copy(back.data(), device.get(), cut1 * 4, arrived, [&] { order.push_back(0); });
  (*d2h)->Copy(back.data() + cut1, device.get() + cut1, (cut2 - cut1) * 4, arrived,
               [&] { order.push_back(1); });
  (*d2h)->Copy(back.data() + cut2, device.get() + cut2, 0, nullptr, [&] { order.push_back(2); });
  (*d2h)->Copy(back.data() + cut2, device.get() + cut2, (n - cut2) * 4, arrived,
               [&] { order.push_back(3); });
  ASSERT_TRUE((*d2h)->Drain().ok());
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(back, source);
  cudaEventDestroy(arrived);
}

}  // namespace
}  // namespace offload
