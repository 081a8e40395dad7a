// The training loop end to end on a tiny model and the bundled text: the in-process optimizer
// and gRPC shards give bit-identical weights, checkpoints resume bit for bit, fp16 overflow
// skips the step and lowers the scale, and bad settings are refused.
#include "gpu_trainer/train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "base/thread_pool.h"
#include "cpu_optimizer_server/grpc/optimizer_service.h"
#include "cpu_optimizer_server/shard/shard_store.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gpu_trainer/data/batch_sampler.h"
#include "gpu_trainer/data/token_dataset.h"
#include "gpu_trainer/train/checkpointing.h"
#include "gpu_trainer/train/model_runner.h"
#include "gpu_trainer/train/trainer_test_util.h"
#include "gtest/gtest.h"
#include "model_spec/param_layout.h"
#include "model_spec/partition.h"
#include "optimizer_client/backends/inprocess_optimizer.h"
#include "optimizer_client/backends/remote_optimizer.h"
#include "optimizer_client/checkpoint/atomic_file.h"
#include "optimizer_client/checkpoint/checkpoint_dir.h"
#include "optimizer_client/checkpoint/manifest.h"
#include "optimizer_client/checkpoint/safetensors.h"
#include "optimizer_client/precision/grad_stats.h"
#include "optimizer_client/precision/loss_scaler.h"
#include "optimizer_client/precision/lr_schedule.h"
#include "optimizer_client/sender/phase_trace.h"

namespace offload {
namespace {

TEST(Trainer, LossFallsOnTheBundledText) {
  TrainerOptions o = TinyOptions();
  InProcessOptimizer backend(MapFor(o, 1), 2, BestSimdPath());
  RunResult r = Train(o, &backend, 40);
  ASSERT_EQ(r.losses.size(), 40u);
  EXPECT_NEAR(r.losses.front(), std::log(256.0f), 0.3f);  // uniform over bytes at init
  float tail = 0;
  for (int i = 30; i < 40; ++i) tail += r.losses[i] / 10;
  EXPECT_LT(tail, r.losses.front() - 1.5f);
}

TEST(Trainer, InProcessAndServerShardsGiveBitIdenticalWeights) {
  for (DType dtype : {DType::kFp16, DType::kBf16}) {
    TrainerOptions o = TinyOptions();
    o.param_dtype = dtype;
    InProcessOptimizer in_process(MapFor(o, 2), 2, BestSimdPath());
    RunResult a = Train(o, &in_process, 12);

    LocalShards shards(2);
    auto remote = RemoteOptimizer::Connect(MapFor(o, 2), shards.addresses(), ClientOptions{});
    ASSERT_TRUE(remote.ok()) << remote.status();
    RunResult b = Train(o, remote->get(), 12);

    EXPECT_EQ(a.losses, b.losses) << DTypeName(dtype);
    EXPECT_EQ(a.weights16, b.weights16) << DTypeName(dtype);
    EXPECT_TRUE(SameBits(a.master, b.master)) << DTypeName(dtype);
    // And the step did change the weights: this is not two untouched copies.
    std::vector<float> init(a.master.size(), 0.0f);
    InitGpt2Params(o.model, o.seed, init.data());
    EXPECT_FALSE(SameBits(a.master, init));
  }
}

// Activation checkpointing recomputes each block in backward with the same kernels: the same
// losses and weights, fp16 and bf16, with micro-batches; and the model holds fewer activations.
TEST(Trainer, ActivationCheckpointingTrainsTheSameBits) {
  for (DType dtype : {DType::kFp16, DType::kBf16}) {
    TrainerOptions o = TinyOptions();
    o.param_dtype = dtype;
    o.micro_batches = 2;
    InProcessOptimizer plain_backend(MapFor(o, 1), 2, BestSimdPath());
    const RunResult plain = Train(o, &plain_backend, 8);
    o.activation_checkpointing = true;
    InProcessOptimizer checkpointed_backend(MapFor(o, 1), 2, BestSimdPath());
    const RunResult checkpointed = Train(o, &checkpointed_backend, 8);
    EXPECT_EQ(plain.losses, checkpointed.losses) << DTypeName(dtype);
    EXPECT_EQ(plain.weights16, checkpointed.weights16) << DTypeName(dtype);
    EXPECT_TRUE(SameBits(plain.master, checkpointed.master)) << DTypeName(dtype);
  }
  TrainerOptions o = TinyOptions();
  InProcessOptimizer backend(MapFor(o, 1), 1, BestSimdPath());
  auto plain = Trainer::Create(o, &backend);
  o.activation_checkpointing = true;
  auto checkpointed = Trainer::Create(o, &backend);
  ASSERT_TRUE(plain.ok() && checkpointed.ok());
  EXPECT_LT((*checkpointed)->DeviceMemory().used_bytes, (*plain)->DeviceMemory().used_bytes);
}

// A job too large for the host's memory is refused before anything is allocated, with the model,
// what it needs and the limit in the message.
TEST(Trainer, AJobTooLargeForTheHostIsRefusedWithTheNumbers) {
  TrainerOptions o = TinyOptions();
  InProcessOptimizer backend(MapFor(o, 1), 1, BestSimdPath());
  o.host_memory_limit_bytes = 1 << 20;
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(o, &backend);
  ASSERT_EQ(t.status().code(), absl::StatusCode::kResourceExhausted) << t.status();
  for (const char* part : {"needs ", "of host memory for GPT-2 layers=2 channels=32",
                           "activations ", "but 1 MiB are allowed", "--activation_checkpointing"}) {
    EXPECT_NE(t.status().message().find(part), std::string::npos) << part << ": " << t.status();
  }
  // What this machine has is enough for the tiny model.
  o.host_memory_limit_bytes = 0;
  EXPECT_TRUE(Trainer::Create(o, &backend).ok());
  // The limit is what the plan says: a limit of exactly the need passes, one byte less does not.
  o.host_memory_limit_bytes = int64_t{1} << 40;
  auto probe = Trainer::Create(o, &backend);
  ASSERT_TRUE(probe.ok());
  const int64_t need = (*probe)->PlanHostMemory().total();
  o.host_memory_limit_bytes = need;
  EXPECT_TRUE(Trainer::Create(o, &backend).ok());
  o.host_memory_limit_bytes = need - 1;
  EXPECT_EQ(Trainer::Create(o, &backend).status().code(), absl::StatusCode::kResourceExhausted);
  // Checkpointing holds fewer activations, which the plan counts.
  o.host_memory_limit_bytes = 0;
  o.activation_checkpointing = true;
  auto checkpointed = Trainer::Create(o, &backend);
  ASSERT_TRUE(checkpointed.ok());
  EXPECT_LT((*checkpointed)->PlanHostMemory().activations, (*probe)->PlanHostMemory().activations);
}

TEST(Trainer, ResumeFromACheckpointIsBitIdentical) {
  TrainerOptions o = TinyOptions();
  o.steps = 16;
  o.schedule.set_total_steps(16);
  InProcessOptimizer straight_backend(MapFor(o, 2), 2, BestSimdPath());
  RunResult straight = Train(o, &straight_backend, 16);

  TempDir dir;
  o.checkpoint_dir = dir.path();
  o.resume = true;
  {
    InProcessOptimizer first(MapFor(o, 2), 2, BestSimdPath());
    Train(o, &first, 8, /*checkpoint_at_end=*/true);
  }
  // A new optimizer and trainer, as after a restart of every process.
  InProcessOptimizer second(MapFor(o, 2), 2, BestSimdPath());
  RunResult resumed = Train(o, &second, 8);

  ASSERT_EQ(resumed.losses.size(), 8u);
  EXPECT_EQ(std::vector<float>(straight.losses.begin() + 8, straight.losses.end()), resumed.losses);
  EXPECT_EQ(straight.weights16, resumed.weights16);
  EXPECT_TRUE(SameBits(straight.master, resumed.master));
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// Every file under root, by path, with its bytes.
std::map<std::string, std::string> Snapshot(const std::string& root) {
  std::map<std::string, std::string> files;
  for (const auto& e : std::filesystem::recursive_directory_iterator(root)) {
    if (e.is_regular_file()) files[e.path().string()] = ReadAll(e.path().string());
  }
  return files;
}

// Where a safetensors file's data section starts (after the length field and the header).
size_t DataStart(const std::string& bytes) {
  uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = (header << 8) | static_cast<uint8_t>(bytes[i]);
  return 8 + header;
}

// A checkpoint file truncated by one byte, one byte of a shard's tensor data flipped, the model
// file's data altered: each resume is refused (DataLoss) naming the file, with both sizes or both
// CRC-32s, before anything loads: the shard servers keep the job they hold (CreateJob would
// replace it), the trainer its weights, and every byte under the checkpoint root stays. The
// unaltered checkpoint then resumes, and so does one whose manifest predates the digests.
TEST(Trainer, ResumeRefusesATruncatedOrAlteredFileNamingItAndChangesNothing) {
  TrainerOptions o = TinyOptions();
  TempDir dir;
  o.checkpoint_dir = dir.path();
  o.resume = true;
  LocalShards shards(2);  // servers outlive a trainer, and keep its job
  auto remote = RemoteOptimizer::Connect(MapFor(o, 2), shards.addresses(), ClientOptions{});
  ASSERT_TRUE(remote.ok()) << remote.status();
  OptimizerBackend& backend = **remote;
  Train(o, &backend, 3, /*checkpoint_at_end=*/true);
  Train(o, &backend, 2);  // the shards move on past the checkpoint, as a crashed run leaves them
  std::vector<float> master(backend.partition().padded_length());  // (padded,)
  ASSERT_TRUE(backend.ReadMasterWeights(master.data()).ok());
  absl::StatusOr<std::string> latest = LatestCheckpointDir(dir.path());
  ASSERT_TRUE(latest.ok()) << latest.status();
  absl::StatusOr<v1::CheckpointManifest> manifest = ReadManifest(*latest);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  ASSERT_TRUE(manifest->has_model_file_digest());
  ASSERT_EQ(manifest->shard_files_size(), 2);
  ASSERT_TRUE(manifest->shard_files(1).has_digest());

  const std::string shard = *latest + "/" + manifest->shard_files(1).file();
  const std::string model = *latest + "/" + manifest->model_file();
  const std::string shard_bytes = ReadAll(shard), model_bytes = ReadAll(model);
  struct Case {
    std::string path;
    std::string bytes;
    std::vector<std::string> message;  // what the refusal must say
  };
  std::string flipped_shard = shard_bytes;
  const size_t shard_data = DataStart(shard_bytes);
  flipped_shard[shard_data + (shard_bytes.size() - shard_data) / 2] ^= 0x01;
  std::string altered_model = model_bytes;
  const size_t model_data = DataStart(model_bytes);
  altered_model[model_data + (model_bytes.size() - model_data) / 3] ^= 0x10;
  auto hex = [](uint32_t crc) { return absl::StrFormat("%08x", crc); };
  auto crc = [](const std::string& b) {
    return Crc32Update(0, b.data(), static_cast<int64_t>(b.size()));
  };
  const std::vector<Case> cases = {
      {shard,
       shard_bytes.substr(0, shard_bytes.size() - 1),
       {absl::StrCat(shard_bytes.size() - 1), absl::StrCat(shard_bytes.size()), "truncated"}},
      {shard,
       flipped_shard,
       {hex(crc(flipped_shard)), hex(manifest->shard_files(1).digest().crc32())}},
      {model, altered_model, {hex(crc(altered_model)), hex(manifest->model_file_digest().crc32())}},
  };
  for (const Case& c : cases) {
    WriteAll(c.path, c.bytes);
    const std::map<std::string, std::string> files = Snapshot(dir.path());
    absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(o, &backend);
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    const std::vector<uint16_t> weights = (*trainer)->weights16();
    absl::StatusOr<std::string> started = (*trainer)->Start();
    ASSERT_FALSE(started.ok()) << *started;
    EXPECT_TRUE(absl::IsDataLoss(started.status())) << started.status();
    EXPECT_NE(started.status().message().find(c.path), std::string::npos) << started.status();
    for (const std::string& part : c.message) {
      EXPECT_NE(started.status().message().find(part), std::string::npos)
          << part << " in " << started.status();
    }
    EXPECT_EQ((*trainer)->weights16(), weights);
    EXPECT_EQ((*trainer)->step(), 0u);
    std::vector<float> after(master.size());
    ASSERT_TRUE(backend.ReadMasterWeights(after.data()).ok());
    EXPECT_TRUE(SameBits(master, after));
    EXPECT_EQ(Snapshot(dir.path()), files);
    WriteAll(c.path, c.path == shard ? shard_bytes : model_bytes);
  }

  // Unaltered, it resumes; and so does a checkpoint whose manifest records no digests.
  for (bool digests : {true, false}) {
    if (!digests) {
      v1::CheckpointManifest old = *manifest;
      old.clear_model_file_digest();
      for (v1::ShardFile& f : *old.mutable_shard_files()) f.clear_digest();
      ASSERT_TRUE(WriteFileAtomic(*latest + "/" + kManifestFileName, ManifestToJson(old)).ok());
    }
    InProcessOptimizer fresh(MapFor(o, 2), 2, BestSimdPath());
    absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(o, &fresh);
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    absl::StatusOr<std::string> started = (*trainer)->Start();
    ASSERT_TRUE(started.ok()) << started.status();
    EXPECT_EQ((*trainer)->step(), 3u);
  }
}

// A checkpoint of a job with two optimizer servers resumed with one is refused before anything
// loads, naming both numbers: the server it would run on keeps the job it holds (CreateJob would
// replace it), the trainer its weights, and every byte under the checkpoint root stays.
TEST(Trainer, ResumeRefusesADifferentNumberOfOptimizerServersNamingBothAndChangesNothing) {
  TrainerOptions o = TinyOptions();
  TempDir dir;
  o.checkpoint_dir = dir.path();
  o.resume = true;
  LocalShards shards(2);
  auto two = RemoteOptimizer::Connect(MapFor(o, 2), shards.addresses(), ClientOptions{});
  ASSERT_TRUE(two.ok()) << two.status();
  Train(o, two->get(), 3, /*checkpoint_at_end=*/true);
  Train(o, two->get(), 2);  // the shards move on past the checkpoint
  std::vector<float> master((*two)->partition().padded_length());  // (padded,)
  ASSERT_TRUE((*two)->ReadMasterWeights(master.data()).ok());
  const std::map<std::string, std::string> files = Snapshot(dir.path());

  // One server: the first of the two, which holds the job.
  auto one = RemoteOptimizer::Connect(MapFor(o, 1), {shards.addresses()[0]}, ClientOptions{});
  ASSERT_TRUE(one.ok()) << one.status();
  absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(o, one->get());
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  const std::vector<uint16_t> weights = (*trainer)->weights16();
  absl::StatusOr<std::string> started = (*trainer)->Start();
  ASSERT_FALSE(started.ok()) << *started;
  EXPECT_TRUE(absl::IsFailedPrecondition(started.status())) << started.status();
  EXPECT_NE(started.status().message().find("optimizer servers=2"), std::string::npos)
      << started.status();
  EXPECT_NE(started.status().message().find("optimizer servers=1"), std::string::npos)
      << started.status();
  EXPECT_EQ((*trainer)->weights16(), weights);
  EXPECT_EQ((*trainer)->step(), 0u);
  std::vector<float> after(master.size());
  ASSERT_TRUE((*two)->ReadMasterWeights(after.data()).ok());
  EXPECT_TRUE(SameBits(master, after));
  EXPECT_EQ(Snapshot(dir.path()), files);

  // And the other way: a checkpoint of one server resumed with two.
  TempDir dir1;
  TrainerOptions o1 = o;
  o1.checkpoint_dir = dir1.path();
  {
    InProcessOptimizer first(MapFor(o1, 1), 2, BestSimdPath());
    Train(o1, &first, 2, /*checkpoint_at_end=*/true);
  }
  InProcessOptimizer second(MapFor(o1, 2), 2, BestSimdPath());
  absl::StatusOr<std::unique_ptr<Trainer>> resumed = Trainer::Create(o1, &second);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  started = (*resumed)->Start();
  ASSERT_FALSE(started.ok()) << *started;
  EXPECT_NE(started.status().message().find("optimizer servers=1"), std::string::npos)
      << started.status();
  EXPECT_NE(started.status().message().find("optimizer servers=2"), std::string::npos)
      << started.status();
}

// --resume on an empty checkpoint directory starts fresh (a job's first attempt and its restarts
// run with the same flags), and says so: the user must not take it for a continued run.
TEST(Trainer, AResumeWithNothingToResumeSaysSo) {
  TempDir dir;
  for (bool resume : {true, false}) {
    TrainerOptions o = TinyOptions();
    o.checkpoint_dir = dir.path();
    o.resume = resume;
    InProcessOptimizer backend(MapFor(o, 1), 2, BestSimdPath());
    absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(o, &backend);
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    absl::StatusOr<std::string> started = (*trainer)->Start();
    ASSERT_TRUE(started.ok()) << started.status();
    EXPECT_EQ(*started, absl::StrCat(resume ? absl::StrCat("nothing to resume: no checkpoint in ",
                                                           dir.path(), "; ")
                                            : "",
                                     "started from GPT-2 initialisation, seed 7"));
    EXPECT_EQ((*trainer)->step(), 0u);
  }
}

TEST(Trainer, ResumeRefusesADifferentModel) {
  TrainerOptions o = TinyOptions();
  TempDir dir;
  o.checkpoint_dir = dir.path();
  o.resume = true;
  {
    InProcessOptimizer backend(MapFor(o, 1), 2, BestSimdPath());
    Train(o, &backend, 2, /*checkpoint_at_end=*/true);
  }
  auto start = [](const TrainerOptions& options) -> absl::StatusOr<std::string> {
    InProcessOptimizer backend(MapFor(options, 1), 2, BestSimdPath());
    OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(options, &backend));
    return trainer->Start();
  };
  TrainerOptions other_model = o;
  other_model.model.num_heads = 4;  // same parameter count, different model
  absl::StatusOr<std::string> started = start(other_model);
  ASSERT_FALSE(started.ok());
  EXPECT_NE(started.status().message().find("model"), std::string::npos) << started.status();
  TrainerOptions other_lr = o;
  other_lr.schedule.set_max_lr(1e-2f);
  started = start(other_lr);
  ASSERT_FALSE(started.ok());
  EXPECT_NE(started.status().message().find("lr schedule"), std::string::npos) << started.status();
  // Training longer is allowed: only the end of the cosine moves.
  TrainerOptions longer = o;
  longer.steps = 80;
  longer.schedule.set_total_steps(80);
  started = start(longer);
  EXPECT_TRUE(started.ok()) << started.status();
  // A fresh run into a directory that holds a checkpoint would hide it: refused.
  TrainerOptions fresh = o;
  fresh.resume = false;
  started = start(fresh);
  ASSERT_FALSE(started.ok());
  EXPECT_NE(started.status().message().find("--resume"), std::string::npos) << started.status();
}

TEST(Trainer, Fp16OverflowSkipsTheStepAndLowersTheScale) {
  TrainerOptions o = TinyOptions();
  o.loss_scaler.init_scale = 1e30f;  // every gradient overflows fp16 at this scale
  InProcessOptimizer backend(MapFor(o, 1), 2, BestSimdPath());
  absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(o, &backend);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  ASSERT_TRUE((*trainer)->Start().ok());
  const std::vector<uint16_t> before = (*trainer)->weights16();
  absl::StatusOr<StepReport> first = (*trainer)->Step();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->skipped);
  EXPECT_EQ((*trainer)->weights16(), before);
  EXPECT_EQ((*trainer)->loss_scaler().scale(), 5e29f);
  // The scale halves until the gradients fit, then training goes on.
  int skipped = 1;
  bool applied = false;
  for (int i = 0; i < 120 && !applied; ++i) {
    absl::StatusOr<StepReport> r = (*trainer)->Step();
    ASSERT_TRUE(r.ok()) << r.status();
    skipped += r->skipped;
    applied = !r->skipped;
  }
  EXPECT_TRUE(applied);
  EXPECT_NE((*trainer)->weights16(), before);
  EXPECT_EQ((*trainer)->loss_scaler().skipped_steps(), static_cast<uint64_t>(skipped));
  EXPECT_LT((*trainer)->loss_scaler().scale(), 65536.0f * 2);
}

TEST(Trainer, BadSettingsAreRefusedClearly) {
  TrainerOptions o = TinyOptions();
  InProcessOptimizer backend(MapFor(o, 1), 2, BestSimdPath());
  TrainerOptions missing = o;
  missing.data = "/nonexistent/corpus.txt";
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(missing, &backend);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("/nonexistent/corpus.txt"), std::string::npos);
  TrainerOptions long_seq = o;
  long_seq.seq_len = 64;  // beyond the context of 32
  EXPECT_FALSE(Trainer::Create(long_seq, &backend).ok());
  TrainerOptions small_vocab = o;
  small_vocab.model.vocab_size = 64;  // the text has bytes >= 64
  EXPECT_FALSE(Trainer::Create(small_vocab, &backend).ok());
  // No checkpoint to keep: refused before anything runs, not at the first checkpoint.
  TrainerOptions keep_none = o;
  keep_none.keep_checkpoints = 0;
  t = Trainer::Create(keep_none, &backend);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_NE(t.status().message().find("keep_checkpoints must be >= 1, got 0"), std::string::npos)
      << t.status();
  // A map for another model.
  TrainerOptions other = o;
  other.model.num_layers = 3;
  InProcessOptimizer wrong_map(MapFor(other, 1), 2, BestSimdPath());
  EXPECT_FALSE(Trainer::Create(o, &wrong_map).ok());
}

TEST(Trainer, SampleIsSeededText) {
  TrainerOptions o = TinyOptions();
  InProcessOptimizer backend(MapFor(o, 1), 2, BestSimdPath());
  absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(o, &backend);
  ASSERT_TRUE(trainer.ok());
  ASSERT_TRUE((*trainer)->Start().ok());
  absl::StatusOr<std::string> a = (*trainer)->Sample("ROMEO:", 40, 0.8f, 3);
  absl::StatusOr<std::string> b = (*trainer)->Sample("ROMEO:", 40, 0.8f, 3);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->size(), 40u);
  EXPECT_EQ(*a, *b);
  absl::StatusOr<float> val = (*trainer)->Evaluate(3);
  ASSERT_TRUE(val.ok());
  EXPECT_NEAR(*val, std::log(256.0f), 0.3f);
}

TEST(Trainer, StartsFromGpt2WeightsWithOrWithoutThePrefix) {
  // The PyTorch fixture of the model tests holds GPT-2-named fp32 weights of this config.
  const std::string fixture = std::string(OFFLOAD_SOURCE_DIR) +
                              "/gpu_trainer/model/testdata/gpt2_torch_fixture.safetensors";
  TrainerOptions o = TinyOptions();
  o.model = Gpt2Config{96, 32, 2, 4, 32};
  std::vector<float> want(Gpt2NumParams(o.model));
  ASSERT_TRUE(LoadGpt2Weights(fixture, o.model, want.data()).ok());

  // The same tensors under Hugging Face's GPT2LMHeadModel names ("transformer." prefix).
  TempDir dir;
  std::filesystem::create_directories(dir.path());
  const std::string prefixed = dir.path() + "/hf.safetensors";
  std::vector<SafetensorsTensor> tensors;
  for (const ParamTensor& p : Gpt2ParamLayout(o.model)) {
    SafetensorsTensor t;
    t.name = "transformer." + p.name;
    t.dtype = TensorDType::kF32;
    t.shape = p.shape;
    t.data = want.data() + p.offset;
    tensors.push_back(std::move(t));
  }
  ASSERT_TRUE(WriteSafetensors(prefixed, tensors, {}).ok());

  for (const std::string& path : {fixture, prefixed}) {
    std::vector<float> got(want.size());
    ASSERT_TRUE(LoadGpt2Weights(path, o.model, got.data()).ok()) << path;
    EXPECT_EQ(got, want) << path;
  }
  // A tensor of the wrong shape is refused with its name.
  Gpt2Config bigger = o.model;
  bigger.channels = 64;
  std::vector<float> unused(Gpt2NumParams(bigger));
  absl::Status s = LoadGpt2Weights(fixture, bigger, unused.data());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("wte.weight"), std::string::npos) << s;
}

TEST(Trainer, FineTunesFromTheModelFileOfACheckpoint) {
  TrainerOptions o = TinyOptions();
  TempDir dir;
  o.checkpoint_dir = dir.path();
  std::vector<uint16_t> trained;
  {
    InProcessOptimizer backend(MapFor(o, 1), 2, BestSimdPath());
    trained = Train(o, &backend, 5, /*checkpoint_at_end=*/true).weights16;
  }
  TrainerOptions fine_tune = TinyOptions();
  fine_tune.init_from = dir.path() + "/step-00000005/model.safetensors";
  InProcessOptimizer backend(MapFor(fine_tune, 1), 2, BestSimdPath());
  absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(fine_tune, &backend);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  absl::StatusOr<std::string> started = (*trainer)->Start();
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_NE(started->find("weights from"), std::string::npos);
  // fp16 -> fp32 -> fp16 is exact: the run starts on exactly the trained weights, at step 0.
  EXPECT_EQ((*trainer)->weights16(), trained);
  EXPECT_EQ((*trainer)->step(), 0u);
}

}  // namespace
}  // namespace offload

namespace offload {
namespace {

// The delayed parameter update, written out the plain way: step s computes on the weights
// committed at step s - 1 up to the first delayed step (warm-up + 1), on those of step s - 2
// after, every call on this thread in order. The same runner, sampler, scaler and optimizer as the
// trainer, so a correct DPU pipeline must match it bit for bit.
RunResult DpuReference(const TrainerOptions& o, OptimizerBackend* backend, uint64_t steps) {
  RunResult r;
  absl::StatusOr<TokenDataset> data = TokenDataset::Open(o.data);
  EXPECT_TRUE(data.ok());
  auto split = SplitTrainVal(*data, o.val_fraction, o.seq_len);
  EXPECT_TRUE(split.ok());
  BatchSampler sampler(split->first, o.batch, o.seq_len, o.seed);
  auto runner = CreateCpuModelRunner(o.model, o.batch, o.seq_len, o.kernels, o.param_dtype);
  EXPECT_TRUE(runner.ok());
  DynamicLossScaler scaler(o.loss_scaler, o.param_dtype == DType::kFp16);
  const v1::PartitionMap& map = backend->partition();
  EXPECT_TRUE(backend->CreateJob(o.job_id, o.adam, o.param_dtype).ok());
  std::vector<float> master(map.padded_length(), 0.0f);
  InitGpt2Params(o.model, o.seed, master.data());
  EXPECT_TRUE(backend->LoadMasterWeights(master.data()).ok());
  // history[k]: the 16-bit weights after k updates (skipped steps repeat the last).
  std::vector<std::vector<uint16_t>> history(1, std::vector<uint16_t>(map.padded_length()));
  ConvertFromFloat(master.data(), static_cast<int64_t>(master.size()), o.param_dtype,
                   history[0].data());
  std::vector<uint16_t> grads16(map.padded_length(), 0);
  std::vector<int32_t> inputs(o.batch * o.seq_len), targets(inputs.size());
  for (uint64_t s = 1; s <= steps; ++s) {
    // The first delayed step still finds the warm-up's last update applied; from the next one
    // on, the previous step's update is still running when the step computes.
    const bool stale = o.dpu && s > o.dpu_warmup_steps + 1;
    const std::vector<uint16_t>& weights = history[stale ? s - 2 : s - 1];
    EXPECT_TRUE((*runner)->SetWeights(weights.data()).ok());
    sampler.Next(inputs.data(), targets.data());
    absl::StatusOr<float> loss =
        (*runner)->Forward(inputs.data(), targets.data(), o.batch, o.seq_len);
    EXPECT_TRUE(loss.ok());
    r.losses.push_back(*loss);
    const float scale = scaler.scale();
    absl::StatusOr<GradStats> stats = (*runner)->Backward(scale, grads16.data(), nullptr);
    EXPECT_TRUE(stats.ok());
    const bool skip = stats->nonfinite;
    const double norm = std::sqrt(stats->sum_squares) / scale;
    const float clip = skip ? 1.0f : ClipCoefficient(norm, o.grad_clip);
    EXPECT_TRUE(backend->BeginStep(s).ok());
    EXPECT_TRUE(
        backend->SendGradients(0, grads16.data(), static_cast<int64_t>(grads16.size())).ok());
    history.push_back(history.back());
    EXPECT_TRUE(
        backend->Commit(ScheduledLr(o.schedule, s), clip / scale, skip, history.back().data())
            .ok());
    scaler.Update(skip);
  }
  // As the trainer holds them after `steps`: the weights its next step computes with.
  const bool pending = o.dpu && steps > o.dpu_warmup_steps;  // the last update not yet taken
  r.weights16 = history[pending ? steps - 1 : steps];
  r.master.assign(map.padded_length(), 0.0f);
  EXPECT_TRUE(backend->ReadMasterWeights(r.master.data()).ok());
  return r;
}

TEST(TrainerDpu, UpdatesAreExactlyOneStepStaleAfterTheWarmUp) {
  const TrainerOptions o = DpuOptions();
  InProcessOptimizer trainer_backend(MapFor(o, 2), 2, BestSimdPath());
  RunResult dpu = Train(o, &trainer_backend, 14);
  InProcessOptimizer reference_backend(MapFor(o, 2), 2, BestSimdPath());
  RunResult reference = DpuReference(o, &reference_backend, 14);
  EXPECT_EQ(dpu.losses, reference.losses);
  EXPECT_EQ(dpu.weights16, reference.weights16);
  EXPECT_TRUE(SameBits(dpu.master, reference.master));

  // And the delay is real: the synchronous run differs once a step computes on stale weights
  // (step 6), not before.
  TrainerOptions sync = o;
  sync.dpu = false;
  InProcessOptimizer sync_backend(MapFor(o, 2), 2, BestSimdPath());
  RunResult plain = Train(sync, &sync_backend, 14);
  EXPECT_EQ(std::vector<float>(plain.losses.begin(), plain.losses.begin() + 5),
            std::vector<float>(dpu.losses.begin(), dpu.losses.begin() + 5));
  EXPECT_NE(plain.losses[5], dpu.losses[5]);
  EXPECT_NE(plain.losses, dpu.losses);
  EXPECT_FALSE(SameBits(plain.master, dpu.master));
}

TEST(TrainerDpu, WithoutTheDelayItIsTheSynchronousRunBitForBit) {
  TrainerOptions o = DpuOptions();
  o.dpu_warmup_steps = 14;  // never delayed within the run
  InProcessOptimizer a_backend(MapFor(o, 2), 2, BestSimdPath());
  RunResult a = Train(o, &a_backend, 14);
  o.dpu = false;
  InProcessOptimizer b_backend(MapFor(o, 2), 2, BestSimdPath());
  RunResult b = Train(o, &b_backend, 14);
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_EQ(a.weights16, b.weights16);
  EXPECT_TRUE(SameBits(a.master, b.master));
}

TEST(TrainerDpu, ResumeMidPipelineIsBitIdentical) {
  TrainerOptions o = DpuOptions();
  InProcessOptimizer straight_backend(MapFor(o, 2), 2, BestSimdPath());
  RunResult straight = Train(o, &straight_backend, 14);

  TempDir dir;
  o.checkpoint_dir = dir.path();
  o.resume = true;
  {
    InProcessOptimizer first(MapFor(o, 2), 2, BestSimdPath());
    Train(o, &first, 8, /*checkpoint_at_end=*/true);  // 8 > warm-up 4: mid-pipeline
  }
  InProcessOptimizer second(MapFor(o, 2), 2, BestSimdPath());
  RunResult resumed = Train(o, &second, 6);
  EXPECT_EQ(std::vector<float>(straight.losses.begin() + 8, straight.losses.end()), resumed.losses);
  EXPECT_EQ(straight.weights16, resumed.weights16);
  EXPECT_TRUE(SameBits(straight.master, resumed.master));

  // A run without the delay may not continue it.
  o.dpu = false;
  InProcessOptimizer third(MapFor(o, 2), 2, BestSimdPath());
  auto trainer = Trainer::Create(o, &third);
  ASSERT_TRUE(trainer.ok());
  EXPECT_EQ((*trainer)->Start().status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace offload

namespace offload {
namespace {

// Steps an InProcessOptimizer but holds every gradient range until the step's gradients are all
// computed and reduced (the trace has its `wait_reduce` span). A trainer that sent from inside
// backward or the reduction would wait on itself: the hold times out and the step fails.
class HoldSendsUntilGradientsAreReduced final : public OptimizerBackend {
 public:
  HoldSendsUntilGradientsAreReduced(InProcessOptimizer* inner, const PhaseTrace* trace)
      : OptimizerBackend(inner->partition()), inner_(inner), trace_(trace) {}

  absl::Status CreateJob(const std::string& job_id, const v1::AdamConfig& adam, DType param_dtype,
                         const std::vector<v1::ParamGroup>& groups = {}) override {
    return inner_->CreateJob(job_id, adam, param_dtype, groups);
  }
  absl::StatusOr<std::unique_ptr<ShardStateLoad>> BeginShardLoad(
      int shard, const StepCounters* steps) override {
    return inner_->BeginShardLoad(shard, steps);
  }
  absl::Status ReadSliceState(int slice, v1::StateTensor tensor, int64_t offset, int64_t n,
                              float* out) override {
    return inner_->ReadSliceState(slice, tensor, offset, n, out);
  }
  absl::Status DropJob() override { return inner_->DropJob(); }

 private:
  absl::Status OpenSlice(int slice, uint64_t step) override {
    if (open_) return absl::OkStatus();  // the inner backend opens all of the rank's slices
    step_ = step;
    open_ = true;
    return inner_->BeginStep(step);
  }
  absl::Status SendSlice(int slice, int64_t offset, const uint16_t* grads, int64_t n,
                         bool accumulate) override {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!GradientsReduced()) {
      if (gave_up_ || std::chrono::steady_clock::now() > deadline) {
        gave_up_ = true;  // one wait is proof enough; the rest fail at once
        return absl::DeadlineExceededError(absl::StrCat(
            "step ", step_, "'s backward and reduction did not end while its sends waited"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return inner_->SendGradients(offset, grads, n, accumulate);
  }
  absl::StatusOr<StepCounters> CommitSlices(double lr, float grad_multiplier, bool skip,
                                            uint16_t* params16, absl::Span<const double> group_lr,
                                            absl::Span<const RangeStep> range_steps) override {
    open_ = false;
    return inner_->Commit(lr, grad_multiplier, skip, params16, group_lr, range_steps);
  }
  void AbortSlices() override {
    open_ = false;
    inner_->AbortStep();
  }

  bool GradientsReduced() const {
    for (const PhaseTrace::Event& e : trace_->Events()) {
      if (e.name == "wait_reduce" && e.step == step_) return true;
    }
    return false;
  }

  InProcessOptimizer* const inner_;
  const PhaseTrace* const trace_;
  bool open_ = false;
  uint64_t step_ = 0;
  bool gave_up_ = false;
};

// The share of one span's time that falls inside another's, by hand: the bench's overlap figures
// (bench_gpu: how much of a step's transfers ran while forward or backward computed).
TEST(TrainerTrace, OverlapFractionCountsTheTimeInside) {
  auto at = [](const char* name, uint64_t step, double begin, double end) {
    return PhaseTrace::Event{name, step, 0, begin, end};
  };
  const std::vector<PhaseTrace::Event> events = {
      at("backward", 1, 10, 20), at("d2h", 1, 12, 14),  // all inside
      at("d2h", 1, 18, 24),                             // 2 of 6 inside
      at("d2h", 2, 0, 100),                             // another step
      at("forward", 1, 30, 32),  at("forward", 1, 34, 36),
      at("h2d", 1, 31, 35),  // 1 + 1 of 4 inside the two forwards
  };
  EXPECT_DOUBLE_EQ(OverlapFraction(events, "d2h", "backward", 1), 4.0 / 8.0);
  EXPECT_DOUBLE_EQ(OverlapFraction(events, "h2d", "forward", 1), 2.0 / 4.0);
  EXPECT_DOUBLE_EQ(OverlapFraction(events, "d2h", "backward", 2), 0.0);  // no backward there
  EXPECT_DOUBLE_EQ(OverlapFraction(events, "missing", "backward", 1), 0.0);
}

// The point of streaming gradients layer by layer: backward hands each layer's gradients on as
// they are final (to the reducer thread, which rounds them and queues them for the sender) and
// goes on without waiting for the wire. When those threads get a core is up to the scheduler (on
// a loaded 2-core machine, often after backward), so the test checks what the trainer decides:
// the hand-offs happen inside backward, layer by layer, and backward and the reduction end while
// every send is held. The trace is a valid Chrome trace file.
TEST(TrainerTrace, GradientsLeaveDuringBackwardWithoutBlockingIt) {
  TrainerOptions o = TinyOptions();
  o.model.num_layers = 4;
  PhaseTrace trace;
  o.trace = &trace;
  InProcessOptimizer inner(MapFor(o, 1), 2, BestSimdPath());
  HoldSendsUntilGradientsAreReduced held(&inner, &trace);
  RunResult r = Train(o, &held, 3);

  // Holding changes when the gradients arrive, not what is computed.
  TrainerOptions plain_options = o;
  plain_options.trace = nullptr;
  InProcessOptimizer plain_backend(MapFor(plain_options, 1), 2, BestSimdPath());
  RunResult plain = Train(plain_options, &plain_backend, 3);
  EXPECT_EQ(r.losses, plain.losses);
  EXPECT_EQ(r.weights16, plain.weights16);
  EXPECT_TRUE(SameBits(r.master, plain.master));

  for (uint64_t step = 1; step <= 3; ++step) {
    double backward_begin = -1, backward_end = -1, reduce_end = -1;
    std::vector<double> reduce_queued, send_queued;  // when each hand-off happened
    int sends = 0;
    for (const PhaseTrace::Event& e : trace.Events()) {
      if (e.step != step) continue;
      if (e.name == "backward") {
        backward_begin = e.begin_us;
        backward_end = e.end_us;
      }
      if (e.name == "wait_reduce") reduce_end = e.end_us;
      if (e.name == "reduce_queued") reduce_queued.push_back(e.begin_us);
      if (e.name == "send_queued") send_queued.push_back(e.begin_us);
      if (e.name == "send_gradients") ++sends;
    }
    ASSERT_GE(backward_end, 0) << "step " << step;
    ASSERT_GE(reduce_end, backward_end) << "step " << step;
    // Every bucket but the padding (queued when the step begins) is handed on inside backward:
    // ln_f, each layer, the embeddings.
    const int inside_backward =
        std::count_if(reduce_queued.begin(), reduce_queued.end(),
                      [&](double t) { return t >= backward_begin && t <= backward_end; });
    EXPECT_GE(inside_backward, o.model.num_layers + 2) << "step " << step;
    EXPECT_LE(reduce_queued.size() - inside_backward, 1u) << "step " << step;
    // Each reduced bucket is queued for the optimizer before the reduction is waited for.
    EXPECT_EQ(send_queued.size(), reduce_queued.size()) << "step " << step;
    for (double t : send_queued) EXPECT_LE(t, reduce_end) << "step " << step;
    EXPECT_EQ(sends, static_cast<int>(send_queued.size())) << "step " << step;
  }
  TempDir dir;
  std::filesystem::create_directories(dir.path());
  const std::string path = dir.path() + "/trace.json";
  ASSERT_TRUE(trace.WriteChromeTrace(path).ok());
  std::ifstream in(path);
  const std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  google::protobuf::ListValue events;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &events).ok())
      << json.substr(0, 200);
  EXPECT_EQ(events.values_size(), static_cast<int>(trace.Events().size()));
  EXPECT_EQ(events.values(0).struct_value().fields().at("ph").string_value(), "X");
}

}  // namespace
}  // namespace offload
