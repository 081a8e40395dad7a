#include "base/watchdog.h"

#include <gtest/gtest.h>

#include <atomic>

#include "absl/time/clock.h"

namespace offload {
namespace {

TEST(WatchdogTest, FiresOnceWhenNotDisarmedInTime) {
  std::atomic<int> fired{0};
  const absl::Time start = absl::Now();
  {
    Watchdog watchdog(absl::Milliseconds(50), [&fired] { ++fired; });
    while (!watchdog.fired()) absl::SleepFor(absl::Milliseconds(5));
    EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));
    EXPECT_FALSE(watchdog.Disarm());  // too late: the phase timed out
  }
  EXPECT_EQ(fired.load(), 1);
}

TEST(WatchdogTest, DisarmedInTimeNeverFires) {
  std::atomic<int> fired{0};
  {
    Watchdog watchdog(absl::Seconds(30), [&fired] { ++fired; });
    EXPECT_TRUE(watchdog.Disarm());
    EXPECT_FALSE(watchdog.fired());
  }  // the destructor returns at once, not after 30 s
  EXPECT_EQ(fired.load(), 0);
}

}  // namespace
}  // namespace offload
