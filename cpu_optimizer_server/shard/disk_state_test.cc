// The disk tier inside the shard: a job whose state lives in state files gives, bit for bit, what
// the same job in memory gives (steps, micro-batches, skips, replays, parameter groups, reads,
// loads and restores), refuses steps once a pass failed part-way until a restore, and is
// accounted against the disk and not the memory limit.
#include <gtest/gtest.h>
#include <unistd.h>

#include <random>
#include <vector>

#include "base/testing/test_util.h"
#include "cpu_optimizer_server/shard/shard_store.h"
#include "cpu_optimizer_server/shard/shard_test_util.h"
#include "cpu_optimizer_server/shard/state_loader.h"
#include "cpu_optimizer_server/shard/step_session.h"

namespace offload {
namespace {

// Two ranges with room between them, each several waves and a tail that is not a whole block.
constexpr int64_t kA = 100, kLenA = 3 * kTileElements + 4321;
constexpr int64_t kB = kA + kLenA + 50, kLenB = kTileElements + 77;
constexpr int64_t kSpan = kB + kLenB - kA;  // flat elements from kA to the end of range B

// One store, in memory or on a disk tier of its own (the smallest ring: 3 slots of one tile).
struct Shard {
  explicit Shard(bool on_disk, int64_t memory_limit = int64_t{64} << 20)
      : pool(ThreadPool::Options{2, false}) {
    ShardOptions options;
    options.memory_limit_bytes = memory_limit;
    options.wave_elements = kTileElements;
    options.state_on_disk = on_disk;
    if (on_disk) {
      DiskTierOptions d;
      d.state_dir = dir.path() + "/state";
      d.wave_elements = kTileElements;
      d.memory_bytes = 3 * kStateTensors * kTileElements * 4;
      auto opened = DiskTier::Open(d);
      EXPECT_TRUE(opened.ok()) << opened.status();
      if (opened.ok()) disk = *std::move(opened);
    }
    store = std::make_unique<ShardStore>(options, &pool, BestSimdPath(), disk.get());
  }
  TempDir dir;
  ThreadPool pool;
  std::unique_ptr<DiskTier> disk;
  std::unique_ptr<ShardStore> store;
};

JobConfig TwoRangesTwoGroups(const std::string& id, DType dtype) {
  JobConfig c;
  c.job_id = id;
  c.ranges = {{kA, kLenA}, {kB, kLenB}};
  c.param_dtype = dtype;
  AdamHyperParams g0, g1;
  g0.lr = 1e-2f;
  g0.weight_decay = 0.1f;
  g1.lr = 3e-3f;
  g1.beta1 = 0.8f;
  g1.adamw = false;
  g1.weight_decay = 0.01f;
  // The cut falls inside range A, off any tile boundary.
  const int64_t cut = kA + 2 * kTileElements + 999;
  c.groups = {{kA, cut - kA, g0}, {cut, kB + kLenB - cut, g1}};
  return c;
}

uint16_t To16(float f, DType dtype) {
  return dtype == DType::kFp16 ? FloatToFp16(f) : FloatToBf16(f);
}

// Everything a job's client sees over a scripted run: every 16-bit parameter streamed back, every
// outcome's counters, and the final state read back in fp32.
struct Record {
  std::vector<uint16_t> params;
  std::vector<uint64_t> counters;
  std::string master, exp_avg, exp_avg_sq, master16;
  std::vector<std::string> errors;
};

absl::Status Step(ShardStore* store, const std::string& job, uint64_t step, DType dtype,
                  const std::vector<std::vector<uint16_t>>& micro_batches, StepCommitArgs args,
                  Record* record) {
  for (uint32_t r = 0; r < 2; ++r) {
    const int64_t offset = r == 0 ? kA : kB, length = r == 0 ? kLenA : kLenB;
    auto session = StepSession::Open(store, job, r, step);
    if (!session.ok()) return session.status();
    const bool accumulate = micro_batches.size() > 1;
    for (const auto& g : micro_batches) {
      // Two chunks, the second first, as ranks send them in any order.
      const int64_t half = length / 2 + 5;
      const uint16_t* at = g.data() + (offset - kA);
      if (!args.skip) {
        absl::Status s = (*session)->AddGradients(offset + half, dtype, accumulate,
                                                  Bytes(at + half, (length - half) * 2));
        if (s.ok()) s = (*session)->AddGradients(offset, dtype, accumulate, Bytes(at, half * 2));
        if (!s.ok()) return s;
      }
    }
    VectorSink sink(offset, length);
    args.step = step;
    absl::StatusOr<StepOutcome> outcome = (*session)->Commit(args, &sink);
    if (!outcome.ok()) return outcome.status();
    record->params.insert(record->params.end(), sink.out().begin(), sink.out().end());
    record->counters.insert(record->counters.end(),
                            {outcome->adam_step, outcome->skipped_steps, outcome->applied,
                             outcome->replayed, outcome->skipped});
  }
  return absl::OkStatus();
}

std::string ReadAll(ShardStore* store, const std::string& job, StateTensor t, DType dtype,
                    int64_t offset, int64_t length) {
  std::string all;
  absl::Status s = store->ReadState(job, t, dtype, offset, length, 5000,
                                    [&](int64_t, int64_t, const std::string& chunk) {
                                      all += chunk;
                                      return true;
                                    });
  EXPECT_TRUE(s.ok()) << s;
  return all;
}

// Loads `job` from packed values (range A then range B): the master weights and, for a restore,
// both moments and the step counters, in chunks out of order.
absl::Status Load(ShardStore* store, const std::string& job, const std::vector<float>& master,
                  const std::vector<float>* exp_avg, const std::vector<float>* exp_avg_sq,
                  uint64_t completed, uint64_t adam) {
  auto loader = StateLoader::Start(store, job);
  if (!loader.ok()) return loader.status();
  auto add = [&](StateTensor t, const std::vector<float>& v) -> absl::Status {
    // Range B in two chunks, range A in one.
    absl::Status s = (*loader)->AddChunk(t, kB + 10, DType::kFp32,
                                         Bytes(v.data() + kLenA + 10, (kLenB - 10) * 4));
    if (s.ok()) s = (*loader)->AddChunk(t, kA, DType::kFp32, Bytes(v.data(), kLenA * 4));
    if (s.ok()) s = (*loader)->AddChunk(t, kB, DType::kFp32, Bytes(v.data() + kLenA, 10 * 4));
    return s;
  };
  absl::Status s = add(StateTensor::kMasterWeights, master);
  if (s.ok() && exp_avg != nullptr) s = add(StateTensor::kExpAvg, *exp_avg);
  if (s.ok() && exp_avg_sq != nullptr) s = add(StateTensor::kExpAvgSq, *exp_avg_sq);
  if (s.ok() && exp_avg != nullptr) s = (*loader)->SetSteps(completed, adam);
  if (!s.ok()) return s;
  return (*loader)->Apply().status();
}

std::vector<float> Floats(const std::string& bytes) {
  std::vector<float> v(bytes.size() / 4);
  std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

Record Script(ShardStore* store, DType dtype, uint32_t seed) {
  Record rec;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto grads = [&](float scale) {
    std::vector<uint16_t> g(kSpan);
    for (auto& x : g) x = To16(scale * normal(rng), dtype);
    return g;
  };
  std::vector<float> master(kLenA + kLenB);
  for (float& x : master) x = normal(rng);
  EXPECT_TRUE(store->CreateJob(TwoRangesTwoGroups("job", dtype)).ok());
  EXPECT_TRUE(Load(store, "job", master, nullptr, nullptr, 0, 0).ok());
  auto note = [&](const absl::Status& s) {
    if (!s.ok()) rec.errors.push_back(std::string(s.message()));
  };
  note(Step(store, "job", 1, dtype, {grads(0.5f)}, {0, 1e-2f, 0.5f, false, {}}, &rec));
  // Micro-batches: the fp32 accumulator.
  note(Step(store, "job", 2, dtype, {grads(0.3f), grads(0.7f), grads(0.2f)},
            {0, 1e-2f, 0.25f, false, {}}, &rec));
  note(Step(store, "job", 3, dtype, {}, {0, 1e-2f, 1.f, /*skip=*/true, {}}, &rec));
  // A replay of the last step: reads and converts only.
  note(Step(store, "job", 3, dtype, {}, {0, 1e-2f, 1.f, true, {}}, &rec));
  note(Step(store, "job", 4, dtype, {grads(1.f)}, {0, 0, 1.f, false, {2e-2f, 5e-3f}}, &rec));
  // Range steps: a skipped run across a tile, a t of its own across the group cut, and one run
  // from the end of range A over the gap into range B (each range takes its part).
  const int64_t cut = kA + 2 * kTileElements + 999;
  note(Step(store, "job", 5, dtype, {grads(1.f)},
            {0,
             1e-2f,
             1.f,
             false,
             {},
             {{kA + kTileElements - 7, 3000, 0}, {cut - 50, 100, 1}, {kA + kLenA - 100, 300, 2}}},
            &rec));
  rec.master = ReadAll(store, "job", StateTensor::kMasterWeights, DType::kFp32, kB, kLenB) +
               ReadAll(store, "job", StateTensor::kMasterWeights, DType::kFp32, kA, kLenA);
  rec.exp_avg = ReadAll(store, "job", StateTensor::kExpAvg, DType::kFp32, kA, kLenA) +
                ReadAll(store, "job", StateTensor::kExpAvg, DType::kFp32, kB, kLenB);
  rec.exp_avg_sq = ReadAll(store, "job", StateTensor::kExpAvgSq, DType::kFp32, kA, kLenA) +
                   ReadAll(store, "job", StateTensor::kExpAvgSq, DType::kFp32, kB, kLenB);
  rec.master16 = ReadAll(store, "job", StateTensor::kMasterWeights, dtype, kA, kLenA);

  // A restore onto a second job from what was read (the checkpoint's contents), then a step.
  const std::vector<float> m =
      Floats(rec.master.substr(kLenB * 4) + rec.master.substr(0, kLenB * 4));
  const std::vector<float> a = Floats(rec.exp_avg), v = Floats(rec.exp_avg_sq);
  EXPECT_TRUE(store->CreateJob(TwoRangesTwoGroups("restored", dtype)).ok());
  note(Load(store, "restored", m, &a, &v, 5, 4));
  note(Step(store, "restored", 6, dtype, {grads(0.5f)}, {0, 1e-2f, 1.f, false, {}}, &rec));
  rec.exp_avg_sq += ReadAll(store, "restored", StateTensor::kExpAvgSq, DType::kFp32, kA, kLenA);
  return rec;
}

class DiskStateTest : public ::testing::TestWithParam<DType> {};

TEST_P(DiskStateTest, GivesTheInMemoryShardsBits) {
  const uint32_t seed = std::random_device()();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  Shard memory(false), disk(true);
  ASSERT_NE(disk.disk, nullptr);
  const Record want = Script(memory.store.get(), GetParam(), seed);
  const Record got = Script(disk.store.get(), GetParam(), seed);
  EXPECT_EQ(want.errors, std::vector<std::string>());
  EXPECT_EQ(got.errors, want.errors);
  EXPECT_EQ((*disk.store->FindJob("job"))->config.state_tier, StateTier::kDisk);
  EXPECT_EQ((*memory.store->FindJob("job"))->config.state_tier, StateTier::kMemory);
  ASSERT_EQ(got.params.size(), want.params.size());
  EXPECT_TRUE(got.params == want.params) << "16-bit parameters differ";
  EXPECT_EQ(got.counters, want.counters);
  EXPECT_TRUE(got.master == want.master) << "master weights differ";
  EXPECT_TRUE(got.exp_avg == want.exp_avg) << "exp_avg differs";
  EXPECT_TRUE(got.exp_avg_sq == want.exp_avg_sq) << "exp_avg_sq differs";
  EXPECT_TRUE(got.master16 == want.master16);
  // Only the ring and the accumulator are in memory; the state is in the files.
  EXPECT_EQ((*disk.store->FindJob("job"))->state_reservation.bytes(), 0);
  EXPECT_GT(disk.disk->counters().bytes_written.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, DiskStateTest, ::testing::Values(DType::kFp16, DType::kBf16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

// A bad chunk anywhere fails the whole load, and the files are as they were.
TEST(DiskState, ARefusedLoadChangesNothing) {
  Shard disk(true);
  ASSERT_TRUE(disk.store->CreateJob(TwoRangesTwoGroups("job", DType::kFp16)).ok());
  std::vector<float> master(kLenA + kLenB, 0.25f);
  ASSERT_TRUE(Load(disk.store.get(), "job", master, nullptr, nullptr, 0, 0).ok());
  const std::string before =
      ReadAll(disk.store.get(), "job", StateTensor::kMasterWeights, DType::kFp32, kA, kLenA);
  auto loader = StateLoader::Start(disk.store.get(), "job");
  ASSERT_TRUE(loader.ok());
  std::vector<float> other(kLenA, -1.f);
  ASSERT_TRUE(
      (*loader)
          ->AddChunk(StateTensor::kMasterWeights, kA, DType::kFp32, Bytes(other.data(), kLenA * 4))
          .ok());
  other[7] = NAN;
  EXPECT_EQ((*loader)
                ->AddChunk(StateTensor::kExpAvg, kA, DType::kFp32, Bytes(other.data(), kLenA * 4))
                .code(),
            absl::StatusCode::kInvalidArgument);
  loader->reset();  // abandoned: nothing applied, its staging file gone
  EXPECT_EQ(ReadAll(disk.store.get(), "job", StateTensor::kMasterWeights, DType::kFp32, kA, kLenA),
            before);
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(disk.disk->dir())) {
    files += e.path().extension() == ".state";
  }
  EXPECT_EQ(files, 2);  // the two ranges' files, no staging left behind
}

// A pass that fails part-way (here the state file cut short under the server) fails the step
// naming the file; the range then refuses steps and reads until a full restore, after which it
// steps as the memory shard restored from the same state does.
TEST(DiskState, AFailedPassLosesTheRangeUntilARestore) {
  Shard disk(true), memory(false);
  const DType dtype = DType::kBf16;
  std::vector<float> master(kLenA + kLenB, 0.5f), zeros(kLenA + kLenB, 0.f);
  for (Shard* s : {&disk, &memory}) {
    ASSERT_TRUE(s->store->CreateJob(TwoRangesTwoGroups("job", dtype)).ok());
    ASSERT_TRUE(Load(s->store.get(), "job", master, nullptr, nullptr, 0, 0).ok());
  }
  RangeState* a = (*disk.store->FindJob("job"))->ranges[0].get();
  ASSERT_EQ(::truncate(a->file->path().c_str(), a->file->TensorOffset(1) + kTileElements * 4), 0);
  std::vector<uint16_t> g(kSpan, To16(0.125f, dtype));
  Record rec;
  absl::Status failed =
      Step(disk.store.get(), "job", 1, dtype, {g}, {0, 1e-2f, 1.f, false, {}}, &rec);
  EXPECT_EQ(failed.code(), absl::StatusCode::kDataLoss) << failed;
  EXPECT_NE(failed.message().find(a->file->path()), std::string::npos) << failed;
  EXPECT_NE(failed.message().find("restored from a checkpoint"), std::string::npos) << failed;
  // Lost: steps and reads are refused, saying so.
  absl::Status again =
      Step(disk.store.get(), "job", 1, dtype, {g}, {0, 1e-2f, 1.f, false, {}}, &rec);
  EXPECT_EQ(again.code(), absl::StatusCode::kDataLoss) << again;
  EXPECT_NE(again.message().find("restore it from a checkpoint"), std::string::npos) << again;
  absl::Status read =
      disk.store->ReadState("job", StateTensor::kExpAvg, DType::kFp32, kA, 10, 0,
                            [](int64_t, int64_t, const std::string&) { return true; });
  EXPECT_EQ(read.code(), absl::StatusCode::kDataLoss);
  // A load of the master weights alone does not bring it back.
  ASSERT_TRUE(Load(disk.store.get(), "job", master, nullptr, nullptr, 0, 0).ok());
  EXPECT_EQ(Step(disk.store.get(), "job", 1, dtype, {g}, {0, 1e-2f, 1.f, false, {}}, &rec).code(),
            absl::StatusCode::kDataLoss);
  // Give the file its size back (an operator freeing room), restore all three tensors.
  ASSERT_EQ(::truncate(a->file->path().c_str(), StateFileBytes(kLenA)), 0);
  for (Shard* s : {&disk, &memory}) {
    ASSERT_TRUE(Load(s->store.get(), "job", master, &zeros, &zeros, 0, 0).ok());
  }
  Record want, got;
  ASSERT_TRUE(
      Step(memory.store.get(), "job", 1, dtype, {g}, {0, 1e-2f, 1.f, false, {}}, &want).ok());
  ASSERT_TRUE(Step(disk.store.get(), "job", 1, dtype, {g}, {0, 1e-2f, 1.f, false, {}}, &got).ok());
  EXPECT_TRUE(got.params == want.params);
}

// --memory_limit counts only what is in memory: a job far over it goes to disk (AUTO), and one
// that fits neither is refused naming both figures, with nothing made.
TEST(DiskState, MemoryLimitCountsOnlyMemoryAndRefusalsNameBothFigures) {
  const int64_t limit = int64_t{256} << 10;  // more than "small" needs, less than "big"
  Shard tier(/*on_disk=*/false, limit);      // AUTO, with a disk tier below
  {
    DiskTierOptions d;
    d.state_dir = tier.dir.path() + "/state";
    d.wave_elements = kTileElements;
    d.memory_bytes = 3 * kStateTensors * kTileElements * 4;
    tier.disk = *DiskTier::Open(d);
    ShardOptions options;
    options.memory_limit_bytes = limit;
    options.wave_elements = kTileElements;
    tier.store = std::make_unique<ShardStore>(options, &tier.pool, BestSimdPath(), tier.disk.get());
  }
  JobConfig small = TwoRangesTwoGroups("small", DType::kFp16);
  small.ranges = {{0, 1000}};
  small.groups.clear();
  auto held = tier.store->CreateJob(small);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_GT(*held, 0);  // fits: in memory
  EXPECT_EQ((*tier.store->FindJob("small"))->config.state_tier, StateTier::kMemory);
  auto big = tier.store->CreateJob(TwoRangesTwoGroups("big", DType::kFp16));
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(*big, 0);  // over the limit: on disk, nothing in memory
  EXPECT_EQ((*tier.store->FindJob("big"))->config.state_tier, StateTier::kDisk);
  EXPECT_LT(tier.store->budget()->used(), limit);

  JobConfig memory_only = TwoRangesTwoGroups("memory-only", DType::kFp16);
  memory_only.state_tier = StateTier::kMemory;
  absl::Status refused = tier.store->CreateJob(memory_only).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("byte limit"), std::string::npos) << refused;
  EXPECT_NE(refused.message().find("bytes free"), std::string::npos) << refused;

  JobConfig huge = TwoRangesTwoGroups("huge", DType::kFp16);
  const int64_t free_bytes = tier.disk->FreeBytes();
  huge.ranges = {{0, free_bytes / 8}};  // 12 bytes per element: half again the free space
  huge.groups.clear();
  refused = tier.store->CreateJob(huge).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("on disk"), std::string::npos) << refused;
  EXPECT_NE(refused.message().find("byte limit"), std::string::npos) << refused;
  EXPECT_FALSE(tier.store->FindJob("huge").ok());

  // Without a disk tier, asking for disk is refused.
  Shard plain(false);
  JobConfig on_disk = small;
  on_disk.state_tier = StateTier::kDisk;
  EXPECT_EQ(plain.store->CreateJob(on_disk).status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace offload
