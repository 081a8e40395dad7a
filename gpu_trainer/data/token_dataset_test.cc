// Loading text and llm.c token shards, every malformed shard header, and the train/val split.
#include "gpu_trainer/data/token_dataset.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace offload {
namespace {

using ::testing::HasSubstr;

class TokenDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "/token_dataset_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::system(("rm -rf '" + dir_ + "'").c_str()); }

  std::string WriteFile(const std::string& name, const std::string& bytes) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }

  // An llm.c shard; header fields and the token payload can be made inconsistent on purpose.
  std::string WriteShard(const std::string& name, const std::vector<uint16_t>& tokens,
                         int32_t magic = kTokenShardMagic, int32_t version = kTokenShardVersion,
                         std::optional<int32_t> count = std::nullopt) {
    int32_t header[256] = {};
    header[0] = magic;
    header[1] = version;
    header[2] = count.value_or(static_cast<int32_t>(tokens.size()));
    std::string bytes(reinterpret_cast<const char*>(header), sizeof(header));
    bytes.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
    return WriteFile(name, bytes);
  }

  std::string dir_;
};

TEST_F(TokenDatasetTest, TextIsBytes) {
  const std::string path = WriteFile("a.txt", "hi\xff");
  absl::StatusOr<TokenDataset> d = TokenDataset::FromTextFile(path);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->vocab_size(), 256);
  ASSERT_EQ(d->size(), 3);
  EXPECT_EQ(d->tokens()[0], 'h');
  EXPECT_EQ(d->tokens()[2], 255);
  // Open picks the text reader for anything not .bin.
  absl::StatusOr<TokenDataset> o = TokenDataset::Open(path);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->size(), 3);
}

TEST_F(TokenDatasetTest, TextMissingOrEmpty) {
  absl::StatusOr<TokenDataset> missing = TokenDataset::FromTextFile(dir_ + "/nope.txt");
  EXPECT_TRUE(absl::IsNotFound(missing.status())) << missing.status();
  EXPECT_THAT(missing.status().message(), HasSubstr("nope.txt"));
  absl::StatusOr<TokenDataset> empty = TokenDataset::FromTextFile(WriteFile("e.txt", ""));
  EXPECT_THAT(empty.status().message(), HasSubstr("is empty"));
}

TEST_F(TokenDatasetTest, ShardsConcatenateInOrder) {
  const std::string a = WriteShard("s_000.bin", {1, 2, 3});
  const std::string b = WriteShard("s_001.bin", {50256, 7});
  absl::StatusOr<TokenDataset> d = TokenDataset::FromTokenShards({b, a});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->vocab_size(), kGpt2VocabSize);
  EXPECT_EQ(std::vector<uint16_t>(d->tokens(), d->tokens() + d->size()),
            (std::vector<uint16_t>{50256, 7, 1, 2, 3}));

  absl::StatusOr<TokenDataset> one = TokenDataset::Open(a);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->size(), 3);

  // A glob sorts its matches, so s_000 comes first whatever the order on disk.
  absl::StatusOr<TokenDataset> g = TokenDataset::Open(dir_ + "/s_*.bin");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(std::vector<uint16_t>(g->tokens(), g->tokens() + g->size()),
            (std::vector<uint16_t>{1, 2, 3, 50256, 7}));
}

TEST_F(TokenDatasetTest, LargeTokenIdWidensVocab) {
  absl::StatusOr<TokenDataset> d = TokenDataset::FromTokenShards({WriteShard("v.bin", {60000})});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->vocab_size(), 60001);
}

TEST_F(TokenDatasetTest, GlobWithoutMatchIsError) {
  absl::StatusOr<TokenDataset> d = TokenDataset::Open(dir_ + "/none_*.bin");
  EXPECT_THAT(d.status().message(), HasSubstr("no file matches"));
}

TEST_F(TokenDatasetTest, BadHeadersNameFileExpectedAndFound) {
  struct Case {
    std::string path;
    std::vector<std::string> message;
  };
  std::vector<Case> cases = {
      {WriteShard("magic.bin", {1}, 12345), {"magic.bin", "bad magic", "20240520", "12345"}},
      {WriteShard("version.bin", {1}, kTokenShardMagic, 2),
       {"version.bin", "version", "expected 1", "found 2"}},
      {WriteShard("short.bin", {1, 2}, kTokenShardMagic, 1, 3),
       {"short.bin", "bad size", "expected 1030", "found 1028"}},
      {WriteShard("long.bin", {1, 2}, kTokenShardMagic, 1, 1),
       {"long.bin", "bad size", "expected 1026", "found 1028"}},
      {WriteShard("negative.bin", {}, kTokenShardMagic, 1, -5), {"negative.bin", "-5"}},
      {WriteFile("trunc.bin", std::string(100, '\0')),
       {"trunc.bin", "truncated header", "1024", "100 bytes"}},
  };
  for (const Case& c : cases) {
    absl::StatusOr<TokenDataset> d = TokenDataset::Open(c.path);
    ASSERT_FALSE(d.ok()) << c.path;
    for (const std::string& part : c.message) {
      EXPECT_THAT(d.status().message(), HasSubstr(part)) << c.path;
    }
  }
}

TEST_F(TokenDatasetTest, EmptyShardsAreAnError) {
  absl::StatusOr<TokenDataset> d = TokenDataset::FromTokenShards({WriteShard("z.bin", {})});
  EXPECT_THAT(d.status().message(), HasSubstr("hold no tokens"));
}

TEST_F(TokenDatasetTest, SplitTrainVal) {
  absl::StatusOr<TokenDataset> d =
      TokenDataset::FromTextFile(WriteFile("t.txt", std::string(100, 'x')));
  ASSERT_TRUE(d.ok());
  auto split = SplitTrainVal(*d, 0.1, 8);
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(split->first.tokens, d->tokens());
  EXPECT_EQ(split->first.size, 90);
  EXPECT_EQ(split->second.tokens, d->tokens() + 90);
  EXPECT_EQ(split->second.size, 10);

  EXPECT_THAT(SplitTrainVal(*d, 0.1, 10).status().message(), HasSubstr("seq_len + 1 = 11"));
  EXPECT_THAT(SplitTrainVal(*d, 0.95, 8).status().message(), HasSubstr("5 train"));
  EXPECT_FALSE(SplitTrainVal(*d, 0.0, 8).ok());
  EXPECT_FALSE(SplitTrainVal(*d, 1.0, 8).ok());
  EXPECT_FALSE(SplitTrainVal(*d, 0.1, 0).ok());
}

}  // namespace
}  // namespace offload
