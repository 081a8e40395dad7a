// A torch job's attempt on a trainer pool worker (ARCHITECTURE.md section 7, "Torch jobs"): the
// job's command as a child process with the attempt's optimizer servers, their credential and the
// torch.distributed rendezvous in its environment; the script's progress file relayed to the
// controller and the controller's requests written back; the last lines of its output kept for
// the attempt's result, so a failed job says why.
#ifndef OFFLOAD_SERVICES_TRAINER_WORKER_TORCH_ATTEMPT_H_
#define OFFLOAD_SERVICES_TRAINER_WORKER_TORCH_ATTEMPT_H_

#include <csignal>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "offload/v1/worker.pb.h"
#include "services/spawn/child_process.h"

namespace offload {

struct TorchAttemptOptions {
  std::shared_ptr<grpc::Channel> channel;  // to the controller
  std::string token;                       // the worker's bearer token there
  // This worker's host as the job's other ranks reach it: rank 0's is MASTER_ADDR.
  std::string rank_address;
  // How the command reaches the optimizer servers over TLS, "OFFLOAD_TLS_CA=path" and the like
  // (TorchTlsEnvironment of the worker's own flags); empty without TLS.
  std::vector<std::string> tls_env;
  // The user the command runs as (script_user.h); empty: the worker's. Its control directory is
  // then shared through the user's group, and every process of that user is killed at the end.
  std::optional<RunAs> run_as;
  // Prefixes every line of the command's output this worker copies to its stderr.
  std::string output_prefix;
  // How long the command has to stop on its own after the controller asked the job to pause or
  // cancel (it checkpoints at its next step) or the worker was told to stop, before SIGINT; and
  // after SIGINT before SIGKILL.
  absl::Duration stop_grace = absl::Seconds(60);
  absl::Duration kill_grace = absl::Seconds(30);
  absl::Duration rendezvous_timeout = absl::Minutes(5);
  // The controller withdrew the attempt: the command is killed at once.
  std::function<bool()> withdrawn;
  // The worker is shutting down: the command is stopped in order (SIGINT, then SIGKILL).
  volatile std::sig_atomic_t* stop = nullptr;
  // Each new report of the script, for the worker's metrics.
  std::function<void(const v1::ScriptProgress&)> on_progress;
};

// Runs the attempt to its end and says how it ended: the command's exit code (128 + the signal
// that killed it), and for a failure a message with the last lines of its output. A command that
// cannot start (a program not on PATH, a missing working directory, a rendezvous that never
// completes) is exit code 127 with the reason.
v1::AttemptResult RunTorchAttempt(const v1::Assignment& a, const TorchAttemptOptions& options);

// ---- The pieces, separately testable.

// The "NAME=value" entries the command gets (TorchJobVariables(), each once): `master` is rank 0's
// "host:port" (unused with one rank).
std::vector<std::string> TorchEnvironment(const v1::Assignment& a, const std::string& control_dir,
                                          const std::string& master);

// The worker's TLS flags ("--tls_ca=path", as SecurityFlagsForChild gives them) as the command's
// OFFLOAD_TLS_CA and OFFLOAD_TLS_SERVER_NAME, and with `client_identity` OFFLOAD_TLS_CERT and
// OFFLOAD_TLS_KEY (the worker's own certificate: not for a script of its own user, which could
// not read the key anyway); other flags are not the script's.
std::vector<std::string> TorchTlsEnvironment(const std::vector<std::string>& security_flags,
                                             bool client_identity);

// argv[0] as the worker runs it: a name without '/' searched on `path` (a PATH value) for an
// executable file, one with a '/' taken relative to `working_dir` (or as is). NOT_FOUND naming it.
absl::StatusOr<std::string> ResolveProgram(const std::string& program, const std::string& path,
                                           const std::string& working_dir);

// progress.json's text; INVALID_ARGUMENT naming the problem.
absl::StatusOr<v1::ScriptProgress> ParseScriptProgress(absl::string_view json);

// The ProgressReport a script's progress becomes.
v1::ProgressReport ReportOf(const v1::ScriptProgress& progress);

// request.json's text: the reply with every field present and proto field names.
std::string RequestJson(const v1::ProgressReply& reply);

// The last `max_lines` lines of a stream, each cut to `max_line_bytes`.
class OutputTail {
 public:
  explicit OutputTail(size_t max_lines = 20, size_t max_line_bytes = 400)
      : max_lines_(max_lines), max_line_bytes_(max_line_bytes) {}
  void Add(absl::string_view line);
  std::string Text() const;  // the lines, each ending in '\n'

 private:
  size_t max_lines_;
  size_t max_line_bytes_;
  std::deque<std::string> lines_;
};

}  // namespace offload

#endif  // OFFLOAD_SERVICES_TRAINER_WORKER_TORCH_ATTEMPT_H_
