#include "cpu_optimizer_server/stall/stall_monitor.h"

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

TEST(StallMonitor, CancelsOnlyAWaitThatOutlastsItsLimit) {
  StallMonitor monitor(absl::Milliseconds(5));
  grpc::ClientContext waits_too_long, waits_briefly, between_waits;
  StallMonitor::Watch too_long(&waits_too_long), briefly(&waits_briefly), idle(&between_waits);
  monitor.Add(&too_long);
  monitor.Add(&briefly);
  monitor.Add(&idle);
  too_long.Begin(absl::Milliseconds(50));
  briefly.Begin(absl::Seconds(60));
  // idle never waits: a paused trainer holds its stream open without a call in progress.
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (!too_long.fired() && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_TRUE(too_long.fired());
  briefly.End();
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(briefly.fired());
  EXPECT_FALSE(idle.fired());
  monitor.Remove(&too_long);
  monitor.Remove(&briefly);
  monitor.Remove(&idle);
}

TEST(StallMonitor, AWaitThatEndedInTimeIsNeverCancelled) {
  StallMonitor monitor(absl::Milliseconds(5));
  grpc::ClientContext context;
  StallMonitor::Watch watch(&context);
  monitor.Add(&watch);
  for (int i = 0; i < 20; ++i) {
    watch.Begin(absl::Milliseconds(200));
    absl::SleepFor(absl::Milliseconds(2));
    watch.End();
  }
  absl::SleepFor(absl::Milliseconds(300));  // past every limit it was given
  EXPECT_FALSE(watch.fired());
  monitor.Remove(&watch);
}

}  // namespace
}  // namespace offload
