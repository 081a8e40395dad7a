// ChildProcess: one child of the launcher, in its own process group and tied to the launcher's
// life, so neither a terminal's Ctrl-C nor the launcher's death can leave it running unsupervised.
#ifndef OFFLOAD_SERVICES_SPAWN_CHILD_PROCESS_H_
#define OFFLOAD_SERVICES_SPAWN_CHILD_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace offload {

// A user the child runs as instead of the launcher's: what that user cannot read, the child cannot
// either (a script kept from the launcher's credentials). Switching needs CAP_SETUID and
// CAP_SETGID, and signalling the child afterwards CAP_KILL.
struct RunAs {
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary groups; empty: none (the launcher's are dropped)
};

struct SpawnOptions {
  // argv[0] is the program's path, used as is: no PATH search, no shell.
  std::vector<std::string> argv;
  // Sends stdout and stderr into one pipe (ChildProcess::TakeOutputFd) instead of inheriting them.
  bool capture_output = false;
  // Gives the child /dev/null as stdin: a child in a background process group that read the
  // terminal would be stopped by SIGTTIN.
  bool null_stdin = false;
  // "NAME=value" entries added to the child's environment (replacing a variable of the same
  // name): how a secret reaches a child without appearing in its argv, which any user can read.
  std::vector<std::string> env;
  // The child's working directory; empty: the parent's.
  std::string working_dir;
  // Empty: the launcher's user. The working directory is entered as the new user.
  std::optional<RunAs> run_as;
};

class ChildProcess {
 public:
  // Starts the child in a new process group with PR_SET_PDEATHSIG=SIGKILL, every signal at its
  // default disposition and none blocked. Fails, with the child reaped, when the program cannot be
  // executed. The death signal follows the calling thread, so call this from a thread that lives
  // as long as the child should.
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Spawn(const SpawnOptions& options);

  // Kills the whole process group and reaps the child if that has not happened yet.
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  const std::string& program() const { return program_; }

  // The read end of the output pipe (capture_output); the caller owns it. -1 otherwise.
  int TakeOutputFd();

  // Sends `signo` to the child's process group, so helpers the child started get it as they
  // would from a terminal. Does nothing once the child is reaped: its group id may be reused.
  absl::Status Signal(int signo);

  // Waits until the child has exited (and reaps it) or `timeout` has passed; returns whether it
  // is reaped. A zero timeout only looks; an infinite one waits for good.
  bool WaitFor(absl::Duration timeout);

  bool reaped() const { return reaped_; }
  // The waitpid status; meaningful once reaped().
  int wait_status() const { return wait_status_; }

 private:
  ChildProcess(pid_t pid, int pidfd, int output_fd, std::string program);
  bool TryReap();

  pid_t pid_;
  int pidfd_;  // -1 where the kernel has no pidfd_open; then WaitFor polls.
  int output_fd_;
  std::string program_;
  bool reaped_ = false;
  int wait_status_ = 0;
};

// Which of `paths` `who` can open for reading, tried by a child process that switches to `who`
// (so directories' permissions, ACLs and mounts all count, as they will for a real child).
// An error where the switch itself fails (no CAP_SETUID), naming it.
absl::StatusOr<std::vector<std::string>> ReadableAs(const RunAs& who,
                                                    const std::vector<std::string>& paths);

// Kills every process running as `who` (a process switched to it sends SIGKILL to all it may
// signal), whatever process group or session it is in: what a child started cannot outlive it.
absl::Status KillEveryProcessOf(const RunAs& who);

// "exited with status 3" or "was killed by signal 9 (Killed)".
std::string DescribeWaitStatus(int wait_status);

// The status a shell would report: the exit code, or 128 + the signal that killed it.
int ExitCodeOf(int wait_status);

// The running program's own file (/proc/self/exe), to start copies of itself or its siblings:
// argv[0] may be relative or found on PATH. `fallback` where it cannot be read.
std::string ThisExecutable(const std::string& fallback);
// `relative_path` taken from the running program's directory (a build tree's layout is fixed at
// configure time, so a program finds its siblings without flags); as given where that fails.
std::string BesideThisExecutable(const std::string& relative_path);

}  // namespace offload

#endif  // OFFLOAD_SERVICES_SPAWN_CHILD_PROCESS_H_
