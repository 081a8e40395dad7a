#include "services/spawn/rank_devices.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

TEST(RankDevicesTest, ReadsTheFlagsAsAbslDoesTheLastOneWinning) {
  RankDeviceSettings s = ReadRankDeviceSettings({"--device=cuda", "--collectives", "nccl"});
  EXPECT_TRUE(s.cuda);
  EXPECT_TRUE(s.nccl);
  EXPECT_FALSE(s.cuda_device_given);
  s = ReadRankDeviceSettings({"--device", "cuda", "--device=cpu", "-cuda_device=3"});
  EXPECT_FALSE(s.cuda);
  EXPECT_TRUE(s.cuda_device_given);
  // Other flags that begin alike are not these.
  s = ReadRankDeviceSettings({"--devices=cuda", "--collectives_timeout=nccl", "--cuda_devices=1"});
  EXPECT_FALSE(s.cuda);
  EXPECT_FALSE(s.nccl);
  EXPECT_FALSE(s.cuda_device_given);
}

TEST(RankDevicesTest, EachLocalRankTakesItsOwnGpu) {
  RankDeviceSettings nccl{true, true, false};
  for (int r = 0; r < 8; ++r) {
    absl::StatusOr<std::string> flag = CudaDeviceFlag(nccl, r, 8, 8);
    ASSERT_TRUE(flag.ok()) << flag.status();
    EXPECT_EQ(*flag, "--cuda_device=" + std::to_string(r));
  }
  // Over gloo two ranks may share the one GPU of the lent machines.
  RankDeviceSettings gloo{true, false, false};
  EXPECT_EQ(*CudaDeviceFlag(gloo, 0, 2, 1), "--cuda_device=0");
  EXPECT_EQ(*CudaDeviceFlag(gloo, 1, 2, 1), "--cuda_device=0");
  EXPECT_EQ(*CudaDeviceFlag(gloo, 3, 4, 2), "--cuda_device=1");
  EXPECT_EQ(*CudaDeviceFlag(gloo, 1, 2, 0), "--cuda_device=0");  // the rank says there is none
}

TEST(RankDevicesTest, NothingIsAddedForTheCpuOrAGivenDevice) {
  EXPECT_EQ(*CudaDeviceFlag(RankDeviceSettings{false, false, false}, 1, 2, 0), "");
  EXPECT_EQ(*CudaDeviceFlag(RankDeviceSettings{true, true, true}, 3, 4, 1), "");
}

TEST(RankDevicesTest, MoreNcclRanksThanGpusAreRefusedSayingWhatToDo) {
  absl::StatusOr<std::string> flag = CudaDeviceFlag(RankDeviceSettings{true, true, false}, 0, 2, 1);
  ASSERT_EQ(flag.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(
      flag.status().message(),
      "2 CUDA ranks on this host need one GPU per rank with --collectives=nccl, but 1 is visible: "
      "run at most 1 rank here, or --collectives=gloo, whose ranks stage their gradients on "
      "the host and may share a GPU");
  flag = CudaDeviceFlag(RankDeviceSettings{true, true, false}, 0, 1, 0);
  ASSERT_EQ(flag.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StartsWith(flag.status().message(),
                               "1 CUDA rank on this host needs one GPU per rank with "
                               "--collectives=nccl, but none are visible: run at most 0 ranks"))
      << flag.status();
}

TEST(RankDevicesTest, CountsVisibleGpusAsCudaDoes) {
  const std::string none = "/nonexistent/nvidia/gpus";
  EXPECT_EQ(VisibleGpuCount("0,1,2", none), 3);
  EXPECT_EQ(VisibleGpuCount("GPU-8f2a,MIG-1c3d", none), 2);
  EXPECT_EQ(VisibleGpuCount("1,-1,2", none), 1);  // CUDA stops at the first invalid entry
  EXPECT_EQ(VisibleGpuCount("", none), 0);
  EXPECT_EQ(VisibleGpuCount(nullptr, none), 0);
  // Unset: the driver's entries, one per GPU.
  char dir_template[] = "/tmp/rank_devices_testXXXXXX";
  const std::string dir = mkdtemp(dir_template);
  for (const char* bus : {"0000:17:00.0", "0000:65:00.0"}) {
    ASSERT_EQ(mkdir((dir + "/" + bus).c_str(), 0700), 0);
  }
  EXPECT_EQ(VisibleGpuCount(nullptr, dir), 2);
  EXPECT_EQ(VisibleGpuCount("0", dir), 1);  // the variable wins
  for (const char* bus : {"0000:17:00.0", "0000:65:00.0"}) rmdir((dir + "/" + bus).c_str());
  rmdir(dir.c_str());
}

}  // namespace
}  // namespace offload
