// Torch jobs' scripts as users of their own (ARCHITECTURE.md section 7, "Torch jobs"). A script
// is a tenant's code; the pool worker that starts it holds the operator's token. Run as the
// worker's user, the script could read that token (and the worker's TLS key) and act as the
// operator. With --script_user, worker k of a process runs every script as uid UID + k (gid the
// same), so a script reaches only what it is handed, its attempt's shard secret, and no
// concurrent script of another worker: a uid of its own each, and every process a script left
// behind is killed when its attempt ends, before that uid runs the next attempt.
#ifndef OFFLOAD_SERVICES_TRAINER_WORKER_SCRIPT_USER_H_
#define OFFLOAD_SERVICES_TRAINER_WORKER_SCRIPT_USER_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "services/spawn/child_process.h"

namespace offload {

struct ScriptUsers {
  uid_t first_uid = 0;        // worker k's scripts run as first_uid + k
  std::vector<gid_t> groups;  // supplementary groups of every script (a data volume's group)
};

// --script_user=UID and --script_groups=GID[,GID...]: nullopt when `user` is empty (scripts run
// as the worker). INVALID_ARGUMENT naming the flag for anything else than numbers, uid 0, or
// groups without a user.
absl::StatusOr<std::optional<ScriptUsers>> ParseScriptUsers(absl::string_view user,
                                                            absl::string_view groups);

// Worker k's script user: uid and gid first_uid + k, and the groups.
RunAs ScriptUserOf(const ScriptUsers& users, int worker);

// The files among the worker's security flags (as SecurityFlagsForChild gives them) that hold a
// secret: --token_file and --tls_key.
std::vector<std::string> CredentialFiles(const std::vector<std::string>& security_flags);

// Before a worker takes any job: every one of `workers` script users differs from this process's
// user and root, this process can switch to each, and none can read any of `credential_files`.
// FAILED_PRECONDITION naming the user and the file (and what to do), or the missing capability.
absl::Status CheckScriptUsers(const ScriptUsers& users, int workers,
                              const std::vector<std::string>& credential_files);

}  // namespace offload

#endif  // OFFLOAD_SERVICES_TRAINER_WORKER_SCRIPT_USER_H_
