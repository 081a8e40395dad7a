#include "base/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace offload {
namespace {

TEST(ThreadPoolTest, DefaultUsesAtLeastOneThread) {
  ThreadPool pool(ThreadPool::Options{});
  EXPECT_GE(pool.num_threads(), 1);
}

TEST(ThreadPoolTest, RunCallsFnOncePerWorker) {
  for (int n : {1, 2, 3, 5, 8}) {
    ThreadPool pool(ThreadPool::Options{n, /*pin=*/n % 2 == 0});
    ASSERT_EQ(pool.num_threads(), n);
    std::vector<std::atomic<int>> calls(n);
    for (auto& c : calls) c = 0;
    pool.Run([&](int i) {
      ASSERT_GE(i, 0);
      ASSERT_LT(i, n);
      ++calls[i];
    });
    for (int i = 0; i < n; ++i) EXPECT_EQ(calls[i].load(), 1) << "worker " << i << " of " << n;
  }
}

// Operators (top -H) and the stall tests (tests/freeze_threads.py) find the workers by name.
TEST(ThreadPoolTest, WorkersCarryThePoolsName) {
  ThreadPool::Options options;
  options.num_threads = 2;
  options.name = "adam";
  ThreadPool pool(options);
  std::vector<std::string> names(2);
  pool.Run([&](int t) {
    char name[16] = {};
    pthread_getname_np(pthread_self(), name, sizeof(name));
    names[t] = name;
  });
  EXPECT_EQ(names[0], "adam-0");
  EXPECT_EQ(names[1], "adam-1");
}

// The default takes every core of the process's affinity mask, and pin puts worker i on the
// i-th of them: a trainer or server limited by its cgroup's cpuset uses exactly what it may.
TEST(ThreadPoolTest, PinnedWorkersEachRunOnTheirOwnAllowedCore) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  }
  ThreadPool pool(ThreadPool::Options{0, /*pin=*/true});
  ASSERT_EQ(pool.num_threads(), static_cast<int>(cpus.size()));
  std::vector<std::vector<int>> seen(pool.num_threads());
  pool.Run([&](int i) {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (pthread_getaffinity_np(pthread_self(), sizeof(set), &set) != 0) return;
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) seen[i].push_back(c);
    }
  });
  for (int i = 0; i < pool.num_threads(); ++i) {
    EXPECT_EQ(seen[i], std::vector<int>{cpus[i]}) << "worker " << i;
  }
}

TEST(ThreadPoolTest, RunAsyncTicketsWaitForEveryWorker) {
  constexpr int kThreads = 3, kRegions = 20;
  ThreadPool pool(ThreadPool::Options{kThreads});
  std::vector<std::atomic<int>> done(kRegions);
  for (auto& d : done) d = 0;
  std::vector<ThreadPool::Ticket> tickets;
  for (int r = 0; r < kRegions; ++r) {
    tickets.push_back(pool.RunAsync([&done, r](int i) {
      // Late workers: Wait() must not return before the slowest one is done.
      if (i == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      ++done[r];
    }));
    EXPECT_TRUE(tickets.back().valid());
  }
  for (int r = kRegions - 1; r >= 0; --r) {
    tickets[r].Wait();
    EXPECT_EQ(done[r].load(), kThreads) << "region " << r;
  }
  ThreadPool::Ticket empty;
  EXPECT_FALSE(empty.valid());
  empty.Wait();  // returns at once
}

TEST(ThreadPoolTest, RegionsRunInSubmissionOrderOnEveryWorker) {
  constexpr int kThreads = 4, kRegions = 50;
  ThreadPool pool(ThreadPool::Options{kThreads});
  std::vector<std::vector<int>> order(kThreads);  // each worker writes only its own vector
  std::vector<ThreadPool::Ticket> tickets;
  for (int r = 0; r < kRegions; ++r) {
    tickets.push_back(pool.RunAsync([&order, r](int i) { order[i].push_back(r); }));
  }
  for (auto& t : tickets) t.Wait();
  for (int i = 0; i < kThreads; ++i) {
    ASSERT_EQ(order[i].size(), static_cast<size_t>(kRegions));
    for (int r = 0; r < kRegions; ++r) EXPECT_EQ(order[i][r], r) << "worker " << i;
  }
}

TEST(ThreadPoolTest, RegionsFromSeveralSubmittersAllComplete) {
  static constexpr int kThreads = 3, kSubmitters = 4, kPerSubmitter = 100;
  ThreadPool pool(ThreadPool::Options{kThreads});
  std::atomic<int64_t> calls{0};
  std::vector<std::thread> submitters;
  for (int s = 0; s < kSubmitters; ++s) {
    submitters.emplace_back([&pool, &calls, s] {
      std::vector<ThreadPool::Ticket> pending;
      for (int k = 0; k < kPerSubmitter; ++k) {
        std::atomic<int> mine{0};
        if ((k + s) % 2 == 0) {
          pool.Run([&](int) {
            ++mine;
            ++calls;
          });
          // Run returned: this region is complete on every worker.
          EXPECT_EQ(mine.load(), kThreads);
        } else {
          pending.push_back(pool.RunAsync([&calls](int) { ++calls; }));
        }
      }
      for (auto& t : pending) t.Wait();
    });
  }
  for (auto& t : submitters) t.join();
  EXPECT_EQ(calls.load(), int64_t{kThreads} * kSubmitters * kPerSubmitter);
}

TEST(ThreadPoolTest, DestructorFinishesQueuedRegions) {
  std::atomic<int> calls{0};
  {
    ThreadPool pool(ThreadPool::Options{2});
    for (int r = 0; r < 10; ++r) pool.RunAsync([&calls](int) { ++calls; });
  }
  EXPECT_EQ(calls.load(), 20);
}

// Every element of [begin, end) is visited exactly once across all thread indices, pieces come in
// increasing order, never cross a tile boundary, cover their tile's share of the range, and
// belong to the thread (tile index) % num_threads.
void CheckOwnedTiles(int64_t begin, int64_t end, int num_threads) {
  SCOPED_TRACE(testing::Message() << "begin=" << begin << " end=" << end
                                  << " threads=" << num_threads);
  std::vector<int> visits(static_cast<size_t>(std::max<int64_t>(0, end - begin)), 0);
  for (int t = 0; t < num_threads; ++t) {
    int64_t last_hi = begin;
    ForEachOwnedTile(begin, end, t, num_threads, [&](int64_t lo, int64_t hi) {
      ASSERT_LT(lo, hi);
      ASSERT_GE(lo, last_hi) << "pieces out of order";
      last_hi = hi;
      ASSERT_GE(lo, begin);
      ASSERT_LE(hi, end);
      const int64_t tile = lo / kTileElements;
      ASSERT_EQ((hi - 1) / kTileElements, tile) << "piece crosses a tile boundary";
      ASSERT_EQ(tile % num_threads, t) << "tile " << tile << " owned by the wrong thread";
      ASSERT_EQ(lo, std::max(begin, tile * kTileElements));
      ASSERT_EQ(hi, std::min(end, (tile + 1) * kTileElements));
      for (int64_t i = lo; i < hi; ++i) ++visits[i - begin];
    });
  }
  for (size_t i = 0; i < visits.size(); ++i) {
    ASSERT_EQ(visits[i], 1) << "element " << begin + static_cast<int64_t>(i);
  }
}

TEST(ForEachOwnedTileTest, CoversRangeExactlyOnceWithOwnership) {
  const int64_t k = kTileElements;
  const std::vector<int64_t> begins = {0, 1, 7, k - 1, k, k + 1, 3 * k + 5, 100001};
  const std::vector<int64_t> lengths = {0, 1, 2, k - 1, k, k + 1, 2 * k, 5 * k + 7, 100003};
  for (int threads : {1, 2, 3, 4, 7}) {
    for (int64_t b : begins) {
      for (int64_t len : lengths) CheckOwnedTiles(b, b + len, threads);
    }
  }
}

TEST(ForEachOwnedTileTest, EmptyOrReversedRangeCallsNothing) {
  int calls = 0;
  ForEachOwnedTile(10, 10, 0, 2, [&](int64_t, int64_t) { ++calls; });
  ForEachOwnedTile(10, 5, 0, 2, [&](int64_t, int64_t) { ++calls; });
  EXPECT_EQ(calls, 0);
}

// The point of the rule: a worker touches the same pages whatever sub-range a pass covers.
TEST(ForEachOwnedTileTest, SubRangeOwnershipAgreesWithFullRange) {
  constexpr int kThreads = 3;
  const int64_t n = 9 * kTileElements + 123;
  std::vector<int> owner(n, -1);
  for (int t = 0; t < kThreads; ++t) {
    ForEachOwnedTile(0, n, t, kThreads, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) owner[i] = t;
    });
  }
  const int64_t lo = kTileElements / 2 + 3, hi = 6 * kTileElements + 17;
  for (int t = 0; t < kThreads; ++t) {
    ForEachOwnedTile(lo, hi, t, kThreads, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) ASSERT_EQ(owner[i], t) << "element " << i;
    });
  }
}

TEST(ForEachOwnedTileTest, PoolPassTouchesEveryElementOnce) {
  ThreadPool pool(ThreadPool::Options{3});
  const int64_t n = 4 * kTileElements + 999;
  std::vector<int> visits(n, 0);  // disjoint pieces: no two workers write the same element
  pool.Run([&](int t) {
    ForEachOwnedTile(0, n, t, pool.num_threads(), [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) ++visits[i];
    });
  });
  EXPECT_EQ(std::count(visits.begin(), visits.end(), 1), n);
}

}  // namespace
}  // namespace offload
