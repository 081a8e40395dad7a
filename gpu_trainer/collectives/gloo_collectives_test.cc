// Gloo collectives with ranks as threads of this process, meeting in a shared in-memory store
// (and once in a directory): results against exact sums, aliasing, refused arguments, dead and
// silent peers, a rendezvous nobody else comes to, and forks used beside their parents.
#include "gpu_trainer/collectives/gloo_collectives.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gloo/rendezvous/hash_store.h"
#include "gpu_trainer/collectives/local_collectives.h"

namespace offload {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

// Above 1M elements, so a segment crosses the ring's 256K-element pieces (and a partial one).
constexpr int64_t kLarge = 1'100'003;

// Runs body(rank) on `w` threads at once and waits for all of them.
void RunRanks(int w, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < w; ++r) threads.emplace_back(body, r);
  for (std::thread& t : threads) t.join();
}

GlooOptions Options(int rank, int w, absl::Duration timeout) {
  GlooOptions options;
  options.rank = rank;
  options.world_size = w;
  options.prefix = "job/attempt-0";
  options.timeout = timeout;
  return options;
}

// w ranks over one fresh HashStore; empty if any failed to connect.
std::vector<std::unique_ptr<Collectives>> ConnectRanks(int w,
                                                       absl::Duration timeout = absl::Seconds(20)) {
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  std::vector<absl::StatusOr<std::unique_ptr<Collectives>>> results(w);  // UNKNOWN until run
  RunRanks(w, [&](int r) { results[r] = ConnectGloo(Options(r, w, timeout), store); });
  std::vector<std::unique_ptr<Collectives>> ranks;
  for (auto& result : results) {
    EXPECT_TRUE(result.ok()) << result.status();
    if (!result.ok()) return {};
    ranks.push_back(std::move(*result));
  }
  return ranks;
}

// Multiples of 1/4 in [-32, 32): sums over a few ranks are exact in fp32.
float ExactValue(int rank, int64_t i) {
  return static_cast<float>(((i * 7 + rank * 13) % 256) - 128) * 0.25f;
}

// Values whose fp32 sums round, so the summation order shows in the bits.
float InexactValue(int rank, int64_t i) {
  uint64_t x = static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull + rank * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 29;
  return static_cast<float>(x >> 40) / static_cast<float>(1 << 24) * 3.3f - 1.7f;
}

std::vector<int64_t> Offsets(const std::vector<int64_t>& counts) {
  std::vector<int64_t> offsets(counts.size(), 0);
  for (size_t s = 1; s < counts.size(); ++s) offsets[s] = offsets[s - 1] + counts[s - 1];
  return offsets;
}

// Uneven counts for a world of w, each list with zeros and a segment of kLarge where it fits.
std::vector<std::vector<int64_t>> CountPatterns(int w) {
  switch (w) {
    case 1:
      return {{0}, {5}, {kLarge}};
    case 2:
      return {{0, kLarge}, {kLarge, 3}, {3, 17}, {0, 0}};
    default:
      return {{5, 0, kLarge}, {kLarge, 7, 0}, {1, 2, 3}, {0, 0, 0}};
  }
}

class CollectivesTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    ranks_ = ConnectRanks(GetParam());
    ASSERT_EQ(static_cast<int>(ranks_.size()), GetParam());
  }

  int w() const { return GetParam(); }

  std::vector<std::unique_ptr<Collectives>> ranks_;
};

INSTANTIATE_TEST_SUITE_P(Worlds, CollectivesTest, ::testing::Values(1, 2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat("W", info.param);
                         });

// One rank's share of an exact reduce-scatter, into a separate buffer and then in place.
void ReduceScatterExactOnRank(Collectives& c, const std::vector<int64_t>& counts) {
  const int r = c.rank();
  const int w = c.world_size();
  const std::vector<int64_t> offsets = Offsets(counts);
  const int64_t total = offsets.back() + counts.back();
  std::vector<float> data(total);  // (sum(counts),)
  for (int64_t i = 0; i < total; ++i) data[i] = ExactValue(r, i);
  const std::vector<float> original = data;
  auto expected = [&](int64_t i) {  // element i of segment r, summed over the ranks
    double sum = 0;
    for (int q = 0; q < w; ++q) sum += ExactValue(q, offsets[r] + i);
    return static_cast<float>(sum);
  };

  const int64_t n = counts[r];
  constexpr float kGuard = 12345.0f;
  std::vector<float> out(n + 1, kGuard);  // (counts[r] + 1,): a guard element after the output
  absl::Status s = c.ReduceScatter(data.data(), out.data(), counts);
  ASSERT_TRUE(s.ok()) << s;
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) wrong += out[i] != expected(i);
  EXPECT_EQ(wrong, 0) << "rank " << r << " counts[r] " << n;
  EXPECT_EQ(out[n], kGuard);
  EXPECT_TRUE(data == original) << "data modified, rank " << r;

  // In place: out = data + offset of segment r; the other segments stay as they were.
  s = c.ReduceScatter(data.data(), data.data() + offsets[r], counts);
  ASSERT_TRUE(s.ok()) << s;
  wrong = 0;
  for (int64_t i = 0; i < total; ++i) {
    const bool mine = i >= offsets[r] && i < offsets[r] + n;
    wrong += data[i] != (mine ? expected(i - offsets[r]) : original[i]);
  }
  EXPECT_EQ(wrong, 0) << "in place, rank " << r << " counts[r] " << n;
}

TEST_P(CollectivesTest, ReduceScatterExactSumsUnevenCounts) {
  for (const std::vector<int64_t>& counts : CountPatterns(w())) {
    SCOPED_TRACE(::testing::PrintToString(counts));
    RunRanks(w(), [&](int r) { ReduceScatterExactOnRank(*ranks_[r], counts); });
  }
}

TEST_P(CollectivesTest, ReduceScatterIsDeterministic) {
  const std::vector<int64_t> counts = CountPatterns(w()).front();
  RunRanks(w(), [&](int r) {
    Collectives& c = *ranks_[r];
    const std::vector<int64_t> offsets = Offsets(counts);
    const int64_t total = offsets.back() + counts.back();
    std::vector<float> data(total);
    for (int64_t i = 0; i < total; ++i) data[i] = InexactValue(r, i);
    std::vector<float> first(counts[r]);
    std::vector<float> second(counts[r]);
    ASSERT_TRUE(c.ReduceScatter(data.data(), first.data(), counts).ok());
    ASSERT_TRUE(c.ReduceScatter(data.data(), second.data(), counts).ok());
    EXPECT_TRUE(first.empty() ||
                std::memcmp(first.data(), second.data(), first.size() * sizeof(float)) == 0);
    // Sanity: the fp32 sum is close to the exact one.
    for (int64_t i = 0; i < counts[r]; i += 997) {
      double sum = 0;
      for (int q = 0; q < w(); ++q) sum += InexactValue(q, offsets[r] + i);
      EXPECT_NEAR(first[i], sum, 1e-5) << i;
    }
  });
}

TEST_P(CollectivesTest, AllGather16) {
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1000}, int64_t{300'001}}) {
    SCOPED_TRACE(n);
    RunRanks(w(), [&](int r) {
      Collectives& c = *ranks_[r];
      auto value = [](int rank, int64_t i) {
        return static_cast<uint16_t>((rank * 7919 + i * 31) & 0xffff);
      };
      std::vector<uint16_t> in(n);
      for (int64_t i = 0; i < n; ++i) in[i] = value(r, i);
      std::vector<uint16_t> out(w() * n, 0xdead);  // (W * n,)
      absl::Status s = c.AllGather16(in.data(), out.data(), n);
      ASSERT_TRUE(s.ok()) << s;
      int64_t wrong = 0;
      for (int q = 0; q < w(); ++q) {
        for (int64_t i = 0; i < n; ++i) wrong += out[q * n + i] != value(q, i);
      }
      EXPECT_EQ(wrong, 0);

      // In place: this rank's block already sits at out + rank * n.
      std::vector<uint16_t> shared(w() * n, 0xbeef);  // (W * n,)
      std::copy(in.begin(), in.end(), shared.begin() + r * n);
      s = c.AllGather16(shared.data() + r * n, shared.data(), n);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_TRUE(shared == out);
    });
  }
}

// Uneven pieces of a gathered range for a world of w, each list with zeros (as when a layer's
// range misses some ranks' partitions) and a piece above 256K elements where it fits.
std::vector<std::vector<int64_t>> GatherPatterns(int w) {
  switch (w) {
    case 1:
      return {{0}, {5}, {300'001}};
    case 2:
      return {{3, 0}, {0, 5}, {0, 0}, {1000, 300'001}};
    default:
      return {{3, 0, 5}, {0, 0, 7}, {0, 4, 0}, {0, 0, 0}, {300'001, 2, 0}};
  }
}

// Element i of rank `rank`'s piece, distinct across ranks, pieces and calls.
uint16_t PieceValue(int rank, int64_t i, int salt = 0) {
  return static_cast<uint16_t>((rank * 7919 + i * 31 + salt * 101 + 1) & 0xffff);
}

// One rank's share of an uneven all-gather, into a separate buffer and then in place; true if
// every element came out right.
bool AllGatherV16OnRank(Collectives& c, const std::vector<int64_t>& counts, int salt = 0) {
  const int r = c.rank();
  const std::vector<int64_t> offsets = Offsets(counts);
  const int64_t total = offsets.back() + counts.back();
  std::vector<uint16_t> in(counts[r]);  // (counts[r],)
  for (int64_t i = 0; i < counts[r]; ++i) in[i] = PieceValue(r, i, salt);
  auto wrong_in = [&](const uint16_t* out) {
    int64_t wrong = 0;
    for (size_t q = 0; q < counts.size(); ++q) {
      for (int64_t i = 0; i < counts[q]; ++i) {
        wrong += out[offsets[q] + i] != PieceValue(static_cast<int>(q), i, salt);
      }
    }
    return wrong;
  };

  constexpr uint16_t kGuard = 0xdead;
  std::vector<uint16_t> out(total + 1, kGuard);  // (sum(counts) + 1,): a guard after the output
  absl::Status s = c.AllGatherV16(in.data(), out.data(), counts);
  EXPECT_TRUE(s.ok()) << s;
  int64_t wrong = wrong_in(out.data());
  EXPECT_EQ(wrong, 0) << "rank " << r;
  EXPECT_EQ(out[total], kGuard);

  // In place: this rank's piece already sits at its offset; the rest holds garbage.
  std::vector<uint16_t> shared(total, 0xbeef);  // (sum(counts),)
  std::copy(in.begin(), in.end(), shared.begin() + offsets[r]);
  s = c.AllGatherV16(shared.data() + offsets[r], shared.data(), counts);
  EXPECT_TRUE(s.ok()) << s;
  const int64_t wrong_in_place = wrong_in(shared.data());
  EXPECT_EQ(wrong_in_place, 0) << "in place, rank " << r;
  return s.ok() && wrong == 0 && wrong_in_place == 0 && out[total] == kGuard;
}

TEST_P(CollectivesTest, AllGatherV16UnevenCounts) {
  for (const std::vector<int64_t>& counts : GatherPatterns(w())) {
    SCOPED_TRACE(::testing::PrintToString(counts));
    RunRanks(w(), [&](int r) { AllGatherV16OnRank(*ranks_[r], counts); });
  }
  // Null buffers where nothing is held: a rank without a piece, and an empty range.
  RunRanks(w(), [&](int r) {
    std::vector<int64_t> counts(w(), 2);
    counts[0] = 0;
    std::vector<uint16_t> out(2 * (w() - 1), 0);
    std::vector<uint16_t> in(2, static_cast<uint16_t>(r + 1));
    absl::Status s = ranks_[r]->AllGatherV16(r == 0 ? nullptr : in.data(), out.data(), counts);
    ASSERT_TRUE(s.ok()) << s;
    for (int q = 1; q < w(); ++q) EXPECT_EQ(out[2 * (q - 1)], q + 1);
    s = ranks_[r]->AllGatherV16(nullptr, nullptr, std::vector<int64_t>(w(), 0));
    ASSERT_TRUE(s.ok()) << s;
  });
}

// Each rank gathers on a fork from one thread while another thread reduce-scatters and
// all-reduces on the parent: on one communicator the two threads' calls would pair up
// differently on different ranks and mix or hang.
TEST_P(CollectivesTest, ForkRunsBesideItsParent) {
  std::vector<std::unique_ptr<Collectives>> forks(w());
  RunRanks(w(), [&](int r) {
    absl::StatusOr<std::unique_ptr<Collectives>> fork = ranks_[r]->Fork("gather");
    ASSERT_TRUE(fork.ok()) << fork.status();
    forks[r] = std::move(*fork);
  });
  for (int r = 0; r < w(); ++r) {
    ASSERT_NE(forks[r], nullptr);
    EXPECT_EQ(forks[r]->rank(), r);
    EXPECT_EQ(forks[r]->world_size(), w());
  }
  if (w() > 1) {
    EXPECT_THAT(forks[0]->Describe(), HasSubstr("fork gather"));
  }

  constexpr int kIterations = 50;
  RunRanks(w(), [&](int r) {
    std::thread gathers([&] {
      const std::vector<std::vector<int64_t>> patterns = GatherPatterns(w());
      for (int iter = 0; iter < kIterations; ++iter) {
        std::vector<int64_t> counts = patterns[iter % patterns.size()];
        for (int64_t& c : counts) c = std::min<int64_t>(c, 999);  // small, to stay fast
        if (!AllGatherV16OnRank(*forks[r], counts, iter)) {
          ADD_FAILURE() << "fork gather " << iter << " on rank " << r;
          return;
        }
      }
    });
    Collectives& c = *ranks_[r];
    for (int iter = 0; iter < kIterations; ++iter) {
      std::vector<int64_t> counts(w(), 3);
      counts[iter % w()] = 1;
      ReduceScatterExactOnRank(c, counts);
      double v = r + iter;
      const absl::Status s = c.AllReduce(&v, 1, ReduceOp::kSum);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(v, w() * (w() - 1) / 2.0 + w() * iter);
    }
    gathers.join();
  });

  // A second name forks again; a fork forks too, under names of its own; a repeated name or a
  // bad one is refused by each rank on its own.
  std::vector<std::unique_ptr<Collectives>> more(2 * w());  // (second, fork of the fork) per rank
  RunRanks(w(), [&](int r) {
    EXPECT_EQ(ranks_[r]->Fork("gather").status().code(), absl::StatusCode::kAlreadyExists);
    EXPECT_EQ(ranks_[r]->Fork("").status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(ranks_[r]->Fork("a/b").status().code(), absl::StatusCode::kInvalidArgument);
    absl::StatusOr<std::unique_ptr<Collectives>> second = ranks_[r]->Fork("second");
    ASSERT_TRUE(second.ok()) << second.status();
    absl::StatusOr<std::unique_ptr<Collectives>> inner = forks[r]->Fork("second");
    ASSERT_TRUE(inner.ok()) << inner.status();
    more[2 * r] = std::move(*second);
    more[2 * r + 1] = std::move(*inner);
  });
  RunRanks(w(), [&](int r) {
    for (int k = 0; k < 2; ++k) {
      ASSERT_NE(more[2 * r + k], nullptr);
      std::vector<int64_t> counts(w(), 0);
      counts[w() - 1] = 4;
      EXPECT_TRUE(AllGatherV16OnRank(*more[2 * r + k], counts, k));
    }
    // The parent and the first fork still work.
    EXPECT_TRUE(ranks_[r]->Barrier().ok());
    EXPECT_TRUE(forks[r]->Barrier().ok());
  });
}

TEST_P(CollectivesTest, AllReduceSumAndMax) {
  std::vector<std::vector<double>> sums(w());
  RunRanks(w(), [&](int r) {
    Collectives& c = *ranks_[r];
    constexpr int kN = 5;
    double values[kN];
    for (int j = 0; j < kN; ++j) values[j] = r + 0.5 * j;
    ASSERT_TRUE(c.AllReduce(values, kN, ReduceOp::kSum).ok());
    for (int j = 0; j < kN; ++j) EXPECT_EQ(values[j], w() * (w() - 1) / 2 + w() * 0.5 * j);

    for (int j = 0; j < kN; ++j) values[j] = (j % w() == r) ? 100.0 + j : -1.0 * j;
    ASSERT_TRUE(c.AllReduce(values, kN, ReduceOp::kMax).ok());
    for (int j = 0; j < kN; ++j) EXPECT_EQ(values[j], 100.0 + j);

    // Sums that round: every rank must end with the same bits.
    sums[r].resize(3);
    for (int j = 0; j < 3; ++j) sums[r][j] = 0.1 * (r + 1) + 1e-17 * j;
    ASSERT_TRUE(c.AllReduce(sums[r].data(), 3, ReduceOp::kSum).ok());
    ASSERT_TRUE(c.AllReduce(nullptr, 0, ReduceOp::kMax).ok());
  });
  for (int r = 1; r < w(); ++r) {
    EXPECT_EQ(std::memcmp(sums[r].data(), sums[0].data(), 3 * sizeof(double)), 0) << r;
  }
}

TEST_P(CollectivesTest, BroadcastFromLastRank) {
  const int root = w() - 1;  // not 0 when there are peers
  constexpr int64_t kBytes = 1001;
  RunRanks(w(), [&](int r) {
    std::vector<uint8_t> buffer(kBytes, 0);
    if (r == root) {
      for (int64_t i = 0; i < kBytes; ++i) buffer[i] = static_cast<uint8_t>(i * 13 + 5);
    }
    absl::Status s = ranks_[r]->Broadcast(buffer.data(), kBytes, root);
    ASSERT_TRUE(s.ok()) << s;
    int64_t wrong = 0;
    for (int64_t i = 0; i < kBytes; ++i) wrong += buffer[i] != static_cast<uint8_t>(i * 13 + 5);
    EXPECT_EQ(wrong, 0) << "rank " << r;
    EXPECT_TRUE(ranks_[r]->Broadcast(nullptr, 0, root).ok());
  });
}

TEST_P(CollectivesTest, BarrierWaitsForTheLastRank) {
  std::atomic<bool> last_arrived{false};
  RunRanks(w(), [&](int r) {
    if (r == w() - 1) {
      absl::SleepFor(absl::Milliseconds(200));
      last_arrived = true;
    }
    absl::Status s = ranks_[r]->Barrier();
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_TRUE(last_arrived) << "rank " << r << " left the barrier early";
  });
}

// Different operations back to back, many times: their tags keep them apart.
TEST_P(CollectivesTest, ManyOperationsInARow) {
  RunRanks(w(), [&](int r) {
    Collectives& c = *ranks_[r];
    for (int iter = 0; iter < 30; ++iter) {
      double v = r + iter;
      ASSERT_TRUE(c.AllReduce(&v, 1, ReduceOp::kSum).ok());
      EXPECT_EQ(v, w() * (w() - 1) / 2.0 + w() * iter);
      std::vector<int64_t> counts(w(), 3);
      counts[iter % w()] = 0;
      std::vector<float> data(3 * (w() - 1), static_cast<float>(r + iter));
      std::vector<float> out(3, -1.0f);
      ASSERT_TRUE(c.ReduceScatter(data.data(), out.data(), counts).ok());
      if (counts[r] > 0) {
        EXPECT_EQ(out[0], w() * (w() - 1) / 2.0f + w() * iter);
      }
      uint16_t mine = static_cast<uint16_t>(r * 100 + iter);
      std::vector<uint16_t> all(w());
      ASSERT_TRUE(c.AllGather16(&mine, all.data(), 1).ok());
      for (int q = 0; q < w(); ++q) EXPECT_EQ(all[q], q * 100 + iter);
      int root = iter % w();
      int64_t token = r == root ? 1000 + iter : -1;
      ASSERT_TRUE(c.Broadcast(&token, sizeof(token), root).ok());
      EXPECT_EQ(token, 1000 + iter);
      ASSERT_TRUE(c.Barrier().ok());
    }
  });
}

// Only rank 0 makes the bad calls while the others go straight on: had a refused call sent
// anything, the valid collectives after it would mix or hang.
TEST_P(CollectivesTest, BadArgumentsRefusedWithoutCommunicating) {
  RunRanks(w(), [&](int r) {
    Collectives& c = *ranks_[r];
    if (r == 0) {
      std::vector<float> data(10, 1.0f);
      std::vector<int64_t> too_many(w() + 1, 1);
      std::vector<int64_t> negative(w(), 1);
      negative[w() - 1] = -1;
      std::vector<int64_t> fine(w(), 2);
      std::vector<uint16_t> gathered(2 * w());
      std::vector<uint16_t> pieces(2 * w());  // (sum(fine),)
      double v = 0;
      uint8_t byte = 0;
      const absl::Status refused[] = {
          c.ReduceScatter(data.data(), data.data() + 5, too_many),
          c.ReduceScatter(data.data(), data.data() + 5, negative),
          c.ReduceScatter(nullptr, data.data(), fine),
          // Overlaps data, but not exactly at segment 0.
          c.ReduceScatter(data.data(), data.data() + 1, fine),
          c.AllGather16(gathered.data(), gathered.data(), -1),
          c.AllGather16(nullptr, gathered.data(), 2),
          // in overlaps out but is not out + rank * n.
          c.AllGather16(gathered.data() + 1, gathered.data(), 2),
          c.AllReduce(&v, -1, ReduceOp::kSum),
          c.AllReduce(nullptr, 1, ReduceOp::kSum),
          c.AllReduce(&v, 1, static_cast<ReduceOp>(7)),
          c.Broadcast(&byte, 1, w()),
          c.Broadcast(&byte, 1, -1),
          c.Broadcast(&byte, -1, 0),
          c.Broadcast(nullptr, 1, 0),
          c.AllGatherV16(pieces.data(), pieces.data(), too_many),
          c.AllGatherV16(pieces.data(), pieces.data(), negative),
          c.AllGatherV16(nullptr, pieces.data(), fine),
          c.AllGatherV16(pieces.data(), nullptr, fine),
          // in overlaps out but is not out + offset of segment 0.
          c.AllGatherV16(pieces.data() + 1, pieces.data(), fine),
          c.Fork("").status(),
          c.Fork("a/b").status(),
      };
      for (const absl::Status& s : refused) {
        EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      }
      EXPECT_THAT(refused[0].message(), HasSubstr("counts"));
      EXPECT_THAT(refused[10].message(), HasSubstr("root"));
      EXPECT_THAT(refused[14].message(), HasSubstr("all_gather_v16: counts"));
      EXPECT_THAT(refused[16].message(), HasSubstr("in is null"));
      EXPECT_THAT(refused[18].message(), HasSubstr("overlaps"));
      EXPECT_THAT(refused[20].message(), HasSubstr("'/'"));
    }
    double v = r + 1;
    absl::Status s = c.AllReduce(&v, 1, ReduceOp::kSum);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(v, w() * (w() + 1) / 2);
    ReduceScatterExactOnRank(c, std::vector<int64_t>(w(), 4));
  });
}

TEST(SingleRankTest, CopiesAndRefuses) {
  std::unique_ptr<Collectives> c = SingleRankCollectives();
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->world_size(), 1);
  EXPECT_FALSE(c->Describe().empty());
  std::vector<float> data = {1, 2, 3};
  std::vector<float> out(3);
  ASSERT_TRUE(c->ReduceScatter(data.data(), out.data(), {3}).ok());
  EXPECT_EQ(out, data);
  EXPECT_EQ(c->ReduceScatter(data.data(), out.data(), {3, 0}).code(),
            absl::StatusCode::kInvalidArgument);
  uint16_t in[2] = {7, 8};
  uint16_t gathered[2] = {0, 0};
  ASSERT_TRUE(c->AllGather16(in, gathered, 2).ok());
  EXPECT_EQ(gathered[1], 8);
  double v = 2.5;
  ASSERT_TRUE(c->AllReduce(&v, 1, ReduceOp::kMax).ok());
  EXPECT_EQ(v, 2.5);
  EXPECT_EQ(c->Broadcast(&v, sizeof(v), 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(c->Barrier().ok());

  uint16_t piece[3] = {1, 2, 3};
  uint16_t range[3] = {0, 0, 0};
  ASSERT_TRUE(c->AllGatherV16(piece, range, {3}).ok());
  EXPECT_EQ(range[2], 3);
  ASSERT_TRUE(c->AllGatherV16(range, range, {3}).ok());  // in place
  EXPECT_EQ(range[0], 1);
  EXPECT_TRUE(c->AllGatherV16(nullptr, nullptr, {0}).ok());
  EXPECT_EQ(c->AllGatherV16(piece, range, {3, 0}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->AllGatherV16(range + 1, range, {2}).code(), absl::StatusCode::kInvalidArgument);

  absl::StatusOr<std::unique_ptr<Collectives>> fork = c->Fork("gather");
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ((*fork)->world_size(), 1);
  ASSERT_TRUE((*fork)->AllGatherV16(piece, range, {3}).ok());
  EXPECT_TRUE((*fork)->Fork("inner").ok());
  EXPECT_EQ(c->Fork("gather").status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(c->Fork("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->Fork("x/y").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(c->Fork("other").ok());
}

TEST(ConnectTest, RefusesBadOptions) {
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  auto refused = [&](GlooOptions options, absl::string_view field) {
    absl::StatusOr<std::unique_ptr<Collectives>> c = ConnectGloo(options, store);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_THAT(c.status().message(), HasSubstr(std::string(field)));
  };
  GlooOptions options = Options(0, 2, absl::Seconds(1));
  options.rank = 2;
  refused(options, "rank");
  options.rank = -1;
  refused(options, "rank");
  options = Options(0, 0, absl::Seconds(1));
  refused(options, "world_size");
  options = Options(0, 2, absl::ZeroDuration());
  refused(options, "timeout");
  options = Options(0, 2, absl::Seconds(1));
  options.hostname = "";
  refused(options, "hostname");
  EXPECT_EQ(ConnectGloo(Options(0, 2, absl::Seconds(1)), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The directory overload: empty, then missing.
  options = Options(0, 2, absl::Seconds(1));
  EXPECT_THAT(ConnectGloo(options).status().message(), HasSubstr("rendezvous"));
  options.rendezvous = "/nonexistent/rendezvous/dir";
  absl::StatusOr<std::unique_ptr<Collectives>> c = ConnectGloo(options);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("rendezvous"));
}

TEST(ConnectTest, FileStoreTwoRanks) {
  std::string dir = (std::filesystem::temp_directory_path() / "gloo_collectives_XXXXXX").string();
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  std::vector<absl::StatusOr<std::unique_ptr<Collectives>>> ranks(2);  // UNKNOWN until run
  RunRanks(2, [&](int r) {
    GlooOptions options = Options(r, 2, absl::Seconds(20));
    options.rendezvous = dir;
    ranks[r] = ConnectGloo(options);
  });
  for (auto& c : ranks) ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT((*ranks[0])->Describe(), HasSubstr("gloo tcp 127.0.0.1"));
  RunRanks(2, [&](int r) {
    double v = 10.0 * (r + 1);
    ASSERT_TRUE((*ranks[r])->AllReduce(&v, 1, ReduceOp::kSum).ok());
    EXPECT_EQ(v, 30.0);
    ReduceScatterExactOnRank(**ranks[r], {kLarge, 9});
  });
  // A fork meets in the same directory under its own prefix (the FileStore refuses any key
  // that already exists, so reusing the parent's would fail).
  std::vector<absl::StatusOr<std::unique_ptr<Collectives>>> forks(2);  // UNKNOWN until run
  RunRanks(2, [&](int r) { forks[r] = (*ranks[r])->Fork("gather"); });
  for (auto& c : forks) ASSERT_TRUE(c.ok()) << c.status();
  RunRanks(2, [&](int r) { EXPECT_TRUE(AllGatherV16OnRank(**forks[r], {0, 7})); });
  std::filesystem::remove_all(dir);
}

// Two jobs of two ranks meet in one store at once; their prefixes keep them apart.
TEST(ConnectTest, PrefixesSeparateJobsInOneStore) {
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  std::vector<absl::StatusOr<std::unique_ptr<Collectives>>> ranks(4);  // job = index / 2
  RunRanks(4, [&](int i) {
    GlooOptions options = Options(i % 2, 2, absl::Seconds(20));
    options.prefix = absl::StrCat("job", i / 2, "/attempt-0");
    ranks[i] = ConnectGloo(options, store);
  });
  for (auto& c : ranks) ASSERT_TRUE(c.ok()) << c.status();
  RunRanks(4, [&](int i) {
    double v = 1 + i;  // job 0 sums 1 + 2, job 1 sums 3 + 4
    ASSERT_TRUE((*ranks[i])->AllReduce(&v, 1, ReduceOp::kSum).ok());
    EXPECT_EQ(v, i / 2 == 0 ? 3.0 : 7.0);
  });
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Rank 1 goes away while rank 0 is in a reduce-scatter: rank 0 fails, fast, and stays failed.
TEST(DeadPeerTest, PeerClosesDuringReduceScatter) {
  std::vector<std::unique_ptr<Collectives>> ranks = ConnectRanks(2, absl::Seconds(2));
  ASSERT_EQ(ranks.size(), 2u);
  const std::vector<int64_t> counts = {kLarge, kLarge};
  std::vector<float> data(2 * kLarge, 1.0f);
  absl::Status status;
  double seconds = 0;
  std::thread rank0([&] {
    const auto start = std::chrono::steady_clock::now();
    status = ranks[0]->ReduceScatter(data.data(), data.data(), counts);
    seconds = SecondsSince(start);
  });
  absl::SleepFor(absl::Milliseconds(300));
  ranks[1].reset();
  rank0.join();
  EXPECT_THAT(status.code(),
              AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded))
      << status;
  EXPECT_THAT(status.message(), HasSubstr("gloo reduce_scatter (rank 0 of 2)"));
  EXPECT_LT(seconds, 10.0);
  std::cerr << "dead peer: " << status << " after " << seconds << " s\n";

  double v = 1;
  absl::Status later = ranks[0]->AllReduce(&v, 1, ReduceOp::kSum);
  EXPECT_EQ(later.code(), absl::StatusCode::kFailedPrecondition) << later;
  EXPECT_THAT(later.message(), HasSubstr(status.message()));
}

// Rank 1 is gone before rank 0 calls.
TEST(DeadPeerTest, PeerAlreadyClosed) {
  std::vector<std::unique_ptr<Collectives>> ranks = ConnectRanks(2, absl::Seconds(2));
  ASSERT_EQ(ranks.size(), 2u);
  ranks[1].reset();
  absl::SleepFor(absl::Milliseconds(100));
  double v = 1;
  const auto start = std::chrono::steady_clock::now();
  absl::Status status = ranks[0]->AllReduce(&v, 1, ReduceOp::kSum);
  const double seconds = SecondsSince(start);
  EXPECT_THAT(status.code(),
              AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded))
      << status;
  EXPECT_LT(seconds, 10.0);
  std::cerr << "closed peer: " << status << " after " << seconds << " s\n";
  std::vector<float> data(2, 1.0f);
  EXPECT_EQ(ranks[0]->ReduceScatter(data.data(), data.data(), {1, 1}).code(),
            absl::StatusCode::kFailedPrecondition);
}

// Rank 1 is alive but never calls: rank 0 times out; then rank 1, which rank 0 gave up on,
// fails at once instead of waiting out its own timeout.
TEST(DeadPeerTest, SilentPeerTimesOut) {
  std::vector<std::unique_ptr<Collectives>> ranks = ConnectRanks(2, absl::Seconds(2));
  ASSERT_EQ(ranks.size(), 2u);
  double v = 1;
  auto start = std::chrono::steady_clock::now();
  absl::Status status = ranks[0]->AllReduce(&v, 1, ReduceOp::kSum);
  double seconds = SecondsSince(start);
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_THAT(status.message(), HasSubstr("gloo all_reduce (rank 0 of 2)"));
  EXPECT_GT(seconds, 1.5);
  EXPECT_LT(seconds, 10.0);
  std::cerr << "silent peer: " << status << " after " << seconds << " s\n";

  start = std::chrono::steady_clock::now();
  absl::Status peer = ranks[1]->AllReduce(&v, 1, ReduceOp::kSum);
  seconds = SecondsSince(start);
  // Usually at once (the connection is closed), at worst at its own timeout: a write to the closed
  // socket may wait for the send to time out rather than fail.
  EXPECT_FALSE(peer.ok());
  EXPECT_LT(seconds, 4.0) << peer;
  std::cerr << "the peer then: " << peer << " after " << seconds << " s\n";
  EXPECT_EQ(ranks[0]->Barrier().code(), absl::StatusCode::kFailedPrecondition);
}

// Rank 0 works for longer than the connect-time timeout before it broadcasts: the others wait
// for it with BroadcastWithin, where a plain Broadcast would have given up.
TEST(SlowRootTest, BroadcastWithinOutlastsTheTimeout) {
  std::vector<std::unique_ptr<Collectives>> ranks = ConnectRanks(2, absl::Seconds(1));
  ASSERT_EQ(ranks.size(), 2u);
  RunRanks(2, [&](int r) {
    int32_t token = r == 0 ? 42 : -1;
    if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    const absl::Status s = ranks[r]->BroadcastWithin(&token, sizeof(token), 0, absl::Seconds(20));
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(token, 42);
  });
  // And the usual timeout still applies to the next call.
  RunRanks(2, [&](int r) { EXPECT_TRUE(ranks[r]->Barrier().ok()); });
}

// Only rank 0 forks: its fork times out, and like any failed call leaves rank 0 unusable.
TEST(DeadPeerTest, ForkWithoutPeerTimesOutAndBreaks) {
  std::vector<std::unique_ptr<Collectives>> ranks = ConnectRanks(2, absl::Seconds(1));
  ASSERT_EQ(ranks.size(), 2u);
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<Collectives>> fork = ranks[0]->Fork("lonely");
  const double seconds = SecondsSince(start);
  ASSERT_FALSE(fork.ok());
  EXPECT_EQ(fork.status().code(), absl::StatusCode::kDeadlineExceeded) << fork.status();
  EXPECT_THAT(fork.status().message(), HasSubstr("gloo fork (rank 0 of 2) \"lonely\""));
  EXPECT_LT(seconds, 5.0);
  std::cerr << "fork without peer: " << fork.status() << " after " << seconds << " s\n";
  EXPECT_EQ(ranks[0]->Barrier().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ranks[0]->Fork("again").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ConnectTest, RendezvousTimesOutWithoutPeer) {
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<Collectives>> c =
      ConnectGloo(Options(0, 2, absl::Seconds(1)), store);
  const double seconds = SecondsSince(start);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded) << c.status();
  EXPECT_THAT(c.status().message(), HasSubstr("gloo rendezvous (rank 0 of 2)"));
  EXPECT_LT(seconds, 5.0);
  std::cerr << "rendezvous: " << c.status() << " after " << seconds << " s\n";
}

// How NCCL's unique id travels: one rank puts it, another thread waits for it; a key nobody puts
// is waited for only as long as asked.
TEST(StoreTest, AValuePutIsAwaitedAndAMissingOneTimesOut) {
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  std::string id(128, '\0');
  for (int i = 0; i < 128; ++i) id[i] = static_cast<char>(i * 7);  // any bytes, zeros among them
  absl::StatusOr<std::string> got;
  std::thread waiter([&] { got = StoreAwait(*store, "job/nccl-id", absl::Seconds(10)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_TRUE(StorePut(*store, "job/nccl-id", id).ok());
  waiter.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, id);
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::string> missing = StoreAwait(*store, "job/never", absl::Milliseconds(300));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kDeadlineExceeded) << missing.status();
  EXPECT_THAT(missing.status().message(), HasSubstr("job/never"));
  EXPECT_LT(SecondsSince(start), 5.0);
}

}  // namespace
}  // namespace offload
