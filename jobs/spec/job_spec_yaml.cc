// Job files: YAML (or JSON, which YAML reads too) walked together with JobSpec's descriptor, so an
// unknown field or a wrong type is refused by its path.
#include <algorithm>
#include <exception>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "jobs/spec/job_spec.h"
#include "jobs/spec/job_spec_internal.h"
#include "yaml-cpp/eventhandler.h"
#include "yaml-cpp/yaml.h"

namespace offload {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using job_spec_internal::ExpectedKind;
using job_spec_internal::Invalid;
using job_spec_internal::JoinPath;
using job_spec_internal::Quote;
using job_spec_internal::StoreScalar;
using job_spec_internal::UnsupportedField;

// A job file is a few hundred bytes; anything much larger is a mistake (or an attack on the
// parser) and is refused before yaml-cpp sees it.
constexpr size_t kMaxSpecBytes = 1 << 20;

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
    if (field->is_repeated()) return List(node, message, field, path);
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

  // A list of strings (UnsupportedField refuses every other repeated field): each item a scalar,
  // stored as written (and checked as any string is). A string field takes any text, so YAML's
  // `[1, true]` is the strings "1" and "true".
  absl::Status List(const YAML::Node& node, google::protobuf::Message* message,
                    const FieldDescriptor* field, const std::string& path) {
    if (!node.IsSequence()) {
      return Invalid(path, absl::StrCat("expected a list of strings, got ", Describe(node)));
    }
    size_t i = 0;
    for (const YAML::Node& item : node) {
      const std::string item_path = absl::StrCat(path, "[", i++, "]");
      if (!item.IsScalar()) {
        return Invalid(item_path, absl::StrCat("expected a string, got ", Describe(item)));
      }
      OFFLOAD_RETURN_IF_ERROR(StoreScalar(message, field, item.Scalar(), item_path));
    }
    return absl::OkStatus();
  }

  std::string root_;
};

// Where each document of a YAML stream starts; nothing else is kept. Counting documents this way,
// a few at most, replaces YAML::LoadAll: on a ',' outside any flow collection ("\n,") yaml-cpp
// 0.7's parser hands out empty documents forever without consuming it, and LoadAll collects them
// until memory runs out. A document that starts where the one before it did is that stuck parser.
class DocumentStarts : public YAML::EventHandler {
 public:
  void OnDocumentStart(const YAML::Mark& mark) override { marks.push_back(mark); }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t,
                const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}

  std::vector<YAML::Mark> marks;
};

absl::StatusOr<v1::JobSpec> ParseDocument(absl::string_view text) {
  if (text.size() > kMaxSpecBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: ", text.size(), " bytes, more than the limit of ", kMaxSpecBytes));
  }
  std::vector<YAML::Node> documents;
  try {
    std::istringstream stream{std::string(text)};
    YAML::Parser parser(stream);
    DocumentStarts starts;
    while (starts.marks.size() < 2 && parser.HandleNextDocument(starts)) {
    }
    if (starts.marks.size() == 2 && starts.marks[0].pos == starts.marks[1].pos) {
      const YAML::Mark& at = starts.marks[0];
      const size_t pos = std::min(static_cast<size_t>(at.pos), text.size());
      return absl::InvalidArgumentError(
          absl::StrCat("job spec is not valid YAML or JSON: line ", at.line + 1, ", column ",
                       at.column + 1, ": unexpected ", Quote(std::string(text.substr(pos, 1)))));
    }
    if (starts.marks.size() > 1) {
      return absl::InvalidArgumentError(
          "job spec holds more than one YAML document; a job file describes one job");
    }
    if (!starts.marks.empty()) documents.push_back(YAML::Load(std::string(text)));
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
}  // namespace offload
