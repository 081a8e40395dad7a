#include "model_spec/gpt2_config.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace offload {
namespace {

// Generous bounds (GPT-2 XL: vocab 50257, context 1024, 48 layers, 25 heads, 1600 channels) that
// keep every product the model forms, e.g. B*NH*T*T or V*C, well inside int64.
constexpr int kMaxVocab = 1 << 20;
constexpr int kMaxContext = 1 << 16;
constexpr int kMaxLayers = 1024;
constexpr int kMaxHeads = 1024;
constexpr int kMaxChannels = 1 << 16;

absl::Status CheckRange(absl::string_view field, int value, int max) {
  if (value <= 0 || value > max) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gpt2Config.", field, " = ", value, ": must be in [1, ", max, "]"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateGpt2Config(const Gpt2Config& c) {
  for (absl::Status s : {CheckRange("vocab_size", c.vocab_size, kMaxVocab),
                         CheckRange("context_length", c.context_length, kMaxContext),
                         CheckRange("num_layers", c.num_layers, kMaxLayers),
                         CheckRange("num_heads", c.num_heads, kMaxHeads),
                         CheckRange("channels", c.channels, kMaxChannels)}) {
    if (!s.ok()) return s;
  }
  if (c.channels % c.num_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Gpt2Config.channels = ", c.channels, ": must be divisible by num_heads = ", c.num_heads));
  }
  return absl::OkStatus();
}

double Gpt2FlopsPerToken(const Gpt2Config& c, int T) {
  const double L = c.num_layers, C = c.channels, V = c.vocab_size;
  const double matmul_weights = 12.0 * L * C * C + V * C;
  return 6.0 * matmul_weights + 12.0 * L * C * T;
}

}  // namespace offload
