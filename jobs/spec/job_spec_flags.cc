// The JobSpec <-> gpu_trainer flags table: every leaf that carries the (offload.v1.flag) option is
// the flag of that name, so a job file and a command line say the same things.
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "base/status_macros.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "jobs/spec/job_spec.h"
#include "jobs/spec/job_spec_internal.h"

namespace offload {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;
using job_spec_internal::Invalid;
using job_spec_internal::Quote;
using job_spec_internal::StoreScalar;

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

// A character that can continue a field path ("training.steps" inside "training.steps_x").
bool IsPathChar(char c) { return absl::ascii_isalnum(c) || c == '_' || c == '.'; }

}  // namespace

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

absl::StatusOr<v1::JobSpec> JobSpecFromTrainerFlags() {
  std::vector<std::string> args;
  for (const auto& [name, path] : Flags()) {
    // A flag at its default is a field left unset: the default is the trainer's, whatever it
    // means (0 layers: the preset's).
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag != nullptr && flag->CurrentValue() != flag->DefaultValue()) {
      args.push_back(absl::StrCat("--", name, "=", flag->CurrentValue()));
    }
  }
  return JobSpecFromFlags(args);
}

absl::Status NameTheFlag(const absl::Status& status) {
  if (status.ok()) return status;
  std::string message(status.message());
  for (const auto& [name, path] : Flags()) {
    std::string field;
    for (const FieldDescriptor* f : path) {
      field = field.empty() ? f->name() : absl::StrCat(field, ".", f->name());
    }
    const std::string flag = absl::StrCat("--", name);
    // Whole paths only: "training.steps" is no path inside "training.steps_x".
    size_t at = 0;
    while ((at = message.find(field, at)) != std::string::npos) {
      const size_t end = at + field.size();
      if ((at > 0 && IsPathChar(message[at - 1])) ||
          (end < message.size() && IsPathChar(message[end]))) {
        at = end;  // part of another word
        continue;
      }
      message.replace(at, field.size(), flag);
      at += flag.size();
    }
  }
  return absl::Status(status.code(), message);
}

bool IsJobSpecFlag(absl::string_view arg) {
  absl::StatusOr<FlagArg> flag = ReadFlagArg(arg);
  return !flag.ok() || flag->entry != nullptr;
}
}  // namespace offload
