// libFuzzer target: TokenDataset::FromTokenShards on one arbitrary llm.c .bin shard. Training data
// comes from wherever --data points (downloads, other tools' output), and a shard's header says
// how many tokens to read, so a lying header must be refused before anything is read or sized
// from it.
//
// The input is the whole .bin file (int32 header[256] | uint16 tokens[n]), written to a memfd (no
// disk) that the reader opens by its /proc/self/fd path. An accepted shard must hold exactly the
// header's count of tokens, equal to the file's, with a vocabulary that covers every token.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "base/testing/fuzz_util.h"
#include "gpu_trainer/data/token_dataset.h"

namespace offload {
namespace {

void Check(bool ok, const char* what) {
  if (!ok) FuzzFail("token_shard_fuzz", "broken promise", what);
}

void Run(const uint8_t* data, size_t size) {
  static FuzzInputFile* const file = new FuzzInputFile("token_shard_fuzz");
  const std::string& path = file->Write(data, size);
  absl::StatusOr<TokenDataset> d = TokenDataset::FromTokenShards({path});
  if (!d.ok()) return;

  Check(size >= 1024 && (size - 1024) % 2 == 0, "accepted a file of impossible size");
  const int64_t n = static_cast<int64_t>(size - 1024) / 2;
  Check(d->size() == n, "token count differs from the file's");
  Check(std::memcmp(d->tokens(), data + 1024, static_cast<size_t>(n) * 2) == 0,
        "tokens differ from the file's");
  for (int64_t i = 0; i < n; ++i) Check(d->tokens()[i] < d->vocab_size(), "token >= vocab size");

  // What the trainer does next with the stream; its refusals are Statuses too.
  for (int seq_len : {1, 8, 64}) {
    absl::StatusOr<std::pair<TokenSpan, TokenSpan>> split = SplitTrainVal(*d, 0.1, seq_len);
    if (!split.ok()) continue;
    Check(split->first.size + split->second.size == n, "the split loses tokens");
    Check(split->first.size > seq_len && split->second.size > seq_len, "a side is too short");
  }
}

}  // namespace
}  // namespace offload

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  offload::Run(data, size);
  return 0;
}
