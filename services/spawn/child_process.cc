#include "services/spawn/child_process.h"

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace offload {
namespace {

void CloseFd(int fd) {
  if (fd >= 0) close(fd);
}

// What a child that could not start passes back through its error pipe.
struct StartError {
  enum Stage : int { kExec = 0, kRunAs = 1, kChdir = 2 };
  int stage;
  int error;  // errno
};

void ReportStartError(int error_fd, StartError::Stage stage) {
  const StartError report = {stage, errno};
  ssize_t ignored = write(error_fd, &report, sizeof(report));
  (void)ignored;
}

// Groups, then gid, then uid: once the uid is given up the others can no longer be changed.
// Async-signal-safe.
bool SwitchUser(const RunAs& who) {
  return setgroups(who.groups.size(), who.groups.data()) == 0 && setgid(who.gid) == 0 &&
         setuid(who.uid) == 0;
}

// Only async-signal-safe calls from here to exec: the launcher has other threads whose locks
// (malloc, stdio) may have been held at the fork and never get released in the child.
[[noreturn]] void ExecChild(char* const* argv, char* const* envp, const char* working_dir,
                            const RunAs* run_as, pid_t parent, int stdin_fd, int output_fd,
                            int error_fd) {
  setpgid(0, 0);
  if (run_as != nullptr && !SwitchUser(*run_as)) {
    ReportStartError(error_fd, StartError::kRunAs);
    _exit(127);
  }
  // After the switch: a change of credentials clears the death signal.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  // The parent may have died before prctl took effect; then nobody would ever kill us.
  if (getppid() != parent) _exit(127);

  // Dispositions the launcher inherited (a background job has SIGINT ignored) or set (SIGPIPE)
  // would otherwise survive exec, and the trainer could not act on Ctrl-C.
  struct sigaction default_action;
  std::memset(&default_action, 0, sizeof(default_action));
  default_action.sa_handler = SIG_DFL;
  for (int signo = 1; signo < NSIG; ++signo) sigaction(signo, &default_action, nullptr);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);

  if (stdin_fd >= 0 && dup2(stdin_fd, STDIN_FILENO) < 0) _exit(127);
  if (output_fd >= 0 &&
      (dup2(output_fd, STDOUT_FILENO) < 0 || dup2(output_fd, STDERR_FILENO) < 0)) {
    _exit(127);
  }
  if (working_dir != nullptr && chdir(working_dir) != 0) {
    ReportStartError(error_fd, StartError::kChdir);
    _exit(127);
  }
  execve(argv[0], argv, envp);
  ReportStartError(error_fd, StartError::kExec);
  _exit(127);
}

std::string Describe(const RunAs& who) {
  return absl::StrCat("uid ", who.uid, ", gid ", who.gid, ", groups [",
                      absl::StrJoin(who.groups, ","), "]");
}

}  // namespace

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Spawn(const SpawnOptions& options) {
  if (options.argv.empty()) return absl::InvalidArgumentError("no program to run");
  const std::string& program = options.argv[0];
  // Checked here too, so that a missing directory is named as such (the child can only pass back
  // an errno, which would read as the program's).
  if (!options.working_dir.empty()) {
    std::error_code error;
    if (!std::filesystem::is_directory(options.working_dir, error)) {
      return absl::NotFoundError(
          absl::StrCat("working directory ", options.working_dir, " is not a directory"));
    }
  }
  std::vector<char*> argv;
  for (const std::string& arg : options.argv) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  // The environment is put together before the fork: the child may only make async-signal-safe
  // calls, and setenv is not one.
  std::vector<std::string> env_entries;
  for (char** e = environ; *e != nullptr; ++e) {
    const absl::string_view entry(*e);
    const absl::string_view name = entry.substr(0, entry.find('='));
    const bool replaced =
        std::any_of(options.env.begin(), options.env.end(), [name](const std::string& added) {
          return absl::StartsWith(added, absl::StrCat(name, "="));
        });
    if (!replaced) env_entries.emplace_back(entry);
  }
  env_entries.insert(env_entries.end(), options.env.begin(), options.env.end());
  std::vector<char*> envp;
  for (std::string& entry : env_entries) envp.push_back(entry.data());
  envp.push_back(nullptr);

  // Every descriptor is close-on-exec, so no child holds another child's pipe open (which would
  // keep its reader from ever seeing EOF).
  int stdin_fd = -1;
  if (options.null_stdin) {
    stdin_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (stdin_fd < 0) return absl::ErrnoToStatus(errno, "open /dev/null");
  }
  int output_pipe[2] = {-1, -1};
  if (options.capture_output && pipe2(output_pipe, O_CLOEXEC) != 0) {
    int error = errno;
    CloseFd(stdin_fd);
    return absl::ErrnoToStatus(error, "pipe");
  }
  // exec failures come back through this pipe; a successful exec closes it with nothing written.
  int error_pipe[2];
  if (pipe2(error_pipe, O_CLOEXEC) != 0) {
    int error = errno;
    CloseFd(stdin_fd);
    CloseFd(output_pipe[0]);
    CloseFd(output_pipe[1]);
    return absl::ErrnoToStatus(error, "pipe");
  }

  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid == 0) {
    ExecChild(argv.data(), envp.data(),
              options.working_dir.empty() ? nullptr : options.working_dir.c_str(),
              options.run_as ? &*options.run_as : nullptr, parent, stdin_fd, output_pipe[1],
              error_pipe[1]);
  }
  int fork_error = errno;
  CloseFd(stdin_fd);
  CloseFd(output_pipe[1]);
  CloseFd(error_pipe[1]);
  if (pid < 0) {
    CloseFd(output_pipe[0]);
    CloseFd(error_pipe[0]);
    return absl::ErrnoToStatus(fork_error, "fork");
  }
  // Also from this side: a signal sent to the group before the child ran setpgid must not miss.
  setpgid(pid, pid);

  StartError start_error;
  ssize_t n;
  do {
    n = read(error_pipe[0], &start_error, sizeof(start_error));
  } while (n < 0 && errno == EINTR);
  CloseFd(error_pipe[0]);
  if (n == static_cast<ssize_t>(sizeof(start_error))) {
    CloseFd(output_pipe[0]);
    while (waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
    if (start_error.stage == StartError::kRunAs) {
      return absl::ErrnoToStatus(
          start_error.error, absl::StrCat("cannot run ", program, " as ", Describe(*options.run_as),
                                          " (switching users needs CAP_SETUID and CAP_SETGID)"));
    }
    if (start_error.stage == StartError::kChdir) {
      return absl::ErrnoToStatus(
          start_error.error,
          absl::StrCat("cannot enter the working directory ", options.working_dir,
                       options.run_as ? absl::StrCat(" as ", Describe(*options.run_as)) : ""));
    }
    return absl::ErrnoToStatus(start_error.error, absl::StrCat("cannot execute ", program));
  }

  int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  return std::unique_ptr<ChildProcess>(new ChildProcess(pid, pidfd, output_pipe[0], program));
}

ChildProcess::ChildProcess(pid_t pid, int pidfd, int output_fd, std::string program)
    : pid_(pid), pidfd_(pidfd), output_fd_(output_fd), program_(std::move(program)) {}

ChildProcess::~ChildProcess() {
  if (!reaped_) {
    Signal(SIGKILL).IgnoreError();
    WaitFor(absl::InfiniteDuration());
  }
  CloseFd(pidfd_);
  CloseFd(output_fd_);
}

int ChildProcess::TakeOutputFd() { return std::exchange(output_fd_, -1); }

absl::Status ChildProcess::Signal(int signo) {
  if (reaped_) return absl::OkStatus();
  if (kill(-pid_, signo) == 0) return absl::OkStatus();
  // The group may be gone while the leader is a zombie not reaped yet.
  if (errno == ESRCH) return absl::OkStatus();
  return absl::ErrnoToStatus(errno, absl::StrCat("kill ", pid_));
}

bool ChildProcess::TryReap() {
  if (reaped_) return true;
  int status = 0;
  pid_t r;
  do {
    r = waitpid(pid_, &status, WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r == pid_) {
    reaped_ = true;
    wait_status_ = status;
  }
  return reaped_;
}

bool ChildProcess::WaitFor(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!TryReap()) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    if (pidfd_ >= 0) {
      // The pidfd turns readable when the child exits.
      pollfd p = {pidfd_, POLLIN, 0};
      const int ms = left == absl::InfiniteDuration()
                         ? -1
                         : static_cast<int>(absl::ToInt64Milliseconds(
                               absl::Ceil(std::min(left, absl::Hours(1)), absl::Milliseconds(1))));
      poll(&p, 1, ms);
    } else {
      std::this_thread::sleep_for(
          absl::ToChronoMilliseconds(std::min(left, absl::Milliseconds(5))));
    }
  }
  return true;
}

namespace {

// Runs `body` in a child process switched to `who` and returns what it wrote to its descriptor:
// the switch's errno first (0: switched; then `body` ran). Only async-signal-safe calls in `body`.
template <typename Body>
absl::StatusOr<std::string> ReportAs(const RunAs& who, const Body& body) {
  int report_pipe[2];
  if (pipe2(report_pipe, O_CLOEXEC) != 0) return absl::ErrnoToStatus(errno, "pipe");
  const pid_t pid = fork();
  if (pid == 0) {
    close(report_pipe[0]);
    const int switch_error = SwitchUser(who) ? 0 : errno;
    ssize_t ignored = write(report_pipe[1], &switch_error, sizeof(switch_error));
    (void)ignored;
    if (switch_error == 0) body(report_pipe[1]);
    _exit(0);
  }
  const int fork_error = errno;
  close(report_pipe[1]);
  if (pid < 0) {
    close(report_pipe[0]);
    return absl::ErrnoToStatus(fork_error, "fork");
  }
  std::string report;
  char buffer[256];
  for (;;) {
    const ssize_t n = read(report_pipe[0], buffer, sizeof(buffer));
    if (n > 0) {
      report.append(buffer, n);
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  close(report_pipe[0]);
  while (waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
  }
  int switch_error = 0;
  if (report.size() < sizeof(switch_error)) {
    return absl::InternalError(absl::StrCat("a process as ", Describe(who), " reported nothing"));
  }
  std::memcpy(&switch_error, report.data(), sizeof(switch_error));
  if (switch_error != 0) {
    return absl::ErrnoToStatus(switch_error,
                               absl::StrCat("cannot switch to ", Describe(who),
                                            " (that needs CAP_SETUID and CAP_SETGID)"));
  }
  return report.substr(sizeof(switch_error));
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ReadableAs(const RunAs& who,
                                                    const std::vector<std::string>& paths) {
  absl::StatusOr<std::string> opened = ReportAs(who, [&paths](int fd) {
    for (const std::string& path : paths) {
      // Non-blocking, so that a FIFO cannot hold the check up.
      const int file = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
      const char readable = file >= 0 ? 1 : 0;
      if (file >= 0) close(file);
      ssize_t ignored = write(fd, &readable, 1);
      (void)ignored;
    }
  });
  if (!opened.ok()) return opened.status();
  if (opened->size() != paths.size()) {
    return absl::InternalError(
        absl::StrCat("checking what ", Describe(who), " can read: the report was cut short"));
  }
  std::vector<std::string> readable;
  for (size_t i = 0; i < paths.size(); ++i) {
    if ((*opened)[i] != 0) readable.push_back(paths[i]);
  }
  return readable;
}

absl::Status KillEveryProcessOf(const RunAs& who) {
  absl::StatusOr<std::string> killed = ReportAs(who, [](int fd) {
    // -1: every process this user may signal but the caller (and init); ESRCH: there was none.
    const int error = kill(-1, SIGKILL) == 0 || errno == ESRCH ? 0 : errno;
    ssize_t ignored = write(fd, &error, sizeof(error));
    (void)ignored;
  });
  if (!killed.ok()) return killed.status();
  int error = 0;
  if (killed->size() != sizeof(error)) {
    return absl::InternalError(
        absl::StrCat("killing the processes of ", Describe(who), ": no report"));
  }
  std::memcpy(&error, killed->data(), sizeof(error));
  if (error != 0) {
    return absl::ErrnoToStatus(error, absl::StrCat("killing the processes of ", Describe(who)));
  }
  return absl::OkStatus();
}

std::string DescribeWaitStatus(int wait_status) {
  if (WIFEXITED(wait_status)) return absl::StrCat("exited with status ", WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) {
    const int signo = WTERMSIG(wait_status);
    return absl::StrCat("was killed by signal ", signo, " (", strsignal(signo), ")");
  }
  return absl::StrCat("ended with wait status ", wait_status);
}

int ExitCodeOf(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return 1;
}

std::string ThisExecutable(const std::string& fallback) {
  std::error_code error;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
  return error ? fallback : self.string();
}

std::string BesideThisExecutable(const std::string& relative_path) {
  const std::string self = ThisExecutable("");
  if (self.empty()) return relative_path;
  return (std::filesystem::path(self).parent_path() / relative_path).lexically_normal().string();
}

}  // namespace offload
