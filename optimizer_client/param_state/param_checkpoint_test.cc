// Checkpoints by parameter name: saved from one layout of the flat space and loaded onto others
// (shard and rank counts) to the same bits, through both backends; and every refusal leaves the
// servers' state as it was.
#include "optimizer_client/param_state/param_checkpoint.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/splitmix64.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"
#include "cpu_optimizer_server/grpc/service_test_util.h"
#include "gtest/gtest.h"
#include "model_spec/partition.h"
#include "optimizer_client/backends/inprocess_optimizer.h"
#include "optimizer_client/backends/local_shards_test_util.h"
#include "optimizer_client/backends/remote_optimizer.h"
#include "optimizer_client/backends/state_load.h"
#include "optimizer_client/checkpoint/test_util.h"

namespace offload {
namespace {

constexpr char kJob[] = "param-state-test";
constexpr v1::StateTensor kTensors[] = {v1::STATE_TENSOR_MASTER_WEIGHTS, v1::STATE_TENSOR_EXP_AVG,
                                        v1::STATE_TENSOR_EXP_AVG_SQ};

// Three parameters of odd sizes laid out back to back, as a front end lays out a model.
std::vector<NamedParam> Params(int64_t* num_params) {
  std::vector<NamedParam> params = {
      {"emb.weight", {37, 24}, 0}, {"fc.weight", {53, 24}, 0}, {"fc.bias", {53}, 0}};
  int64_t offset = 0;
  for (NamedParam& p : params) {
    p.offset = offset;
    offset += p.numel();
  }
  *num_params = offset;
  return params;
}

v1::PartitionMap Map(int64_t num_params, int world, int shards) {
  absl::StatusOr<v1::PartitionMap> map = MakePartitionMap(num_params, world, shards);
  EXPECT_TRUE(map.ok()) << map.status();
  return *map;
}

std::unique_ptr<InProcessOptimizer> Job(const v1::PartitionMap& map) {
  auto backend = std::make_unique<InProcessOptimizer>(map, 1, BestSimdPath());
  absl::Status created = backend->CreateJob(kJob, TestAdamW(), DType::kBf16);
  EXPECT_TRUE(created.ok()) << created;
  return backend;
}

// Seeded state in every tensor (exp_avg_sq non-negative), streamed in with counters 7/6.
void FillState(OptimizerBackend* backend, int64_t num_params) {
  const StepCounters counters{7, 6};
  auto load = JobStateLoad::Begin(backend, &counters);
  ASSERT_TRUE(load.ok()) << load.status();
  uint64_t rng = 42;
  for (v1::StateTensor t : kTensors) {
    std::vector<float> v(num_params);
    for (float& x : v) {
      x = SplitMix64Uniform(&rng);
      if (t == v1::STATE_TENSOR_EXP_AVG_SQ) x = x * x;
    }
    ASSERT_TRUE((*load)->Add(t, 0, v.data(), num_params).ok());
  }
  ASSERT_TRUE((*load)->Finish().ok());
}

std::vector<float> Read(OptimizerBackend* backend, v1::StateTensor t) {
  std::vector<float> out(backend->partition().padded_length());
  EXPECT_TRUE(backend->ReadRange(t, 0, static_cast<int64_t>(out.size()), out.data()).ok());
  return out;
}

// The real elements of every tensor, bit for bit.
void ExpectSameState(OptimizerBackend* a, OptimizerBackend* b, int64_t num_params) {
  for (v1::StateTensor t : kTensors) {
    std::vector<float> x = Read(a, t), y = Read(b, t);
    ASSERT_EQ(0, std::memcmp(x.data(), y.data(), num_params * sizeof(float))) << t;
    for (size_t i = num_params; i < y.size(); ++i) ASSERT_EQ(y[i], 0.0f) << "padding " << i;
  }
}

ParamStateInfo Info() {
  ParamStateInfo info;
  info.counters = StepCounters{7, 6};
  info.loss_scale.set_scale(1024.0f);
  info.front_end = R"({"groups": []})";
  return info;
}

class ParamCheckpointTest : public TempDirTest {};

TEST_F(ParamCheckpointTest, SavedOnTwoShardsLoadsOntoThreeAndOneAndOtherRanks) {
  int64_t n = 0;
  const std::vector<NamedParam> params = Params(&n);
  auto saved = Job(Map(n, 1, 2));
  FillState(saved.get(), n);
  absl::StatusOr<std::string> dir = SaveParamState(Path("ckpt"), params, Info(), saved.get(), 2);
  ASSERT_TRUE(dir.ok()) << dir.status();
  EXPECT_EQ(*dir, Path("ckpt/step-00000007"));
  EXPECT_EQ(*FindParamState(Path("ckpt")), *dir);
  EXPECT_EQ(*FindParamState(*dir), *dir);

  for (auto [world, shards] : {std::pair{1, 3}, std::pair{1, 1}, std::pair{2, 3}}) {
    SCOPED_TRACE(absl::StrCat(world, " ranks, ", shards, " shards"));
    auto loaded = Job(Map(n, world, shards));
    absl::StatusOr<v1::ParamStateManifest> m =
        LoadParamState(*dir, params, DType::kBf16, loaded.get());
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->step(), 7u);
    EXPECT_EQ(m->adam_step(), 6u);
    EXPECT_EQ(m->loss_scale().scale(), 1024.0f);
    EXPECT_EQ(m->front_end(), Info().front_end);
    ExpectSameState(saved.get(), loaded.get(), n);
  }
}

TEST_F(ParamCheckpointTest, ParametersInAnotherOrderLoadByName) {
  int64_t n = 0;
  std::vector<NamedParam> params = Params(&n);
  auto saved = Job(Map(n, 1, 2));
  FillState(saved.get(), n);
  absl::StatusOr<std::string> dir = SaveParamState(Path("ckpt"), params, Info(), saved.get(), 2);
  ASSERT_TRUE(dir.ok()) << dir.status();
  // The same parameters laid out the other way round (another grouping of the same model).
  std::vector<NamedParam> reversed = {params[2], params[1], params[0]};
  int64_t offset = 0;
  for (NamedParam& p : reversed) {
    p.offset = offset;
    offset += p.numel();
  }
  auto loaded = Job(Map(n, 1, 3));
  ASSERT_TRUE(LoadParamState(*dir, reversed, DType::kBf16, loaded.get()).ok());
  for (v1::StateTensor t : kTensors) {
    const std::vector<float> x = Read(saved.get(), t), y = Read(loaded.get(), t);
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_EQ(0, std::memcmp(x.data() + params[i].offset, y.data() + reversed[2 - i].offset,
                               params[i].numel() * sizeof(float)))
          << params[i].name;
    }
  }
}

TEST_F(ParamCheckpointTest, ThroughServersOverGrpc) {
  int64_t n = 0;
  const std::vector<NamedParam> params = Params(&n);
  LocalShards shards(2);
  ClientOptions options;
  auto remote =
      RemoteOptimizer::Connect(Map(n, 1, 2), shards.addresses(), options, TransportChoice::kGrpc);
  ASSERT_TRUE(remote.ok()) << remote.status();
  ASSERT_TRUE((*remote)->CreateJob(kJob, TestAdamW(), DType::kBf16).ok());
  FillState(remote->get(), n);
  absl::StatusOr<std::string> dir = SaveParamState(Path("ckpt"), params, Info(), remote->get(), 1);
  ASSERT_TRUE(dir.ok()) << dir.status();
  auto in_process = Job(Map(n, 1, 1));
  ASSERT_TRUE(LoadParamState(*dir, params, DType::kBf16, in_process.get()).ok());
  ExpectSameState(remote->get(), in_process.get(), n);
  // And back onto the servers, over the current state.
  FillState(in_process.get(), n);
  ASSERT_TRUE(LoadParamState(*dir, params, DType::kBf16, remote->get()).ok());
  auto again = Job(Map(n, 1, 1));
  ASSERT_TRUE(LoadParamState(*dir, params, DType::kBf16, again.get()).ok());
  ExpectSameState(remote->get(), again.get(), n);
}

// A refused load changes nothing: the target's state before and after, bit for bit.
class RefusedLoadTest : public ParamCheckpointTest {
 protected:
  void SetUp() override {
    ParamCheckpointTest::SetUp();
    params_ = Params(&n_);
    auto saved = Job(Map(n_, 1, 2));
    FillState(saved.get(), n_);
    absl::StatusOr<std::string> dir = SaveParamState(Path("ckpt"), params_, Info(), saved.get(), 1);
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *dir;
    target_ = Job(Map(n_, 1, 3));
    // The target holds other values than the checkpoint's.
    auto load = JobStateLoad::Begin(target_.get(), nullptr);
    ASSERT_TRUE(load.ok());
    std::vector<float> v(n_, 0.5f);
    for (v1::StateTensor t : kTensors) ASSERT_TRUE((*load)->Add(t, 0, v.data(), v.size()).ok());
    ASSERT_TRUE((*load)->Finish().ok());
    for (v1::StateTensor t : kTensors) before_.push_back(Read(target_.get(), t));
  }

  void ExpectUnchanged() {
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(Read(target_.get(), kTensors[i]), before_[i]);
  }

  int64_t n_ = 0;
  std::vector<NamedParam> params_;
  std::string dir_;
  std::unique_ptr<InProcessOptimizer> target_;
  std::vector<std::vector<float>> before_;
};

TEST_F(RefusedLoadTest, AnotherModelNamesTheFirstParameterThatDiffers) {
  std::vector<NamedParam> renamed = params_;
  renamed[1].name = "fc.kernel";
  absl::StatusOr<v1::ParamStateManifest> m =
      LoadParamState(dir_, renamed, DType::kBf16, target_.get());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("no parameter 'fc.kernel'"), std::string::npos) << m.status();

  std::vector<NamedParam> reshaped = params_;
  reshaped[0].shape = {24, 37};
  m = LoadParamState(dir_, reshaped, DType::kBf16, target_.get());
  EXPECT_NE(m.status().message().find("'emb.weight' has shape [37, 24] there but [24, 37] here"),
            std::string::npos)
      << m.status();

  std::vector<NamedParam> fewer = {params_[0], params_[1]};
  m = LoadParamState(dir_, fewer, DType::kBf16, target_.get());
  EXPECT_NE(m.status().message().find("'fc.bias' of shape [53] that this model lacks"),
            std::string::npos)
      << m.status();
  ExpectUnchanged();
}

TEST_F(RefusedLoadTest, ATruncatedFileIsRefusedNamingIt) {
  const std::string path = dir_ + "/exp_avg.safetensors";
  const std::string bytes = ReadBytes(path);
  WriteBytes(path, bytes.substr(0, bytes.size() - 100));
  absl::StatusOr<v1::ParamStateManifest> m =
      LoadParamState(dir_, params_, DType::kBf16, target_.get());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss) << m.status();
  EXPECT_NE(m.status().message().find(path), std::string::npos) << m.status();
  ExpectUnchanged();
}

TEST_F(RefusedLoadTest, AnAlteredByteIsRefusedByItsCrc) {
  // The last file streamed: the first two have gone to the servers before the CRC catches it.
  const std::string path = dir_ + "/exp_avg_sq.safetensors";
  std::string bytes = ReadBytes(path);
  bytes[bytes.size() - 3] ^= 0x01;  // a value's low mantissa bit: still finite, still >= 0
  WriteBytes(path, bytes);
  absl::StatusOr<v1::ParamStateManifest> m =
      LoadParamState(dir_, params_, DType::kBf16, target_.get());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss) << m.status();
  EXPECT_NE(m.status().message().find("CRC-32"), std::string::npos) << m.status();
  EXPECT_NE(m.status().message().find(path), std::string::npos) << m.status();
  ExpectUnchanged();
}

TEST_F(RefusedLoadTest, AMissingCheckpointSaysSo) {
  absl::StatusOr<std::string> found = FindParamState(Path("nothing-here"));
  EXPECT_EQ(found.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(found.status().message().find("nothing-here"), std::string::npos);
}

TEST_F(ParamCheckpointTest, BadParameterListsAreRefused) {
  int64_t n = 0;
  std::vector<NamedParam> params = Params(&n);
  std::vector<NamedParam> twice = params;
  twice[2].name = "fc.weight";
  EXPECT_FALSE(CheckNamedParams(twice, 1 << 20).ok());
  std::vector<NamedParam> overlap = params;
  overlap[2].offset -= 1;
  EXPECT_FALSE(CheckNamedParams(overlap, 1 << 20).ok());
  EXPECT_FALSE(CheckNamedParams(params, n - 1).ok());
  EXPECT_TRUE(CheckNamedParams(params, n).ok());
}

}  // namespace
}  // namespace offload
