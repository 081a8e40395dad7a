#include "model_spec/model_preset.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace offload {

bool IsTokenShards(const std::string& data) {
  return absl::EndsWith(data, ".bin") || absl::StrContains(data, "*");
}

absl::StatusOr<Gpt2Config> ResolveModel(const ModelShape& shape, const std::string& data,
                                        absl::string_view preset_field,
                                        absl::string_view shape_field) {
  Gpt2Config c;
  const std::string& name = shape.preset;
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
    return absl::InvalidArgumentError(absl::StrCat(preset_field, ": unknown preset '", name,
                                                   "' (demo, gpt2, gpt2-medium, gpt2-large, "
                                                   "gpt2-xl)"));
  }
  c.vocab_size = shape.vocab > 0 ? shape.vocab : IsTokenShards(data) ? 50257 : 256;
  if (shape.layers > 0) c.num_layers = shape.layers;
  if (shape.heads > 0) c.num_heads = shape.heads;
  if (shape.channels > 0) c.channels = shape.channels;
  if (shape.context > 0) c.context_length = shape.context;
  absl::Status valid = ValidateGpt2Config(c);
  if (!valid.ok() && !shape_field.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(shape_field, ": ", valid.message()));
  }
  OFFLOAD_RETURN_IF_ERROR(valid);
  return c;
}

}  // namespace offload
