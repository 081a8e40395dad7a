#include "cpu_optimizer_server/disk/disk_tier.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <vector>

#include "base/dtype.h"
#include "base/testing/test_util.h"
#include "base/thread_pool.h"
#include "cpu_optimizer_server/disk/io_ring.h"
#include "cpu_optimizer_server/disk/state_file.h"
#include "cpu_optimizer_server/disk/state_pass.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

constexpr int64_t kWave = kTileElements;  // the smallest wave, so small files have many

DiskTierOptions SmallTier(const std::string& dir, int slots) {
  DiskTierOptions o;
  o.state_dir = dir;
  o.wave_elements = kWave;
  o.memory_bytes = slots * kStateTensors * kWave * 4;
  return o;
}

// Element e of tensor t of a file before a pass: distinct everywhere, so a wave read from or
// written to the wrong place shows.
float Before(int t, int64_t e) { return static_cast<float>(t * 1000003 + e); }

TEST(IoRing, ReadsAndWritesComeBackWithTheirTags) {
  TempDir dir;
  const std::string path = dir.path() + "/f";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0600);
  ASSERT_GE(fd, 0);
  std::vector<char> a(8192, 'a'), b(8192);
  auto ring = IoRing::Create(2);
  ASSERT_TRUE(ring.ok()) << ring.status();
  ASSERT_TRUE((*ring)->QueueWrite(fd, a.data(), 8192, 4096, 7).ok());
  ASSERT_TRUE((*ring)->Submit().ok());
  auto c = (*ring)->Wait();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->tag, 7u);
  EXPECT_EQ(c->result, 8192);
  ASSERT_TRUE((*ring)->QueueRead(fd, b.data(), 8192, 4096, 9).ok());
  ASSERT_TRUE((*ring)->QueueRead(fd, b.data(), 4096, 0, 10).ok());
  EXPECT_EQ((*ring)->QueueRead(fd, b.data(), 4096, 0, 11).code(),
            absl::StatusCode::kResourceExhausted);  // depth 2
  ASSERT_TRUE((*ring)->Submit().ok());
  std::vector<uint64_t> tags;
  for (int i = 0; i < 2; ++i) {
    auto done = (*ring)->Wait();
    ASSERT_TRUE(done.ok());
    tags.push_back(done->tag);
    EXPECT_EQ(done->result, done->wanted);
  }
  std::sort(tags.begin(), tags.end());
  EXPECT_EQ(tags, (std::vector<uint64_t>{9, 10}));
  EXPECT_EQ((*ring)->Wait().status().code(), absl::StatusCode::kFailedPrecondition);
  ::close(fd);
}

TEST(StateFile, StartsAsZerosAndReadsWhatWasWritten) {
  TempDir dir;
  const int64_t n = 5000;  // not a whole block of fp32
  auto file = StateFile::Create(dir.path() + "/s", n);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(std::filesystem::file_size(dir.path() + "/s"),
            static_cast<uintmax_t>(StateFileBytes(n)));
  std::vector<float> got(n, -1.f);
  ASSERT_TRUE((*file)->Read(2, 0, n, got.data()).ok());
  EXPECT_EQ(got, std::vector<float>(n, 0.f));
  std::vector<float> values(300);
  for (int i = 0; i < 300; ++i) values[i] = Before(1, i);
  ASSERT_TRUE((*file)->Write(1, 4700, 300, values.data()).ok());
  std::vector<float> back(300);
  ASSERT_TRUE((*file)->Read(1, 4700, 300, back.data()).ok());
  EXPECT_EQ(back, values);
  // The neighbours are untouched.
  ASSERT_TRUE((*file)->Read(2, 0, 300, back.data()).ok());
  EXPECT_EQ(back, std::vector<float>(300, 0.f));
  file->reset();
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/s"));  // scratch: gone with its job
}

// bf16 moments: half the bytes on disk; written fp32 is rounded to nearest even, read back widened
// exactly, at any alignment, and the master weights stay fp32.
TEST(StateFile, Bf16MomentsAreRoundedOnTheWayIn) {
  TempDir dir;
  const int64_t n = 5000;
  auto file = StateFile::Create(dir.path() + "/s", n, /*sparse=*/false, DType::kBf16);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(std::filesystem::file_size(dir.path() + "/s"),
            static_cast<uintmax_t>(StateFileBytes(n, DType::kBf16)));
  EXPECT_LT(StateFileBytes(n, DType::kBf16), StateFileBytes(n));
  std::vector<float> values(299);
  for (int i = 0; i < 299; ++i) values[i] = 1.0f + i * 0.001f + 1e-5f;  // not bf16 values
  for (int t = 0; t < kStateTensors; ++t) {
    ASSERT_TRUE((*file)->Write(t, 4701, 299, values.data()).ok());
  }
  std::vector<float> back(300, -1.f);
  for (int t = 0; t < kStateTensors; ++t) {
    ASSERT_TRUE((*file)->Read(t, 4700, 300, back.data()).ok());
    EXPECT_EQ(back[0], 0.f) << "tensor " << t;  // the neighbour before is untouched
    for (int i = 0; i < 299; ++i) {
      const float want = t == 0 ? values[i] : Bf16ToFloat(FloatToBf16(values[i]));
      ASSERT_EQ(back[i + 1], want) << "tensor " << t << " element " << 4701 + i;
    }
  }
  EXPECT_NE(Bf16ToFloat(FloatToBf16(values[1])), values[1]);  // the rounding was seen
  EXPECT_EQ(StateFile::Create(dir.path() + "/h", n, false, DType::kFp16).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(StateFile, ReadPastATruncatedEndNamesTheFile) {
  TempDir dir;
  const std::string path = dir.path() + "/s";
  auto file = StateFile::Create(path, 4096);
  ASSERT_TRUE(file.ok());
  ASSERT_EQ(::truncate(path.c_str(), 1000), 0);
  std::vector<float> out(4096);
  absl::Status s = (*file)->Read(2, 0, 4096, out.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.message().find(path), std::string::npos) << s;
  EXPECT_NE(s.message().find("exp_avg_sq"), std::string::npos) << s;
}

TEST(DiskTier, RefusesARingOfFewerThanThreeSlots) {
  TempDir dir;
  auto tier = DiskTier::Open(SmallTier(dir.path() + "/state", 2));
  EXPECT_EQ(tier.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(tier.status().message().find("--state_memory_mib"), std::string::npos);
}

TEST(DiskTier, ADeadServersDirectoryGoesAndALiveOnesStays) {
  TempDir dir;
  const std::string root = dir.path() + "/state";
  auto live = DiskTier::Open(SmallTier(root, 3));
  ASSERT_TRUE(live.ok()) << live.status();
  // A server killed with -9: its directory is there, its lock is free.
  const std::string dead = root + "/server-1-2";
  std::filesystem::create_directories(dead);
  { std::ofstream(dead + "/lock") << ""; }
  { std::ofstream(dead + "/job.range-0.state") << "stale"; }
  auto second = DiskTier::Open(SmallTier(root, 3));
  ASSERT_TRUE(second.ok());
  EXPECT_FALSE(std::filesystem::exists(dead));
  EXPECT_TRUE(std::filesystem::exists((*live)->dir()));
  EXPECT_NE((*live)->dir(), (*second)->dir());
  const std::string mine = (*second)->dir();
  second->reset();
  EXPECT_FALSE(std::filesystem::exists(mine));
}

// Servers of one node share the state root and start together (a pool or StatefulSet restart):
// one's sweep of abandoned directories must never take a sibling's directory in the moment
// between its creation and its lock. Each round forks the servers, lets them all open at once,
// and checks, while every one of them still lives, that each one's directory is there.
TEST(DiskTier, ServersOpeningTogetherNeverRemoveEachOther) {
  TempDir dir;
  const std::string root = dir.path() + "/state";
  constexpr int kServers = 8;
  constexpr int kRounds = 150;
  for (int round = 0; round < kRounds; ++round) {
    int start[2], opened[2], check[2];
    ASSERT_EQ(::pipe(start), 0);
    ASSERT_EQ(::pipe(opened), 0);
    ASSERT_EQ(::pipe(check), 0);
    std::vector<pid_t> children;
    for (int i = 0; i < kServers; ++i) {
      const pid_t pid = ::fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) {
        // The child: exit codes say what went wrong (1 open, 2 gone, 3 file), 0 all well.
        ::close(start[1]);
        ::close(opened[0]);
        ::close(check[1]);
        char c;
        (void)!::read(start[0], &c, 1);  // returns when the parent closes its end: all go
        auto tier = DiskTier::Open(SmallTier(root, 3));
        (void)!::write(opened[1], "x", 1);
        (void)!::read(check[0], &c, 1);  // every sibling has opened
        int code = 0;
        if (!tier.ok()) {
          code = 1;
        } else if (!std::filesystem::exists((*tier)->dir())) {
          code = 2;
        } else if (!(*tier)->CreateStateFile("job", 0, kWave, false, DType::kFp32).ok()) {
          code = 3;
        }
        if (tier.ok()) tier->reset();  // _exit runs no destructors: the server's own exit
        ::_exit(code);
      }
      children.push_back(pid);
    }
    ::close(start[0]);
    ::close(opened[1]);
    ::close(check[0]);
    ::close(start[1]);
    char c;
    for (int i = 0; i < kServers; ++i) ASSERT_EQ(::read(opened[0], &c, 1), 1);
    ::close(opened[0]);
    ::close(check[1]);
    for (pid_t pid : children) {
      int status = 0;
      ASSERT_EQ(::waitpid(pid, &status, 0), pid);
      ASSERT_TRUE(WIFEXITED(status));
      EXPECT_EQ(WEXITSTATUS(status), 0)
          << "round " << round << ": "
          << (WEXITSTATUS(status) == 1   ? "a server could not open the tier"
              : WEXITSTATUS(status) == 2 ? "a sibling removed a live server's directory"
                                         : "a server could not make a state file in its directory");
    }
  }
  // Every server closed its tier as it exited; no directory is left behind.
  for (const auto& entry : std::filesystem::directory_iterator(root)) {
    EXPECT_FALSE(entry.is_directory()) << entry.path() << " was left";
  }
}

// A pass over a file of `n` elements with `slots` slots and `moments` moments that adds 1 to every
// master weight, doubles exp_avg and negates exp_avg_sq, wave by wave, holding at most two waves
// at once as a commit does. Checks every element of every tensor afterwards.
void PassUpdatesEveryWaveOnce(int64_t n, int slots, DType moments = DType::kFp32) {
  SCOPED_TRACE(testing::Message() << "n=" << n << " slots=" << slots << " moments "
                                  << DTypeName(moments));
  TempDir dir;
  auto tier = DiskTier::Open(SmallTier(dir.path(), slots));
  ASSERT_TRUE(tier.ok()) << tier.status();
  auto file = (*tier)->CreateStateFile("job", 0, n, /*staging=*/false, moments);
  ASSERT_TRUE(file.ok()) << file.status();
  const bool bf16 = moments == DType::kBf16;
  // What a moment written as fp32 holds: bf16 rounds it to nearest (StateFile::Write).
  auto stored = [bf16](float x) { return bf16 ? Bf16ToFloat(FloatToBf16(x)) : x; };
  // Element i of a wave's moments, in their storage (doubling and negating are exact in both).
  auto get = [bf16](void* m, int64_t i) {
    return bf16 ? Bf16ToFloat(static_cast<uint16_t*>(m)[i]) : static_cast<float*>(m)[i];
  };
  auto set = [bf16](void* m, int64_t i, float x) {
    if (bf16) {
      static_cast<uint16_t*>(m)[i] = FloatToBf16(x);
    } else {
      static_cast<float*>(m)[i] = x;
    }
  };
  std::vector<float> v(n);
  for (int t = 0; t < kStateTensors; ++t) {
    for (int64_t e = 0; e < n; ++e) v[e] = Before(t, e);
    ASSERT_TRUE((*file)->Write(t, 0, n, v.data()).ok());
  }
  {
    StatePass pass(tier->get(), file->get(), /*write_back=*/true);
    ASSERT_EQ(pass.num_waves(), (n + kWave - 1) / kWave);
    for (int64_t w = 0; w <= pass.num_waves(); ++w) {
      if (w < pass.num_waves()) {
        auto wave = pass.Acquire(w);
        ASSERT_TRUE(wave.ok()) << wave.status();
        ASSERT_EQ(wave->lo, w * kWave);
        for (int64_t e = wave->lo; e < wave->hi; ++e) {
          const int64_t i = e - wave->lo;
          ASSERT_EQ(wave->master[i], Before(0, e));
          ASSERT_EQ(get(wave->exp_avg, i), stored(Before(1, e)));
          ASSERT_EQ(get(wave->exp_avg_sq, i), stored(Before(2, e)));
          wave->master[i] += 1;
          set(wave->exp_avg, i, 2 * get(wave->exp_avg, i));
          set(wave->exp_avg_sq, i, -get(wave->exp_avg_sq, i));
        }
      }
      if (w > 0) {
        ASSERT_TRUE(pass.Release(w - 1).ok());
      }
    }
    ASSERT_TRUE(pass.Finish().ok());
    const int64_t bytes = StateFileBytes(n, moments);
    EXPECT_EQ(bytes, StateRegionBytes(n) + 2 * StateRegionBytes(n, bf16 ? 2 : 4));
    EXPECT_EQ(pass.stats().bytes_read, bytes);
    EXPECT_EQ(pass.stats().bytes_written, bytes);
  }
  for (int t = 0; t < kStateTensors; ++t) {
    ASSERT_TRUE((*file)->Read(t, 0, n, v.data()).ok());
    for (int64_t e = 0; e < n; ++e) {
      const float want = t == 0   ? Before(0, e) + 1
                         : t == 1 ? 2 * stored(Before(1, e))
                                  : -stored(Before(2, e));
      ASSERT_EQ(v[e], want) << "tensor " << t << " element " << e;
    }
  }
}

TEST(StatePass, UpdatesEveryWaveOnce) {
  for (DType moments : {DType::kFp32, DType::kBf16}) {
    PassUpdatesEveryWaveOnce(5 * kWave, 3, moments);         // whole waves, the smallest ring
    PassUpdatesEveryWaveOnce(7 * kWave + 333, 4, moments);   // a tail wave, not a whole block
    PassUpdatesEveryWaveOnce(100, 5, moments);               // one wave, smaller than a block
    PassUpdatesEveryWaveOnce(2 * kWave + 1024, 8, moments);  // more slots than waves
  }
}

TEST(StatePass, AReadOnlyPassChangesNothing) {
  TempDir dir;
  auto tier = DiskTier::Open(SmallTier(dir.path(), 3));
  ASSERT_TRUE(tier.ok());
  const int64_t n = 3 * kWave + 17;
  auto file = (*tier)->CreateStateFile("job", 0, n, false);
  ASSERT_TRUE(file.ok());
  std::vector<float> v(n);
  for (int64_t e = 0; e < n; ++e) v[e] = Before(0, e);
  ASSERT_TRUE((*file)->Write(0, 0, n, v.data()).ok());
  StatePass pass(tier->get(), file->get(), /*write_back=*/false);
  for (int64_t w = 0; w < pass.num_waves(); ++w) {
    auto wave = pass.Acquire(w);
    ASSERT_TRUE(wave.ok());
    wave->master[0] = -1;  // never written back
    ASSERT_TRUE(pass.Release(w).ok());
  }
  ASSERT_TRUE(pass.Finish().ok());
  EXPECT_EQ(pass.stats().bytes_written, 0);
  std::vector<float> back(n);
  ASSERT_TRUE((*file)->Read(0, 0, n, back.data()).ok());
  EXPECT_EQ(back, v);
}

TEST(StatePass, ATruncatedFileFailsThePassNamingIt) {
  TempDir dir;
  auto tier = DiskTier::Open(SmallTier(dir.path(), 3));
  ASSERT_TRUE(tier.ok());
  const int64_t n = 6 * kWave;
  auto file = (*tier)->CreateStateFile("job", 0, n, false);
  ASSERT_TRUE(file.ok());
  // Cut inside exp_avg_sq's region: the early waves read whole, a later one comes up short.
  ASSERT_EQ(::truncate((*file)->path().c_str(), (*file)->TensorOffset(2) + 3 * kWave * 4), 0);
  StatePass pass(tier->get(), file->get(), true);
  absl::Status failed;
  for (int64_t w = 0; w <= pass.num_waves() && failed.ok(); ++w) {
    if (w < pass.num_waves()) {
      auto wave = pass.Acquire(w);
      if (!wave.ok()) failed = wave.status();
    }
    if (w > 0 && failed.ok()) failed = pass.Release(w - 1);
  }
  absl::Status finished = pass.Finish();
  EXPECT_EQ(failed.code(), absl::StatusCode::kDataLoss) << failed;
  EXPECT_EQ(finished, failed);
  EXPECT_NE(failed.message().find((*file)->path()), std::string::npos) << failed;
  EXPECT_NE(failed.message().find("exp_avg_sq"), std::string::npos) << failed;
}

TEST(DiskTier, ATooSmallDiskIsRefusedBeforeAnythingIsWritten) {
  TempDir dir;
  auto tier = DiskTier::Open(SmallTier(dir.path(), 3));
  ASSERT_TRUE(tier.ok());
  const int64_t free_bytes = (*tier)->FreeBytes();
  ASSERT_GT(free_bytes, 0);
  // More elements than the disk has room for.
  auto file = (*tier)->CreateStateFile("big", 0, free_bytes / 4, false);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(file.status().message().find("bytes free"), std::string::npos) << file.status();
  EXPECT_FALSE(std::filesystem::exists((*tier)->dir() + "/big.range-0.state"));
}

}  // namespace
}  // namespace offload
