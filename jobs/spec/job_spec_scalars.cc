// The scalars of a job spec: one parser for YAML scalars and for flag values, so both accept the
// same text, and the error messages every part shares.
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/utf8.h"
#include "jobs/spec/job_spec_internal.h"

namespace offload {
namespace job_spec_internal {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

absl::Status Invalid(absl::string_view where, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": ", problem));
}

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

namespace {

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

}  // namespace

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

absl::Status UnsupportedField(const FieldDescriptor* field, absl::string_view where) {
  const bool repeated = field->is_repeated();
  if (repeated && field->cpp_type() == FieldDescriptor::CPPTYPE_STRING) return absl::OkStatus();
  if (!repeated && field->cpp_type() != FieldDescriptor::CPPTYPE_ENUM) return absl::OkStatus();
  return Invalid(where, absl::StrCat(field->full_name(), " is ", repeated ? "repeated" : "an enum",
                                     ", which job specs do not support"));
}

// Parses `text` into `field` of `message`. `where` names the field in errors: a path in a job
// file, "--lr" for a flag.
absl::Status StoreScalar(Message* message, const FieldDescriptor* field, absl::string_view text,
                         absl::string_view where) {
  OFFLOAD_RETURN_IF_ERROR(UnsupportedField(field, where));
  if (field->is_repeated() && field->cpp_type() != FieldDescriptor::CPPTYPE_STRING) {
    return Invalid(where, "expected a list, got one value");
  }
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
      if (field->type() == FieldDescriptor::TYPE_STRING) {
        if (const size_t at = InvalidUtf8At(text); at != absl::string_view::npos) {
          return Invalid(where,
                         absl::StrCat("is not valid UTF-8 (byte ", at, " of ", Quote(text), ")"));
        }
      }
      if (field->is_repeated()) {  // one item of a list (TorchSpec's)
        r->AddString(message, field, std::string(text));
      } else {
        r->SetString(message, field, std::string(text));
      }
      return absl::OkStatus();
    case FieldDescriptor::CPPTYPE_ENUM:
    case FieldDescriptor::CPPTYPE_MESSAGE:
      break;
  }
  return Invalid(where, absl::StrCat("expected ", ExpectedKind(field)));
}

}  // namespace job_spec_internal
}  // namespace offload
