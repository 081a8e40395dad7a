// Batches of (B, T) token windows for training and evaluation. Row b of a batch is the window
// tokens[o, o+T] (T+1 tokens): inputs are its first T, targets the same shifted by one.
#ifndef OFFLOAD_GPU_TRAINER_DATA_BATCH_SAMPLER_H_
#define OFFLOAD_GPU_TRAINER_DATA_BATCH_SAMPLER_H_

#include <cstdint>

#include "absl/status/status.h"
#include "gpu_trainer/data/token_dataset.h"
#include "offload/v1/checkpoint.pb.h"

namespace offload {

// Training batches from uniformly drawn window offsets. The stream is fully determined by
// (seed, batches drawn), so a checkpoint restores it exactly. The RNG is splitmix64 with our own
// unbiased bounded draw: std:: distributions differ between standard libraries.
class BatchSampler {
 public:
  // Requires span.size >= seq_len + 1, batch >= 1, seq_len >= 1 (SplitTrainVal guarantees the
  // first); aborts with a message otherwise, as that is a programming error.
  BatchSampler(TokenSpan span, int batch, int seq_len, uint64_t seed);

  // inputs, targets: (B, T).
  void Next(int32_t* inputs, int32_t* targets);

  v1::DataPosition Position() const;
  // Checks that `p` follows from this sampler's seed, batch shape and span (by replaying the
  // draws) before adopting it: a checkpoint from another seed, batch size or dataset would
  // otherwise resume a different data stream silently.
  absl::Status Restore(const v1::DataPosition& p);

 private:
  uint64_t NextOffset(uint64_t* state) const;

  TokenSpan span_;
  int batch_;
  int seq_len_;
  uint64_t seed_;
  uint64_t state_;
  uint64_t batches_drawn_ = 0;
};

// The index-th validation batch: consecutive non-overlapping windows of the span (window w
// starts at w*T), wrapping around at the end, so every evaluation sees the same data. Same
// preconditions as BatchSampler.
void ValidationBatch(TokenSpan span, int batch, int seq_len, int64_t index, int32_t* inputs,
                     int32_t* targets);

// How many validation batches fit without wrapping (at least 1).
int64_t NumValidationBatches(TokenSpan span, int batch, int seq_len);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_DATA_BATCH_SAMPLER_H_
