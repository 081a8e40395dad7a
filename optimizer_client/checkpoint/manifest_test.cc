// Strict manifest parsing: round trip, unknown fields, version, required parts.
#include "optimizer_client/checkpoint/manifest.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "google/protobuf/util/message_differencer.h"

namespace offload {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

v1::CheckpointManifest Example() {
  v1::CheckpointManifest m;
  m.set_format_version(1);
  m.mutable_model()->set_vocab_size(50257);
  m.mutable_model()->set_context_length(1024);
  m.mutable_model()->set_num_layers(12);
  m.mutable_model()->set_num_heads(12);
  m.mutable_model()->set_channels(768);
  m.set_param_dtype(v1::DTYPE_BF16);
  m.set_step(100);
  m.set_seed(1337);
  m.mutable_partition()->set_num_params(124439808);
  m.mutable_partition()->set_padded_length(124439808);
  m.mutable_partition()->set_world_size(1);
  m.mutable_partition()->set_num_shards(1);
  v1::ShardSlice* slice = m.mutable_partition()->add_slices();
  slice->set_length(124439808);
  m.mutable_data()->set_rng_state(0xfedcba9876543210ull);  // above 2^53: JSON must keep it exact
  m.mutable_data()->set_batches_drawn(100);
  m.mutable_loss_scale()->set_scale(1);
  m.set_grad_clip(1.0f);
  m.set_model_file("model.safetensors");
  v1::ShardFile* f = m.add_shard_files();
  f->set_file("shard-0.safetensors");
  f->set_completed_step(100);
  f->mutable_digest()->set_bytes(uint64_t{3} << 40);  // above 2^32
  f->mutable_digest()->set_crc32(0xfedcba98u);        // above 2^31
  m.mutable_model_file_digest()->set_bytes(248879744);
  m.mutable_model_file_digest()->set_crc32(0);  // a CRC may be 0: the message marks presence
  m.set_train_loss(3.25f);
  return m;
}

TEST(ManifestTest, RoundTrip) {
  const v1::CheckpointManifest m = Example();
  const std::string json = ManifestToJson(m);
  EXPECT_THAT(json, HasSubstr("\"model_file\": \"model.safetensors\""));  // pretty, proto names
  EXPECT_THAT(json, HasSubstr("\"val_loss\": 0"));                        // zeros printed too
  absl::StatusOr<v1::CheckpointManifest> back = ParseManifestJson(json);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(m, *back)) << back->DebugString();
}

// Found by manifest_fuzz: "-0.0" parsed to a negative zero, which prints as "-0" and reads back
// as +0, so what a resume read was not what the checkpoint wrote.
TEST(ManifestTest, NegativeZeroReadsAsZeroAndRoundTrips) {
  absl::StatusOr<v1::CheckpointManifest> m = ParseManifestJson(
      R"({"format_version": 1, "model": {}, "partition": {}, "param_dtype": "DTYPE_FP16",
          "model_file": "m", "grad_clip": -0.0, "schedule": {"min_lr": -0.0}})");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(std::signbit(m->grad_clip()));
  EXPECT_FALSE(std::signbit(m->schedule().min_lr()));
  absl::StatusOr<v1::CheckpointManifest> back = ParseManifestJson(ManifestToJson(*m));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->SerializeAsString(), m->SerializeAsString());
}

// A checkpoint written before the file digests existed still reads, with none recorded.
TEST(ManifestTest, FileDigestsAreOptional) {
  absl::StatusOr<v1::CheckpointManifest> m = ParseManifestJson(
      R"({"format_version": 1, "model": {}, "partition": {}, "param_dtype": "DTYPE_FP16",
          "model_file": "m", "shard_files": [{"file": "shard-0.safetensors"}]})");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(m->has_model_file_digest());
  EXPECT_FALSE(m->shard_files(0).has_digest());
  EXPECT_THAT(ManifestToJson(*m), Not(HasSubstr("digest")));
  // Printed with digests: a CRC of 0 keeps its message, so it reads back as recorded.
  const std::string json = ManifestToJson(Example());
  EXPECT_THAT(json, HasSubstr("\"crc32\": 4275878552"));
  absl::StatusOr<v1::CheckpointManifest> back = ParseManifestJson(json);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->has_model_file_digest());
  EXPECT_EQ(back->model_file_digest().crc32(), 0u);
}

TEST(ManifestTest, AcceptsCamelCaseNames) {
  absl::StatusOr<v1::CheckpointManifest> m = ParseManifestJson(
      R"({"formatVersion": 1, "model": {}, "partition": {}, "paramDtype": "DTYPE_FP16",
          "modelFile": "m.safetensors"})");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->param_dtype(), v1::DTYPE_FP16);
}

TEST(ManifestTest, RejectsUnknownFieldsAndBadValues) {
  const std::string base = R"("format_version": 1, "model": {}, "partition": {},
      "param_dtype": "DTYPE_BF16", "model_file": "model.safetensors")";
  struct Case {
    std::string json;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"{" + base + R"(, "stpe": 3})", "stpe"},
      {"{" + base + R"(, "model": {"layers": 3}})", "layers"},
      {R"({"format_version": 2, "model": {}, "partition": {}, "param_dtype": "DTYPE_BF16",
           "model_file": "m"})",
       "format_version is 2"},
      {R"({"format_version": 1, "partition": {}, "param_dtype": "DTYPE_BF16",
           "model_file": "m"})",
       "model is missing"},
      {R"({"format_version": 1, "model": {}, "param_dtype": "DTYPE_BF16", "model_file": "m"})",
       "partition is missing"},
      {R"({"format_version": 1, "model": {}, "partition": {}, "param_dtype": "DTYPE_FP32",
           "model_file": "m"})",
       "param_dtype is DTYPE_FP32"},
      {R"({"format_version": 1, "model": {}, "partition": {}, "param_dtype": "DTYPE_BF16"})",
       "model_file is empty"},
      {R"({"format_version": 1, "model": {}, "partition": {}, "param_dtype": "DTYPE_BF16",
           "model_file": "../x"})",
       "model_file is '../x'"},
      {"{" + base + R"(, "shard_files": [{"file": "/etc/passwd"}]})", "shard_files[0].file"},
      {"{" + base + R"(, "model_file_digest": {"bytes": "8", "crc32": 4294967296}})",
       "not a valid CheckpointManifest"},
      {"{" + base + R"(, "model_file_digest": {"size": 8}})", "size"},
      {"[]", "not a valid CheckpointManifest"},
      {"{" + base, "not a valid CheckpointManifest"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<v1::CheckpointManifest> m = ParseManifestJson(c.json);
    ASSERT_FALSE(m.ok()) << c.json;
    EXPECT_THAT(m.status().message(), HasSubstr(c.message)) << c.json;
  }
}

}  // namespace
}  // namespace offload
