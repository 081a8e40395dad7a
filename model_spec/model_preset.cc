#include "model_spec/model_preset.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace offload {

bool IsTokenShards(const std::string& data) {
  return absl::EndsWith(data, ".bin") || absl::StrContains(data, "*");
}

absl::StatusOr<Gpt2Config> ModelPreset(const std::string& name, int vocab_size,
                                       const std::string& data) {
  Gpt2Config c;
  if (name == "demo") {
    c = Gpt2Config{256, 128, 4, 4, 128};
  } else if (name == "gpt2") {
    c = Gpt2Config{50257, 1024, 12, 12, 768};
  } else if (name == "gpt2-medium") {
    c = Gpt2Config{50257, 1024, 24, 16, 1024};
  } else if (name == "gpt2-large") {
    c = Gpt2Config{50257, 1024, 36, 20, 1280};
  } else if (name == "gpt2-xl") {
    c = Gpt2Config{50257, 1024, 48, 25, 1600};
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--model: unknown preset '", name, "' (demo, gpt2, gpt2-medium, gpt2-large, gpt2-xl)"));
  }
  c.vocab_size = vocab_size > 0 ? vocab_size : IsTokenShards(data) ? 50257 : 256;
  return c;
}

}  // namespace offload
