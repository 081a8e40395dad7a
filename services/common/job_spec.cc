#include "services/common/job_spec.h"

#include <cmath>
#include <cstdint>
#include <exception>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "base/status_macros.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/util/json_util.h"
#include "yaml-cpp/yaml.h"

namespace offload {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

// A job file is a few hundred bytes; anything much larger is a mistake (or an attack on the
// parser) and is refused before yaml-cpp sees it.
constexpr size_t kMaxSpecBytes = 1 << 20;

absl::Status Invalid(absl::string_view where, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": ", problem));
}

// A value as it was written, quoted and cut short, for error messages.
std::string Quote(absl::string_view text) {
  constexpr size_t kMax = 64;
  if (text.size() <= kMax) return absl::StrCat("\"", absl::CEscape(text), "\"");
  return absl::StrCat("\"", absl::CEscape(text.substr(0, kMax)), "...\"");
}

std::string JoinPath(absl::string_view parent, absl::string_view name) {
  if (parent.empty()) return std::string(name);
  if (name.empty()) return std::string(parent);
  return absl::StrCat(parent, ".", name);
}

// ---- Scalars: one parser for YAML scalars and for flag values, so both accept the same text. ----

bool IsDecimalInteger(absl::string_view s) {
  if (!s.empty() && (s[0] == '+' || s[0] == '-')) s.remove_prefix(1);
  if (s.empty()) return false;
  for (char c : s) {
    if (!absl::ascii_isdigit(c)) return false;
  }
  return true;
}

// [+-] digits [. digits] [e [+-] digits], also ".5" and "5.": the decimal forms YAML and JSON
// share. Hex floats and the like are not numbers a person writes in a job file.
bool IsDecimalNumber(absl::string_view s) {
  size_t i = 0;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
  size_t digits = 0;
  while (i < s.size() && absl::ascii_isdigit(s[i])) ++i, ++digits;
  if (i < s.size() && s[i] == '.') {
    ++i;
    while (i < s.size() && absl::ascii_isdigit(s[i])) ++i, ++digits;
  }
  if (digits == 0) return false;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
    size_t exp_digits = 0;
    while (i < s.size() && absl::ascii_isdigit(s[i])) ++i, ++exp_digits;
    if (exp_digits == 0) return false;
  }
  return i == s.size();
}

// The spellings of infinity and NaN in YAML (.inf, .nan) and in protobuf JSON (Infinity, NaN).
// They parse so that ValidateJobSpec can say "must be finite" about the right field.
bool ParseSpecialFloat(absl::string_view s, double* out) {
  const std::string lower = absl::AsciiStrToLower(s);
  if (lower == ".inf" || lower == "+.inf" || lower == "inf" || lower == "+inf" ||
      lower == "infinity" || lower == "+infinity") {
    *out = std::numeric_limits<double>::infinity();
  } else if (lower == "-.inf" || lower == "-inf" || lower == "-infinity") {
    *out = -std::numeric_limits<double>::infinity();
  } else if (lower == ".nan" || lower == "nan") {
    *out = std::numeric_limits<double>::quiet_NaN();
  } else {
    return false;
  }
  return true;
}

absl::string_view ExpectedKind(const FieldDescriptor* field) {
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
    case FieldDescriptor::CPPTYPE_INT64:
      return "an integer";
    case FieldDescriptor::CPPTYPE_UINT32:
    case FieldDescriptor::CPPTYPE_UINT64:
      return "a non-negative integer";
    case FieldDescriptor::CPPTYPE_FLOAT:
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return "a number";
    case FieldDescriptor::CPPTYPE_BOOL:
      return "true or false";
    case FieldDescriptor::CPPTYPE_STRING:
      return "a string";
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return "a map of fields";
    case FieldDescriptor::CPPTYPE_ENUM:  // refused before anyone asks: UnsupportedField
      break;
  }
  return "a value";
}

// JobSpec has no repeated and no enum fields, so the readers below handle neither; one added to
// job.proto must be refused by name rather than half read.
absl::Status UnsupportedField(const FieldDescriptor* field, absl::string_view where) {
  const bool repeated = field->is_repeated();
  if (!repeated && field->cpp_type() != FieldDescriptor::CPPTYPE_ENUM) return absl::OkStatus();
  return Invalid(where, absl::StrCat(field->full_name(), " is ", repeated ? "repeated" : "an enum",
                                     ", which job specs do not support"));
}

absl::Status OutOfRange(absl::string_view where, absl::string_view text, absl::string_view type,
                        absl::string_view range) {
  return Invalid(where, absl::StrCat(text, " is out of range for ", type, " (", range, ")"));
}

// Parses a signed integer and checks it against [lo, hi].
absl::Status ParseSigned(absl::string_view where, absl::string_view text, int64_t lo, int64_t hi,
                         absl::string_view type, int64_t* out) {
  if (!IsDecimalInteger(text)) {
    return Invalid(where, absl::StrCat("expected an integer, got ", Quote(text)));
  }
  int64_t v = 0;
  if (!absl::SimpleAtoi(text, &v) || v < lo || v > hi) {
    return OutOfRange(where, text, type, absl::StrCat(lo, " to ", hi));
  }
  *out = v;
  return absl::OkStatus();
}

absl::Status ParseUnsigned(absl::string_view where, absl::string_view text, uint64_t hi,
                           absl::string_view type, uint64_t* out) {
  if (!IsDecimalInteger(text)) {
    return Invalid(where, absl::StrCat("expected a non-negative integer, got ", Quote(text)));
  }
  const std::string range = absl::StrCat("0 to ", hi);
  if (text[0] == '-') {
    // "-0" is zero; every other negative number is out of range.
    int64_t v = 0;
    if (!absl::SimpleAtoi(text, &v) || v != 0) return OutOfRange(where, text, type, range);
    *out = 0;
    return absl::OkStatus();
  }
  uint64_t v = 0;
  if (!absl::SimpleAtoi(text, &v) || v > hi) return OutOfRange(where, text, type, range);
  *out = v;
  return absl::OkStatus();
}

// Parses `text` into `field` of `message`. `where` names the field in errors: a path in a job
// file, "--lr" for a flag.
absl::Status StoreScalar(Message* message, const FieldDescriptor* field, absl::string_view text,
                         absl::string_view where) {
  OFFLOAD_RETURN_IF_ERROR(UnsupportedField(field, where));
  const Reflection* r = message->GetReflection();
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: {
      int64_t v = 0;
      OFFLOAD_RETURN_IF_ERROR(ParseSigned(where, text, std::numeric_limits<int32_t>::min(),
                                          std::numeric_limits<int32_t>::max(), "int32", &v));
      r->SetInt32(message, field, static_cast<int32_t>(v));
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_INT64: {
      int64_t v = 0;
      OFFLOAD_RETURN_IF_ERROR(ParseSigned(where, text, std::numeric_limits<int64_t>::min(),
                                          std::numeric_limits<int64_t>::max(), "int64", &v));
      r->SetInt64(message, field, v);
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_UINT32: {
      uint64_t v = 0;
      if (absl::Status s =
              ParseUnsigned(where, text, std::numeric_limits<uint32_t>::max(), "uint32", &v);
          !s.ok()) {
        return s;
      }
      r->SetUInt32(message, field, static_cast<uint32_t>(v));
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_UINT64: {
      uint64_t v = 0;
      if (absl::Status s =
              ParseUnsigned(where, text, std::numeric_limits<uint64_t>::max(), "uint64", &v);
          !s.ok()) {
        return s;
      }
      r->SetUInt64(message, field, v);
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_FLOAT:
    case FieldDescriptor::CPPTYPE_DOUBLE: {
      const bool is_float = field->cpp_type() == FieldDescriptor::CPPTYPE_FLOAT;
      double d = 0;
      float f = 0;
      if (ParseSpecialFloat(text, &d)) {
        f = static_cast<float>(d);
      } else if (!IsDecimalNumber(text)) {
        return Invalid(where, absl::StrCat("expected a number, got ", Quote(text)));
      } else if (is_float) {
        // Straight to float: going through double could round twice and break the exact
        // round trip of JobSpecToFlags.
        if (!absl::SimpleAtof(text, &f) || !std::isfinite(f)) {
          return OutOfRange(where, text, "float", "magnitude at most 3.4e38");
        }
      } else if (!absl::SimpleAtod(text, &d) || !std::isfinite(d)) {
        return OutOfRange(where, text, "double", "magnitude at most 1.8e308");
      }
      if (is_float) {
        r->SetFloat(message, field, f);
      } else {
        r->SetDouble(message, field, d);
      }
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_BOOL: {
      // YAML 1.2's core schema; not YAML 1.1's yes/no/on/off, which surprise people ("no" as a
      // country code) and which protobuf JSON does not accept either.
      bool v;
      if (text == "true" || text == "True" || text == "TRUE") {
        v = true;
      } else if (text == "false" || text == "False" || text == "FALSE") {
        v = false;
      } else {
        return Invalid(where, absl::StrCat("expected true or false, got ", Quote(text)));
      }
      r->SetBool(message, field, v);
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_STRING:
      r->SetString(message, field, std::string(text));
      return absl::OkStatus();
    case FieldDescriptor::CPPTYPE_ENUM:
    case FieldDescriptor::CPPTYPE_MESSAGE:
      break;
  }
  return Invalid(where, absl::StrCat("expected ", ExpectedKind(field)));
}

// ---- YAML/JSON documents, walked together with the message descriptor. ----

std::string Describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map:
      return "a map";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Scalar:
      return Quote(node.Scalar());
    case YAML::NodeType::Null:
    case YAML::NodeType::Undefined:
      break;
  }
  return "nothing (null)";
}

const FieldDescriptor* FindField(const Descriptor* descriptor, const std::string& name) {
  if (const FieldDescriptor* f = descriptor->FindFieldByName(name); f != nullptr) return f;
  for (int i = 0; i < descriptor->field_count(); ++i) {
    if (descriptor->field(i)->json_name() == name) return descriptor->field(i);
  }
  return nullptr;
}

class SpecWalker {
 public:
  explicit SpecWalker(std::string root) : root_(std::move(root)) {}

  absl::Status Walk(const YAML::Node& node, google::protobuf::Message* message,
                    const std::string& path) {
    if (!node.IsMap()) {
      return Invalid(path.empty() ? "job spec" : path,
                     absl::StrCat("expected a map of fields, got ", Describe(node)));
    }
    const Descriptor* descriptor = message->GetDescriptor();
    std::set<int> seen;
    for (const auto& entry : node) {
      if (!entry.first.IsScalar()) {
        return Invalid(
            path.empty() ? "job spec" : path,
            absl::StrCat("field names must be plain strings, got ", Describe(entry.first)));
      }
      const std::string& name = entry.first.Scalar();
      const std::string field_path = JoinPath(path, name);
      const FieldDescriptor* field = FindField(descriptor, name);
      if (field == nullptr) {
        std::vector<std::string> names;
        for (int i = 0; i < descriptor->field_count(); ++i) {
          names.push_back(descriptor->field(i)->name());
        }
        return Invalid(field_path, absl::StrCat("unknown field (", JoinPath(root_, path),
                                                " has: ", absl::StrJoin(names, ", "), ")"));
      }
      if (!seen.insert(field->number()).second) {
        return Invalid(JoinPath(path, field->name()), "given more than once");
      }
      OFFLOAD_RETURN_IF_ERROR(Field(entry.second, message, field, field_path));
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Field(const YAML::Node& node, google::protobuf::Message* message,
                     const FieldDescriptor* field, const std::string& path) {
    OFFLOAD_RETURN_IF_ERROR(UnsupportedField(field, path));
    if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      google::protobuf::Message* child = message->GetReflection()->MutableMessage(message, field);
      // "training:" with nothing under it is an empty section, not a mistake.
      if (node.IsNull()) return absl::OkStatus();
      return Walk(node, child, path);
    }
    // A scalar written as null would silently mean "unset"; in a job file it is more likely a
    // value that was forgotten, so say so.
    if (!node.IsScalar()) {
      return Invalid(path,
                     absl::StrCat("expected ", ExpectedKind(field), ", got ", Describe(node)));
    }
    return StoreScalar(message, field, node.Scalar(), path);
  }

  std::string root_;
};

// ---- Validation helpers. ----

// Every set float or double anywhere in the message must be finite.
absl::Status CheckFinite(const google::protobuf::Message& message, const std::string& path) {
  const Descriptor* d = message.GetDescriptor();
  const Reflection* r = message.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    if (f->is_repeated()) continue;  // JobSpec has none; keep the walk simple
    if (!r->HasField(message, f)) continue;
    const std::string field_path = JoinPath(path, f->name());
    double v = 0;
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_MESSAGE:
        OFFLOAD_RETURN_IF_ERROR(CheckFinite(r->GetMessage(message, f), field_path));
        continue;
      case FieldDescriptor::CPPTYPE_FLOAT:
        v = r->GetFloat(message, f);
        break;
      case FieldDescriptor::CPPTYPE_DOUBLE:
        v = r->GetDouble(message, f);
        break;
      default:
        continue;
    }
    if (!std::isfinite(v)) {
      return Invalid(field_path, absl::StrCat("must be a finite number, got ", v));
    }
  }
  return absl::OkStatus();
}

absl::Status OneOf(absl::string_view path, const std::string& value,
                   std::initializer_list<absl::string_view> allowed) {
  for (absl::string_view a : allowed) {
    if (value == a) return absl::OkStatus();
  }
  return Invalid(
      path, absl::StrCat("must be one of ", absl::StrJoin(allowed, ", "), ", got ", Quote(value)));
}

template <typename T>
absl::Status AtLeast(absl::string_view path, T value, T min) {
  if (value >= min) return absl::OkStatus();
  return Invalid(path, absl::StrCat("must be >= ", min, ", got ", value));
}

template <typename T>
absl::Status Positive(absl::string_view path, T value) {
  if (value > 0) return absl::OkStatus();
  return Invalid(path, absl::StrCat("must be > 0, got ", value));
}

template <typename T>
absl::Status InRange(absl::string_view path, T value, T lo, T hi, absl::string_view range) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return Invalid(path, absl::StrCat("must be in ", range, ", got ", value));
}

absl::Status AbsolutePath(absl::string_view path, const std::string& value) {
  if (value.empty() || value[0] == '/') return absl::OkStatus();
  return Invalid(path, absl::StrCat("must be an absolute path (the workers run elsewhere), got ",
                                    Quote(value)));
}

absl::Status ValidateName(const std::string& name) {
  constexpr size_t kMaxName = 128;
  if (name.size() > kMaxName) {
    return Invalid("name", absl::StrCat("at most ", kMaxName, " characters, got ", name.size()));
  }
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    if (absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-' || c == ' ') continue;
    return Invalid(
        "name", absl::StrCat("character ", Quote(absl::string_view(&name[i], 1)), " at position ",
                             i, " is not allowed (use A-Z a-z 0-9 . _ - and space)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateModel(const v1::ModelSpec& m) {
  absl::Status s;
  if (m.has_preset()) {
    s.Update(OneOf("model.preset", m.preset(),
                   {"demo", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"}));
  }
  if (s.ok() && m.has_layers()) s.Update(Positive("model.layers", m.layers()));
  if (s.ok() && m.has_heads()) s.Update(Positive("model.heads", m.heads()));
  if (s.ok() && m.has_channels()) s.Update(Positive("model.channels", m.channels()));
  if (s.ok() && m.has_context()) s.Update(Positive("model.context", m.context()));
  if (s.ok() && m.has_vocab()) s.Update(Positive("model.vocab", m.vocab()));
  if (s.ok() && m.has_channels() && m.has_heads() && m.channels() % m.heads() != 0) {
    return Invalid("model.channels",
                   absl::StrCat(m.channels(), " is not divisible by model.heads ", m.heads()));
  }
  if (s.ok() && m.has_init_from()) s.Update(AbsolutePath("model.init_from", m.init_from()));
  return s;
}

absl::Status ValidateData(const v1::DataSpec& d) {
  if (!d.has_path() || d.path().empty()) {
    return Invalid("data.path", "required: an absolute path the trainer workers can read");
  }
  if (d.path()[0] != '/') return AbsolutePath("data.path", d.path());
  if (d.has_val_fraction() && !(d.val_fraction() > 0 && d.val_fraction() < 1)) {
    return Invalid("data.val_fraction", absl::StrCat("must be in (0, 1), got ", d.val_fraction()));
  }
  return absl::OkStatus();
}

absl::Status ValidateOptimizer(const v1::OptimizerSpec& o) {
  absl::Status s;
  if (o.has_algorithm()) s.Update(OneOf("optimizer.algorithm", o.algorithm(), {"adamw", "adam"}));
  if (s.ok() && o.has_lr()) s.Update(Positive("optimizer.lr", o.lr()));
  if (s.ok() && o.has_min_lr()) s.Update(AtLeast("optimizer.min_lr", o.min_lr(), 0.0f));
  if (s.ok() && o.has_lr() && o.has_min_lr() && o.min_lr() > o.lr()) {
    return Invalid("optimizer.min_lr",
                   absl::StrCat("must be <= optimizer.lr ", o.lr(), ", got ", o.min_lr()));
  }
  if (s.ok() && o.has_warmup_steps()) {
    s.Update(AtLeast("optimizer.warmup_steps", o.warmup_steps(), 0));
  }
  if (s.ok() && o.has_beta1() && !(o.beta1() >= 0 && o.beta1() < 1)) {
    return Invalid("optimizer.beta1", absl::StrCat("must be in [0, 1), got ", o.beta1()));
  }
  if (s.ok() && o.has_beta2() && !(o.beta2() >= 0 && o.beta2() < 1)) {
    return Invalid("optimizer.beta2", absl::StrCat("must be in [0, 1), got ", o.beta2()));
  }
  if (s.ok() && o.has_eps()) s.Update(Positive("optimizer.eps", o.eps()));
  if (s.ok() && o.has_weight_decay()) {
    s.Update(AtLeast("optimizer.weight_decay", o.weight_decay(), 0.0f));
  }
  if (s.ok() && o.has_grad_clip()) s.Update(AtLeast("optimizer.grad_clip", o.grad_clip(), 0.0f));
  return s;
}

absl::Status ValidateTraining(const v1::TrainingSpec& t, const v1::ParallelSpec& p) {
  absl::Status s;
  if (t.has_steps()) s.Update(AtLeast("training.steps", t.steps(), int64_t{1}));
  if (s.ok() && t.has_batch()) s.Update(AtLeast("training.batch", t.batch(), 1));
  if (s.ok() && t.has_micro_batches()) {
    s.Update(AtLeast("training.micro_batches", t.micro_batches(), 1));
  }
  if (!s.ok()) return s;
  if (t.has_batch()) {
    // gpu_trainer's defaults: one rank, one micro-batch.
    const int64_t ranks = p.has_ranks() ? p.ranks() : 1;
    const int64_t micro = t.has_micro_batches() ? t.micro_batches() : 1;
    if (ranks >= 1 && t.batch() % (ranks * micro) != 0) {
      return Invalid("training.batch", absl::StrCat(t.batch(),
                                                    " is not divisible by parallel.ranks x "
                                                    "training.micro_batches = ",
                                                    ranks, " x ", micro));
    }
  }
  if (t.has_seq_len()) s.Update(AtLeast("training.seq_len", t.seq_len(), 1));
  if (s.ok() && t.has_dtype()) s.Update(OneOf("training.dtype", t.dtype(), {"fp16", "bf16"}));
  if (s.ok() && t.has_loss_scale()) {
    s.Update(AtLeast("training.loss_scale", t.loss_scale(), 1.0f));
  }
  if (s.ok() && t.has_loss_scale_window()) {
    s.Update(AtLeast("training.loss_scale_window", t.loss_scale_window(), 1));
  }
  if (s.ok() && t.has_device()) s.Update(OneOf("training.device", t.device(), {"cpu", "cuda"}));
  if (s.ok() && t.has_kernels()) {
    s.Update(OneOf("training.kernels", t.kernels(), {"fast", "naive"}));
  }
  if (s.ok() && t.has_pinned_staging_mb()) {
    // Two chunks, one per direction: gpu_trainer's own lower bound.
    s.Update(AtLeast("training.pinned_staging_mb", t.pinned_staging_mb(), int64_t{2}));
  }
  return s;
}

absl::Status ValidateParallel(const v1::ParallelSpec& p) {
  absl::Status s;
  if (p.has_ranks()) s.Update(InRange("parallel.ranks", p.ranks(), 1u, 1024u, "[1, 1024]"));
  if (s.ok() && p.has_optimizer_servers()) {
    s.Update(InRange("parallel.optimizer_servers", p.optimizer_servers(), 1u, 1024u, "[1, 1024]"));
  }
  if (s.ok() && p.has_transport()) {
    s.Update(OneOf("parallel.transport", p.transport(), {"auto", "grpc", "shm", "ucx"}));
  }
  if (s.ok() && p.has_dpu_warmup_steps()) {
    s.Update(AtLeast("parallel.dpu_warmup_steps", p.dpu_warmup_steps(), int64_t{0}));
  }
  if (s.ok() && p.has_bucket_mb() && !(p.bucket_mb() > 0 && p.bucket_mb() <= 4096)) {
    return Invalid("parallel.bucket_mb", absl::StrCat("must be in (0, 4096], got ", p.bucket_mb()));
  }
  return s;
}

absl::Status ValidateCheckpoint(const v1::CheckpointSpec& c) {
  absl::Status s;
  if (c.has_dir()) s.Update(AbsolutePath("checkpoint.dir", c.dir()));
  if (s.ok() && c.has_every()) s.Update(AtLeast("checkpoint.every", c.every(), 0));
  if (s.ok() && c.has_keep()) s.Update(AtLeast("checkpoint.keep", c.keep(), 0));
  if (s.ok() && c.resume() && c.dir().empty()) {
    return Invalid("checkpoint.resume", "needs checkpoint.dir (where to resume from)");
  }
  return s;
}

absl::Status ValidateEval(const v1::EvalSpec& e) {
  absl::Status s;
  if (e.has_every()) s.Update(AtLeast("eval.every", e.every(), 0));
  if (s.ok() && e.has_batches()) s.Update(AtLeast("eval.batches", e.batches(), 0));
  if (s.ok() && e.has_sample_tokens()) {
    s.Update(AtLeast("eval.sample_tokens", e.sample_tokens(), 0));
  }
  return s;
}

// ---- Flags. ----

// Shortest text that parses back to exactly `v`.
std::string FormatFloat(float v) {
  for (int precision = 6; precision < 9; ++precision) {
    std::string s = absl::StrFormat("%.*g", precision, v);
    float back = 0;
    if (absl::SimpleAtof(s, &back) && back == v) return s;
  }
  return absl::StrFormat("%.9g", v);
}

std::string FormatDouble(double v) {
  for (int precision = 15; precision < 17; ++precision) {
    std::string s = absl::StrFormat("%.*g", precision, v);
    double back = 0;
    if (absl::SimpleAtod(s, &back) && back == v) return s;
  }
  return absl::StrFormat("%.17g", v);
}

std::string FormatScalar(const google::protobuf::Message& m, const FieldDescriptor* f) {
  const Reflection* r = m.GetReflection();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return absl::StrCat(r->GetInt32(m, f));
    case FieldDescriptor::CPPTYPE_INT64:
      return absl::StrCat(r->GetInt64(m, f));
    case FieldDescriptor::CPPTYPE_UINT32:
      return absl::StrCat(r->GetUInt32(m, f));
    case FieldDescriptor::CPPTYPE_UINT64:
      return absl::StrCat(r->GetUInt64(m, f));
    case FieldDescriptor::CPPTYPE_FLOAT:
      return FormatFloat(r->GetFloat(m, f));
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return FormatDouble(r->GetDouble(m, f));
    case FieldDescriptor::CPPTYPE_BOOL:
      return r->GetBool(m, f) ? "true" : "false";
    case FieldDescriptor::CPPTYPE_STRING:
      return r->GetString(m, f);
    case FieldDescriptor::CPPTYPE_ENUM:  // none in JobSpec; the readers refuse one
    case FieldDescriptor::CPPTYPE_MESSAGE:
      break;
  }
  return "";
}

void AppendFlags(const google::protobuf::Message& m, std::vector<std::string>* out) {
  const Descriptor* d = m.GetDescriptor();
  const Reflection* r = m.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    if (f->is_repeated() || !r->HasField(m, f)) continue;
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      AppendFlags(r->GetMessage(m, f), out);
      continue;
    }
    const std::string& flag = f->options().GetExtension(v1::flag);
    if (flag.empty()) continue;  // read by the controller, not the trainer
    out->push_back(absl::StrCat("--", flag, "=", FormatScalar(m, f)));
  }
}

// flag name -> the fields from JobSpec down to its leaf.
using FlagTable = std::map<std::string, std::vector<const FieldDescriptor*>>;

void CollectFlags(const Descriptor* d, std::vector<const FieldDescriptor*>* prefix,
                  FlagTable* table) {
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    if (f->is_repeated()) continue;
    prefix->push_back(f);
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      CollectFlags(f->message_type(), prefix, table);
    } else if (const std::string& flag = f->options().GetExtension(v1::flag); !flag.empty()) {
      (*table)[flag] = *prefix;
    }
    prefix->pop_back();
  }
}

const FlagTable& Flags() {
  static const FlagTable* const table = [] {
    auto* t = new FlagTable();
    std::vector<const FieldDescriptor*> prefix;
    CollectFlags(v1::JobSpec::descriptor(), &prefix, t);
    return t;
  }();
  return *table;
}

// One argument as JobSpecFromFlags reads it.
struct FlagArg {
  std::string name;  // as written: "nodpu" for --nodpu
  absl::string_view value;
  bool has_value = false;
  const FlagTable::value_type* entry = nullptr;  // null: the name is no JobSpec field
  bool negated = false;                          // --noNAME of a bool NAME
};

// INVALID_ARGUMENT when `arg` is no flag at all. `value` points into `arg`.
absl::StatusOr<FlagArg> ReadFlagArg(absl::string_view arg) {
  absl::string_view rest = arg;
  if (!absl::ConsumePrefix(&rest, "--") && !absl::ConsumePrefix(&rest, "-")) rest = "";
  if (rest.empty() || rest[0] == '-' || rest[0] == '=') {
    return absl::InvalidArgumentError(
        absl::StrCat("unexpected argument ", Quote(arg), ": expected --flag=value"));
  }
  FlagArg flag;
  const size_t eq = rest.find('=');
  flag.has_value = eq != absl::string_view::npos;
  flag.name = std::string(rest.substr(0, eq));
  if (flag.has_value) flag.value = rest.substr(eq + 1);

  const FlagTable& table = Flags();
  if (auto it = table.find(flag.name); it != table.end()) {
    flag.entry = &*it;
  } else if (!flag.has_value && absl::StartsWith(flag.name, "no")) {
    // absl's --noflag spelling of --flag=false, for bools only.
    auto positive = table.find(flag.name.substr(2));
    if (positive != table.end() &&
        positive->second.back()->cpp_type() == FieldDescriptor::CPPTYPE_BOOL) {
      flag.entry = &*positive;
      flag.negated = true;
    }
  }
  return flag;
}

absl::StatusOr<v1::JobSpec> ParseDocument(absl::string_view text) {
  if (text.size() > kMaxSpecBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: ", text.size(), " bytes, more than the limit of ", kMaxSpecBytes));
  }
  std::vector<YAML::Node> documents;
  try {
    documents = YAML::LoadAll(std::string(text));
  } catch (const YAML::Exception& e) {
    if (e.mark.is_null()) {
      return absl::InvalidArgumentError(
          absl::StrCat("job spec is not valid YAML or JSON: ", e.msg));
    }
    return absl::InvalidArgumentError(absl::StrCat("job spec is not valid YAML or JSON: line ",
                                                   e.mark.line + 1, ", column ", e.mark.column + 1,
                                                   ": ", e.msg));
  }
  if (documents.empty() || (documents.size() == 1 && documents[0].IsNull())) {
    return absl::InvalidArgumentError("job spec is empty");
  }
  if (documents.size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job spec holds ", documents.size(), " YAML documents; a job file describes one job"));
  }
  v1::JobSpec spec;
  SpecWalker walker(v1::JobSpec::descriptor()->name());
  OFFLOAD_RETURN_IF_ERROR(walker.Walk(documents[0], &spec, ""));
  return spec;
}

}  // namespace

absl::StatusOr<v1::JobSpec> ParseJobSpec(absl::string_view text) {
  // yaml-cpp reports with exceptions, and even node access can throw; none may cross the API.
  try {
    return ParseDocument(text);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: ", e.what()));
  }
}

absl::StatusOr<v1::JobSpec> ReadJobSpecFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("job file ", path, ": not found or unreadable"));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("job file ", path, ": read failed"));
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(text.str());
  if (!spec.ok()) {
    return absl::Status(spec.status().code(), absl::StrCat(path, ": ", spec.status().message()));
  }
  return spec;
}

absl::Status ValidateJobSpec(const v1::JobSpec& spec) {
  OFFLOAD_RETURN_IF_ERROR(ValidateName(spec.name()));
  OFFLOAD_RETURN_IF_ERROR(CheckFinite(spec, ""));
  OFFLOAD_RETURN_IF_ERROR(ValidateModel(spec.model()));
  OFFLOAD_RETURN_IF_ERROR(ValidateData(spec.data()));
  OFFLOAD_RETURN_IF_ERROR(ValidateOptimizer(spec.optimizer()));
  OFFLOAD_RETURN_IF_ERROR(ValidateParallel(spec.parallel()));
  OFFLOAD_RETURN_IF_ERROR(ValidateTraining(spec.training(), spec.parallel()));
  OFFLOAD_RETURN_IF_ERROR(ValidateCheckpoint(spec.checkpoint()));
  return ValidateEval(spec.eval());
}

std::vector<std::string> JobSpecToFlags(const v1::JobSpec& spec) {
  std::vector<std::string> flags;
  AppendFlags(spec, &flags);
  return flags;
}

absl::StatusOr<v1::JobSpec> JobSpecFromFlags(const std::vector<std::string>& args) {
  v1::JobSpec spec;
  for (const std::string& arg : args) {
    OFFLOAD_ASSIGN_OR_RETURN(FlagArg flag, ReadFlagArg(arg));
    if (flag.entry == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown trainer flag --", flag.name, ": not a job spec field"));
    }
    google::protobuf::Message* message = &spec;
    const std::vector<const FieldDescriptor*>& path = flag.entry->second;
    for (size_t i = 0; i + 1 < path.size(); ++i) {
      message = message->GetReflection()->MutableMessage(message, path[i]);
    }
    const FieldDescriptor* leaf = path.back();
    const std::string where = absl::StrCat("--", flag.entry->first);
    if (!flag.has_value) {
      if (leaf->cpp_type() != FieldDescriptor::CPPTYPE_BOOL) {
        return Invalid(where, absl::StrCat("needs a value (", where, "=VALUE)"));
      }
      message->GetReflection()->SetBool(message, leaf, !flag.negated);
      continue;
    }
    OFFLOAD_RETURN_IF_ERROR(StoreScalar(message, leaf, flag.value, where));
  }
  return spec;
}

bool IsJobSpecFlag(absl::string_view arg) {
  absl::StatusOr<FlagArg> flag = ReadFlagArg(arg);
  return !flag.ok() || flag->entry != nullptr;
}

std::string JobSpecToJson(const v1::JobSpec& spec) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  std::string json;
  if (!google::protobuf::util::MessageToJsonString(spec, &json, options).ok()) {
    // It fails only on Any and other well-known types, which JobSpec does not use.
    return "{}";
  }
  return json;
}

std::string ShardJobId(const std::string& job_id, uint32_t attempt) {
  return absl::StrCat(job_id, ".", attempt);
}

}  // namespace offload
