#include "services/spawn/child_process.h"

#include <fcntl.h>
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
#include "absl/time/clock.h"

namespace offload {
namespace {

void CloseFd(int fd) {
  if (fd >= 0) close(fd);
}

// Only async-signal-safe calls from here to exec: the launcher has other threads whose locks
// (malloc, stdio) may have been held at the fork and never get released in the child.
[[noreturn]] void ExecChild(char* const* argv, char* const* envp, const char* working_dir,
                            pid_t parent, int stdin_fd, int output_fd, int error_fd) {
  setpgid(0, 0);
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
  if (working_dir == nullptr || chdir(working_dir) == 0) execve(argv[0], argv, envp);
  int error = errno;
  ssize_t ignored = write(error_fd, &error, sizeof(error));
  (void)ignored;
  _exit(127);
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
              options.working_dir.empty() ? nullptr : options.working_dir.c_str(), parent, stdin_fd,
              output_pipe[1], error_pipe[1]);
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

  int exec_error = 0;
  ssize_t n;
  do {
    n = read(error_pipe[0], &exec_error, sizeof(exec_error));
  } while (n < 0 && errno == EINTR);
  CloseFd(error_pipe[0]);
  if (n == static_cast<ssize_t>(sizeof(exec_error))) {
    CloseFd(output_pipe[0]);
    while (waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
    return absl::ErrnoToStatus(exec_error, absl::StrCat("cannot execute ", program));
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
