#include "gpu_trainer/data/batch_sampler.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "base/splitmix64.h"

namespace offload {

namespace {

void CheckShape(TokenSpan span, int batch, int seq_len, const char* who) {
  CHECK(batch >= 1 && seq_len >= 1 && span.tokens != nullptr && span.size >= int64_t{seq_len} + 1)
      << who << ": needs batch >= 1, seq_len >= 1 and a span of at least seq_len + 1 tokens; got "
      << "batch " << batch << ", seq_len " << seq_len << ", span of " << span.size << " tokens";
}

// Row b of (B, T) inputs/targets from the window starting at o.
void CopyWindow(const uint16_t* tokens, int64_t o, int seq_len, int32_t* inputs, int32_t* targets) {
  for (int t = 0; t < seq_len; ++t) {
    inputs[t] = tokens[o + t];
    targets[t] = tokens[o + t + 1];
  }
}

}  // namespace

BatchSampler::BatchSampler(TokenSpan span, int batch, int seq_len, uint64_t seed)
    : span_(span), batch_(batch), seq_len_(seq_len), seed_(seed), state_(seed) {
  CheckShape(span, batch, seq_len, "BatchSampler");
}

// Uniform in [0, span.size - T): every window start whose T+1 tokens fit. Draws below
// 2^64 mod n are rejected so that no offset is favoured (modulo bias).
uint64_t BatchSampler::NextOffset(uint64_t* state) const {
  const uint64_t n = static_cast<uint64_t>(span_.size - seq_len_);
  const uint64_t threshold = (0 - n) % n;
  for (;;) {
    const uint64_t r = SplitMix64(state);
    if (r >= threshold) return r % n;
  }
}

void BatchSampler::Next(int32_t* inputs, int32_t* targets) {
  for (int b = 0; b < batch_; ++b) {
    const int64_t o = static_cast<int64_t>(NextOffset(&state_));
    CopyWindow(span_.tokens, o, seq_len_, inputs + int64_t{b} * seq_len_,
               targets + int64_t{b} * seq_len_);
  }
  ++batches_drawn_;
}

v1::DataPosition BatchSampler::Position() const {
  v1::DataPosition p;
  p.set_rng_state(state_);
  p.set_batches_drawn(batches_drawn_);
  return p;
}

absl::Status BatchSampler::Restore(const v1::DataPosition& p) {
  // Replaying is cheap (a few ns per row: a million steps of batch 64 take well under a second)
  // and proves the position belongs to this stream.
  uint64_t state = seed_;
  for (uint64_t i = 0; i < p.batches_drawn(); ++i) {
    for (int b = 0; b < batch_; ++b) NextOffset(&state);
  }
  if (state != p.rng_state()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "data position (rng_state ", p.rng_state(), ", batches_drawn ", p.batches_drawn(),
        ") does not follow from seed ", seed_, " with batch ", batch_, ", seq_len ", seq_len_,
        " over ", span_.size, " tokens: was it saved with another seed, batch shape or dataset?"));
  }
  state_ = state;
  batches_drawn_ = p.batches_drawn();
  return absl::OkStatus();
}

int64_t NumValidationBatches(TokenSpan span, int batch, int seq_len) {
  CheckShape(span, batch, seq_len, "NumValidationBatches");
  const int64_t windows = (span.size - 1) / seq_len;
  return std::max<int64_t>(1, windows / batch);
}

void ValidationBatch(TokenSpan span, int batch, int seq_len, int64_t index, int32_t* inputs,
                     int32_t* targets) {
  CheckShape(span, batch, seq_len, "ValidationBatch");
  // Window w covers tokens [w*T, w*T + T]; the last one must end inside the span.
  const int64_t windows = (span.size - 1) / seq_len;
  const int64_t first = (index % windows + windows) % windows;  // any index, even negative
  for (int b = 0; b < batch; ++b) {
    // 128-bit so a huge span with a large batch cannot overflow the window index.
    const int64_t w = static_cast<int64_t>((static_cast<__int128>(first) * batch + b) % windows);
    CopyWindow(span.tokens, w * seq_len, seq_len, inputs + int64_t{b} * seq_len,
               targets + int64_t{b} * seq_len);
  }
}

}  // namespace offload
