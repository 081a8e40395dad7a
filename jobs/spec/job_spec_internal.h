// What the parts of the job spec code share (job_spec_scalars.cc, job_spec_yaml.cc,
// job_spec_flags.cc, job_spec_validate.cc): error messages that name the field, and one parser for
// a scalar's text, so a YAML scalar and a flag's value accept exactly the same spellings.
#ifndef OFFLOAD_JOBS_SPEC_JOB_SPEC_INTERNAL_H_
#define OFFLOAD_JOBS_SPEC_JOB_SPEC_INTERNAL_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"

namespace offload {
namespace job_spec_internal {

// INVALID_ARGUMENT "where: problem".
absl::Status Invalid(absl::string_view where, absl::string_view problem);
// A value as it was written, quoted and cut short, for error messages.
std::string Quote(absl::string_view text);
// "parent.name" (either may be empty).
std::string JoinPath(absl::string_view parent, absl::string_view name);
// What a field's value must look like, for "expected ..." messages.
absl::string_view ExpectedKind(const google::protobuf::FieldDescriptor* field);
// The readers handle lists of strings (TorchSpec's) but no other repeated field and no enum; one
// added to job.proto must be refused by name rather than half read.
absl::Status UnsupportedField(const google::protobuf::FieldDescriptor* field,
                              absl::string_view where);
// Parses `text` as the scalar `field` of `message` holds and stores it (adds it, to a repeated
// string field); errors name `where`.
absl::Status StoreScalar(google::protobuf::Message* message,
                         const google::protobuf::FieldDescriptor* field, absl::string_view text,
                         absl::string_view where);

}  // namespace job_spec_internal
}  // namespace offload

#endif  // OFFLOAD_JOBS_SPEC_JOB_SPEC_INTERNAL_H_
