// The step-dir layout: commit, latest, pruning, and that a crash at any point before the commit
// leaves the previous checkpoint readable.
#include "optimizer_client/checkpoint/checkpoint_dir.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "optimizer_client/checkpoint/safetensors.h"
#include "optimizer_client/checkpoint/test_util.h"

namespace offload {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

using CheckpointDirTest = TempDirTest;

v1::CheckpointManifest Manifest(uint64_t step) {
  v1::CheckpointManifest m;
  m.set_format_version(1);
  m.mutable_model()->set_vocab_size(256);
  m.mutable_partition()->set_num_params(4);
  m.set_param_dtype(v1::DTYPE_FP16);
  m.set_step(step);
  m.set_model_file("model.safetensors");
  return m;
}

// A whole checkpoint of `step` whose model tensor holds the value `step`.
absl::StatusOr<std::string> Save(const std::string& root, uint64_t step, int keep = 2) {
  OFFLOAD_ASSIGN_OR_RETURN(CheckpointStaging staging, CheckpointStaging::Begin(root, step));
  const float v = static_cast<float>(step);
  absl::Status s = WriteSafetensors(staging.PathOf("model.safetensors"),
                                    {{"w", TensorDType::kF32, {1}, &v, nullptr}}, {});
  if (!s.ok()) return s;
  return staging.Commit(Manifest(step), keep);
}

float ModelValue(const std::string& dir) {
  auto r = SafetensorsReader::Open(dir + "/model.safetensors");
  float v = -1;
  if (r.ok()) (*r)->ReadAsFloat("w", {1}, &v).IgnoreError();
  return v;
}

TEST_F(CheckpointDirTest, NoCheckpointYet) {
  EXPECT_TRUE(absl::IsNotFound(LatestCheckpointDir(Path("root")).status()));
  ASSERT_EQ(mkdir(Path("root").c_str(), 0755), 0);
  absl::Status s = LatestCheckpointDir(Path("root")).status();
  EXPECT_TRUE(absl::IsNotFound(s));
  EXPECT_THAT(s.message(), HasSubstr("no checkpoint"));
}

TEST_F(CheckpointDirTest, CommitPublishesThroughLatest) {
  const std::string root = Path("a/b/root");  // created with its parents
  absl::StatusOr<std::string> dir = Save(root, 100);
  ASSERT_TRUE(dir.ok()) << dir.status();
  EXPECT_EQ(*dir, root + "/step-00000100");
  EXPECT_EQ(ReadBytes(root + "/latest"), "step-00000100\n");
  EXPECT_THAT(List(root), ElementsAre("latest", "step-00000100"));
  EXPECT_THAT(List(*dir), ElementsAre("manifest.json", "model.safetensors"));
  absl::StatusOr<std::string> latest = LatestCheckpointDir(root);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, *dir);
  absl::StatusOr<v1::CheckpointManifest> m = ReadManifest(*latest);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->step(), 100u);
  EXPECT_EQ(ModelValue(*latest), 100.0f);
}

TEST_F(CheckpointDirTest, KeepsTheNewestAndNeverNewerOnes) {
  const std::string root = Path("root");
  for (uint64_t step : {100, 200, 300}) ASSERT_TRUE(Save(root, step).ok());
  EXPECT_THAT(List(root), ElementsAre("latest", "step-00000200", "step-00000300"));
  ASSERT_TRUE(Save(root, 400, /*keep=*/1).ok());
  EXPECT_THAT(List(root), ElementsAre("latest", "step-00000400"));
  // A run rewound to an earlier step leaves the abandoned newer checkpoint alone.
  ASSERT_TRUE(Save(root, 50, /*keep=*/1).ok());
  EXPECT_THAT(List(root), ElementsAre("latest", "step-00000050", "step-00000400"));
  EXPECT_EQ(*LatestCheckpointDir(root), root + "/step-00000050");
  EXPECT_FALSE(Save(root, 60, /*keep=*/0).ok());
}

TEST_F(CheckpointDirTest, CrashBeforeCommitLeavesThePreviousCheckpoint) {
  const std::string root = Path("root");
  ASSERT_TRUE(Save(root, 100).ok());
  {
    // The writer dies half way: a partial model file in the staging dir, no commit.
    absl::StatusOr<CheckpointStaging> staging = CheckpointStaging::Begin(root, 200);
    ASSERT_TRUE(staging.ok());
    WriteBytes(staging->PathOf("model.safetensors"), "partial");
  }
  EXPECT_THAT(List(root), ElementsAre("latest", "step-00000100", "step-00000200.tmp"));
  absl::StatusOr<std::string> latest = LatestCheckpointDir(root);
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(*latest, root + "/step-00000100");
  EXPECT_TRUE(ReadManifest(*latest).ok());
  EXPECT_EQ(ModelValue(*latest), 100.0f);

  // The next writer (any step) clears the debris first.
  absl::StatusOr<CheckpointStaging> next = CheckpointStaging::Begin(root, 300);
  ASSERT_TRUE(next.ok());
  EXPECT_THAT(List(root), ElementsAre("latest", "step-00000100", "step-00000300.tmp"));
  EXPECT_EQ(next->PathOf("x"), root + "/step-00000300.tmp/x");
}

TEST_F(CheckpointDirTest, CommitChecksTheManifest) {
  const std::string root = Path("root");
  absl::StatusOr<CheckpointStaging> staging = CheckpointStaging::Begin(root, 7);
  ASSERT_TRUE(staging.ok());
  // Names a file that was never written.
  EXPECT_THAT(staging->Commit(Manifest(7)).status().message(),
              HasSubstr("model.safetensors was not written"));
  WriteBytes(staging->PathOf("model.safetensors"), "x");
  EXPECT_THAT(staging->Commit(Manifest(8)).status().message(), HasSubstr("step 8"));
  v1::CheckpointManifest bad = Manifest(7);
  bad.set_format_version(3);
  EXPECT_FALSE(staging->Commit(bad).ok());
  EXPECT_TRUE(absl::IsNotFound(LatestCheckpointDir(root).status()));  // nothing published
  ASSERT_TRUE(staging->Commit(Manifest(7)).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(staging->Commit(Manifest(7)).status()));
}

TEST_F(CheckpointDirTest, RecommittingTheCurrentStepReplacesIt) {
  const std::string root = Path("root");
  ASSERT_TRUE(Save(root, 100).ok());
  absl::StatusOr<CheckpointStaging> staging = CheckpointStaging::Begin(root, 100);
  ASSERT_TRUE(staging.ok());
  const float v = 42;
  ASSERT_TRUE(WriteSafetensors(staging->PathOf("model.safetensors"),
                               {{"w", TensorDType::kF32, {1}, &v, nullptr}}, {})
                  .ok());
  ASSERT_TRUE(staging->Commit(Manifest(100)).ok());
  EXPECT_THAT(List(root), ElementsAre("latest", "step-00000100"));
  EXPECT_EQ(ModelValue(*LatestCheckpointDir(root)), 42.0f);
}

TEST_F(CheckpointDirTest, CorruptLatestIsReported) {
  const std::string root = Path("root");
  ASSERT_TRUE(Save(root, 100).ok());
  WriteBytes(root + "/latest", "step-00000999\n");
  absl::Status s = LatestCheckpointDir(root).status();
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("step-00000999"));
  WriteBytes(root + "/latest", "../elsewhere");
  EXPECT_TRUE(absl::IsDataLoss(LatestCheckpointDir(root).status()));
  // A manifest that does not parse names its file.
  WriteBytes(root + "/step-00000100/manifest.json", "{\"bogus\": 1}");
  EXPECT_THAT(ReadManifest(root + "/step-00000100").status().message(),
              HasSubstr("step-00000100/manifest.json"));
}

// A checkpoint of a model file and one shard file whose sizes and CRC-32s the manifest records,
// as SaveCheckpoint writes them.
absl::StatusOr<std::string> SaveWithDigests(const std::string& root) {
  OFFLOAD_ASSIGN_OR_RETURN(CheckpointStaging staging, CheckpointStaging::Begin(root, 5));
  v1::CheckpointManifest m = Manifest(5);
  const float w[4] = {1, 2, 3, 4};
  FileChecksum checksum;
  OFFLOAD_RETURN_IF_ERROR(WriteSafetensors(staging.PathOf("model.safetensors"),
                                           {{"w", TensorDType::kF32, {4}, w, nullptr}}, {},
                                           &checksum));
  m.mutable_model_file_digest()->set_bytes(checksum.bytes);
  m.mutable_model_file_digest()->set_crc32(checksum.crc32);
  std::vector<float> state(1000);
  for (size_t i = 0; i < state.size(); ++i) state[i] = 0.5f * static_cast<float>(i);
  OFFLOAD_RETURN_IF_ERROR(WriteSafetensors(
      staging.PathOf("shard-0.safetensors"),
      {{"master.0", TensorDType::kF32, {1000}, state.data(), nullptr}}, {}, &checksum));
  v1::ShardFile* f = m.add_shard_files();
  f->set_file("shard-0.safetensors");
  f->mutable_digest()->set_bytes(checksum.bytes);
  f->mutable_digest()->set_crc32(checksum.crc32);
  return staging.Commit(m);
}

TEST_F(CheckpointDirTest, VerifyRefusesATruncatedExtendedOrAlteredFileNamingIt) {
  absl::StatusOr<std::string> dir = SaveWithDigests(Path("root"));
  ASSERT_TRUE(dir.ok()) << dir.status();
  absl::StatusOr<v1::CheckpointManifest> m = ReadManifest(*dir);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(m->has_model_file_digest());
  ASSERT_TRUE(m->shard_files(0).has_digest());
  EXPECT_TRUE(VerifyCheckpointFiles(*dir, *m).ok());

  const std::string shard = *dir + "/shard-0.safetensors";
  const std::string pristine = ReadBytes(shard);
  const std::string size = absl::StrCat(pristine.size());
  ASSERT_EQ(absl::StrCat(m->shard_files(0).digest().bytes()), size);

  WriteBytes(shard, pristine.substr(0, pristine.size() - 1));
  absl::Status s = VerifyCheckpointFiles(*dir, *m);
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr(shard), HasSubstr(absl::StrCat(pristine.size() - 1)),
                                 HasSubstr(size), HasSubstr("truncated")));

  WriteBytes(shard, pristine + "x");
  s = VerifyCheckpointFiles(*dir, *m);
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr(shard), HasSubstr("extended")));

  // One bit of a tensor's data (the last byte: well past the header), same size.
  std::string flipped = pristine;
  flipped.back() ^= 0x01;
  WriteBytes(shard, flipped);
  s = VerifyFileDigest(shard, m->shard_files(0).digest());
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  const uint32_t got = Crc32Update(0, flipped.data(), static_cast<int64_t>(flipped.size()));
  EXPECT_THAT(s.message(),
              AllOf(HasSubstr(shard), HasSubstr(absl::StrFormat("CRC-32 %08x", got)),
                    HasSubstr(absl::StrFormat("%08x", m->shard_files(0).digest().crc32()))));
  EXPECT_EQ(VerifyCheckpointFiles(*dir, *m), s);
  WriteBytes(shard, pristine);
  EXPECT_TRUE(VerifyCheckpointFiles(*dir, *m).ok());

  // The model file is checked as well.
  const std::string model = *dir + "/model.safetensors";
  const std::string model_bytes = ReadBytes(model);
  std::string altered = model_bytes;
  altered[altered.size() - 3] ^= 0x40;
  WriteBytes(model, altered);
  s = VerifyCheckpointFiles(*dir, *m);
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr(model), HasSubstr("CRC-32")));

  // A manifest written before digests existed records none: its files pass unchecked.
  v1::CheckpointManifest old = *m;
  old.clear_model_file_digest();
  old.mutable_shard_files(0)->clear_digest();
  EXPECT_TRUE(VerifyCheckpointFiles(*dir, old).ok());
  // A missing file is named.
  WriteBytes(model, model_bytes);
  ASSERT_EQ(unlink(shard.c_str()), 0);
  EXPECT_THAT(VerifyCheckpointFiles(*dir, *m).message(), HasSubstr(shard));
}

}  // namespace
}  // namespace offload
