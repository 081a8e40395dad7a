// Training data as one token stream held in memory as uint16 (vocab <= 65536), from plain text
// (bytes, vocab 256) or from GPT-2 token shards in llm.c's .bin format:
//
//   int32 header[256] (little endian): [0] magic 20240520, [1] version 1, [2] token count n
//   uint16 tokens[n]
#ifndef OFFLOAD_GPU_TRAINER_DATA_TOKEN_DATASET_H_
#define OFFLOAD_GPU_TRAINER_DATA_TOKEN_DATASET_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace offload {

inline constexpr int32_t kTokenShardMagic = 20240520;
inline constexpr int32_t kTokenShardVersion = 1;
inline constexpr int kTokenShardHeaderInts = 256;
inline constexpr int kGpt2VocabSize = 50257;

class TokenDataset {
 public:
  // Plain text as bytes: vocab 256. A missing or empty file is an error.
  static absl::StatusOr<TokenDataset> FromTextFile(const std::string& path);
  // llm.c token shards, concatenated in the given order. The file size must be exactly
  // 1024 + 2 * n; errors name the file, what was expected and what was found.
  static absl::StatusOr<TokenDataset> FromTokenShards(const std::vector<std::string>& paths);
  // `spec` is a text file, a .bin file, or a glob pattern of .bin files (sorted; no match is
  // an error).
  static absl::StatusOr<TokenDataset> Open(const std::string& spec);

  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  // 256 for text; 50257 (GPT-2) for token shards, or larger if a token id says so.
  int vocab_size() const { return vocab_size_; }
  const uint16_t* tokens() const { return tokens_.data(); }

 private:
  TokenDataset(std::vector<uint16_t> tokens, int vocab_size)
      : tokens_(std::move(tokens)), vocab_size_(vocab_size) {}

  std::vector<uint16_t> tokens_;
  int vocab_size_ = 0;
};

struct TokenSpan {
  const uint16_t* tokens = nullptr;
  int64_t size = 0;
};

// Train / validation split: the last val_fraction of the stream is validation. Contiguous, so
// no window straddles both. Error if either side is shorter than seq_len + 1 (one window).
absl::StatusOr<std::pair<TokenSpan, TokenSpan>> SplitTrainVal(const TokenDataset& d,
                                                              double val_fraction, int seq_len);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_DATA_TOKEN_DATASET_H_
