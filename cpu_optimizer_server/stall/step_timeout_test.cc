#include "cpu_optimizer_server/stall/step_timeout.h"

#include "gtest/gtest.h"

namespace offload {
namespace {

StepTimeoutOptions Options(absl::Duration floor) {
  StepTimeoutOptions o;
  o.call_timeout = absl::Minutes(10);
  o.floor = floor;
  o.multiple = 10;
  return o;
}

TEST(StepTimeout, IsTheCallTimeoutUntilStepsWereMeasured) {
  StepTimeout timeout(Options(absl::Seconds(2)));
  EXPECT_EQ(timeout.Get(), absl::Minutes(10));
  for (int i = 1; i < StepTimeout::kMinSteps; ++i) {
    timeout.Record(absl::Seconds(1));
    EXPECT_EQ(timeout.Get(), absl::Minutes(10)) << i << " steps";
  }
  timeout.Record(absl::Seconds(1));
  EXPECT_EQ(timeout.Get(), absl::Seconds(10));
}

TEST(StepTimeout, StaysWithinTheFloorAndTheCallTimeout) {
  StepTimeout fast(Options(absl::Seconds(60)));
  StepTimeout slow(Options(absl::Seconds(60)));
  for (int i = 0; i < StepTimeout::kMinSteps; ++i) {
    fast.Record(absl::Milliseconds(20));
    slow.Record(absl::Minutes(5));
  }
  EXPECT_EQ(fast.Get(), absl::Seconds(60));
  EXPECT_EQ(slow.Get(), absl::Minutes(10));
}

TEST(StepTimeout, FollowsTheMedianOfTheRecentSteps) {
  StepTimeout timeout(Options(absl::Seconds(1)));
  // One slow step among fast ones does not move it.
  for (int i = 0; i < 4; ++i) timeout.Record(absl::Milliseconds(200));
  timeout.Record(absl::Seconds(50));
  EXPECT_EQ(timeout.Get(), absl::Seconds(2));
  // Steps that became slower do, once they are most of the window.
  for (int i = 0; i < StepTimeout::kWindow / 2 + 1; ++i) timeout.Record(absl::Seconds(3));
  EXPECT_EQ(timeout.Get(), absl::Seconds(30));
  // Older steps leave the window.
  for (int i = 0; i < StepTimeout::kWindow; ++i) timeout.Record(absl::Milliseconds(500));
  EXPECT_EQ(timeout.Get(), absl::Seconds(5));
}

TEST(StepTimeout, SaysWhereItsBoundCameFrom) {
  StepTimeout timeout(Options(absl::Seconds(1)));
  EXPECT_EQ(timeout.Describe(absl::Minutes(10)), "no answer within 10m (the call timeout)");
  for (int i = 0; i < StepTimeout::kMinSteps; ++i) timeout.Record(absl::Milliseconds(300));
  EXPECT_EQ(timeout.Describe(timeout.Get()),
            "no answer within 3s (10x the median step of 300ms, at least 1s, at most 10m)");
}

}  // namespace
}  // namespace offload
