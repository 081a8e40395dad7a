#include "services/trainer_worker/script_user.h"

#include <unistd.h>

#include <cstdint>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace offload {
namespace {

// Ids a switch takes: not root's, and under 2^31 (the kernel's -1 and negative pids nearby).
constexpr uint64_t kLastId = (1ull << 31) - 1;

}  // namespace

absl::StatusOr<std::optional<ScriptUsers>> ParseScriptUsers(absl::string_view user,
                                                            absl::string_view groups) {
  if (user.empty()) {
    if (!groups.empty()) {
      return absl::InvalidArgumentError("--script_groups needs --script_user");
    }
    return std::nullopt;
  }
  ScriptUsers users;
  uint64_t uid = 0;
  if (!absl::SimpleAtoi(user, &uid) || uid == 0 || uid > kLastId) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--script_user=", user, " must be a numeric uid other than 0 (root), below 2^31"));
  }
  users.first_uid = static_cast<uid_t>(uid);
  for (absl::string_view group : absl::StrSplit(groups, ',', absl::SkipEmpty())) {
    uint64_t gid = 0;
    if (!absl::SimpleAtoi(group, &gid) || gid == 0 || gid > kLastId) {
      return absl::InvalidArgumentError(absl::StrCat("--script_groups=", groups, ": ", group,
                                                     " is not a numeric gid other than 0 (root)"));
    }
    users.groups.push_back(static_cast<gid_t>(gid));
  }
  return users;
}

RunAs ScriptUserOf(const ScriptUsers& users, int worker) {
  const uid_t uid = users.first_uid + static_cast<uid_t>(worker);
  return RunAs{uid, static_cast<gid_t>(uid), users.groups};
}

std::vector<std::string> CredentialFiles(const std::vector<std::string>& security_flags) {
  std::vector<std::string> files;
  for (const char* name : {"--token_file=", "--tls_key="}) {
    for (const std::string& flag : security_flags) {
      if (flag.rfind(name, 0) == 0) files.push_back(flag.substr(std::string(name).size()));
    }
  }
  return files;
}

absl::Status CheckScriptUsers(const ScriptUsers& users, int workers,
                              const std::vector<std::string>& credential_files) {
  const uint64_t last = static_cast<uint64_t>(users.first_uid) + workers - 1;
  if (last > kLastId) {
    return absl::InvalidArgumentError(absl::StrCat("--script_user=", users.first_uid, " with ",
                                                   workers, " workers goes past uid 2^31 - 1"));
  }
  const uid_t self = geteuid();
  if (self >= users.first_uid && self <= last) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--script_user=", users.first_uid, ": worker ", self - users.first_uid,
        "'s scripts would run as this worker's own uid ", self, ", which holds its credentials"));
  }
  for (int k = 0; k < workers; ++k) {
    const RunAs who = ScriptUserOf(users, k);
    absl::StatusOr<std::vector<std::string>> readable = ReadableAs(who, credential_files);
    if (!readable.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--script_user: ", readable.status().message(),
          "; run the worker as root with those capabilities (and CAP_KILL, to stop scripts)"));
    }
    if (!readable->empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--script_user: the scripts' user ", who.uid, " can read ",
          absl::StrJoin(*readable, ", "),
          ": a script could act as this worker with it; make it readable by the worker only "
          "(chmod 0400, or defaultMode 0400 on a Kubernetes Secret)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace offload
