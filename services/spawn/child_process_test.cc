#include "services/spawn/child_process.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "services/spawn/child_output.h"

namespace offload {
namespace {

std::unique_ptr<ChildProcess> SpawnOrDie(std::vector<std::string> argv, bool capture = false) {
  SpawnOptions options;
  options.argv = std::move(argv);
  options.capture_output = capture;
  options.null_stdin = true;
  absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Spawn(options);
  EXPECT_TRUE(child.ok()) << child.status();
  return child.ok() ? *std::move(child) : nullptr;
}

TEST(ChildProcessTest, ReportsExitStatus) {
  std::unique_ptr<ChildProcess> child = SpawnOrDie({"/bin/sh", "-c", "exit 3"});
  ASSERT_TRUE(child->WaitFor(absl::Seconds(10)));
  EXPECT_EQ(ExitCodeOf(child->wait_status()), 3);
  EXPECT_EQ(DescribeWaitStatus(child->wait_status()), "exited with status 3");
}

TEST(ChildProcessTest, MissingProgramIsAnErrorNotAChild) {
  SpawnOptions options;
  options.argv = {"/nonexistent/program"};
  absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Spawn(options);
  ASSERT_FALSE(child.ok());
  EXPECT_EQ(child.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(child.status().message().find("/nonexistent/program"), std::string::npos);
  // The failed child was reaped inside Spawn.
  EXPECT_EQ(waitpid(-1, nullptr, WNOHANG), -1);
  EXPECT_EQ(errno, ECHILD);
}

TEST(ChildProcessTest, CapturesStdoutAndStderrLineByLine) {
  std::unique_ptr<ChildProcess> child =
      SpawnOrDie({"/bin/sh", "-c", "echo out; echo err >&2; printf tail"}, /*capture=*/true);
  LineReader reader(child->TakeOutputFd());
  std::string line;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  ASSERT_EQ(reader.ReadLine(deadline, -1, &line), LineReader::Result::kLine);
  EXPECT_EQ(line, "out");
  ASSERT_EQ(reader.ReadLine(deadline, -1, &line), LineReader::Result::kLine);
  EXPECT_EQ(line, "err");
  ASSERT_EQ(reader.ReadLine(deadline, -1, &line), LineReader::Result::kLine);
  EXPECT_EQ(line, "tail");
  EXPECT_EQ(reader.ReadLine(deadline, -1, &line), LineReader::Result::kEnd);
  EXPECT_TRUE(child->WaitFor(absl::Seconds(10)));
}

// Added variables reach the child (replacing an inherited one of the same name) without being in
// its argv; the rest of the environment is inherited.
TEST(ChildProcessTest, AddsToTheEnvironment) {
  setenv("OFFLOAD_CHILD_TEST_KEPT", "kept", 1);
  setenv("OFFLOAD_CHILD_TEST_REPLACED", "old", 1);
  SpawnOptions options;
  options.argv = {"/bin/sh", "-c",
                  "echo $OFFLOAD_CHILD_TEST_KEPT $OFFLOAD_CHILD_TEST_REPLACED "
                  "$OFFLOAD_CHILD_TEST_ADDED; env | grep -c '^OFFLOAD_CHILD_TEST_REPLACED='"};
  options.capture_output = true;
  options.env = {"OFFLOAD_CHILD_TEST_REPLACED=new", "OFFLOAD_CHILD_TEST_ADDED=added"};
  absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Spawn(options);
  ASSERT_TRUE(child.ok()) << child.status();
  LineReader reader((*child)->TakeOutputFd());
  std::string line;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  ASSERT_EQ(reader.ReadLine(deadline, -1, &line), LineReader::Result::kLine);
  EXPECT_EQ(line, "kept new added");
  ASSERT_EQ(reader.ReadLine(deadline, -1, &line), LineReader::Result::kLine);
  EXPECT_EQ(line, "1");  // replaced, not added twice
  EXPECT_TRUE((*child)->WaitFor(absl::Seconds(10)));
  unsetenv("OFFLOAD_CHILD_TEST_KEPT");
  unsetenv("OFFLOAD_CHILD_TEST_REPLACED");
}

TEST(ChildProcessTest, StartsInItsWorkingDirectory) {
  SpawnOptions options;
  options.argv = {"/bin/pwd"};
  options.capture_output = true;
  options.working_dir = "/usr/bin";
  absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Spawn(options);
  ASSERT_TRUE(child.ok()) << child.status();
  LineReader reader((*child)->TakeOutputFd());
  std::string line;
  ASSERT_EQ(reader.ReadLine(absl::Now() + absl::Seconds(10), -1, &line), LineReader::Result::kLine);
  EXPECT_EQ(line, "/usr/bin");
  EXPECT_TRUE((*child)->WaitFor(absl::Seconds(10)));

  options.working_dir = "/nonexistent/dir";
  child = ChildProcess::Spawn(options);
  ASSERT_FALSE(child.ok());
  EXPECT_EQ(child.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(child.status().message().find("working directory /nonexistent/dir"), std::string::npos)
      << child.status();
}

TEST(ChildProcessTest, LineReaderTimesOut) {
  std::unique_ptr<ChildProcess> child = SpawnOrDie({"/bin/sleep", "30"}, /*capture=*/true);
  LineReader reader(child->TakeOutputFd());
  std::string line;
  EXPECT_EQ(reader.ReadLine(absl::Now() + absl::Milliseconds(100), -1, &line),
            LineReader::Result::kTimeout);
}

TEST(ChildProcessTest, RunsInItsOwnProcessGroupAndTakesSignals) {
  std::unique_ptr<ChildProcess> child = SpawnOrDie({"/bin/sleep", "30"});
  EXPECT_EQ(getpgid(child->pid()), child->pid());
  EXPECT_FALSE(child->WaitFor(absl::Milliseconds(50)));
  ASSERT_TRUE(child->Signal(SIGTERM).ok());
  ASSERT_TRUE(child->WaitFor(absl::Seconds(10)));
  EXPECT_EQ(ExitCodeOf(child->wait_status()), 128 + SIGTERM);
  // Once reaped, signalling is a no-op rather than a shot at a recycled process group.
  EXPECT_TRUE(child->Signal(SIGKILL).ok());
}

TEST(ChildProcessTest, ChildGetsDefaultSignalDispositionsAndMask) {
  // As for a launcher started in the background by a shell: SIGINT ignored, and (as main does)
  // blocked for the signalfd.
  struct sigaction ignore = {}, previous;
  ignore.sa_handler = SIG_IGN;
  sigaction(SIGINT, &ignore, &previous);
  sigset_t block, old_mask;
  sigemptyset(&block);
  sigaddset(&block, SIGINT);
  pthread_sigmask(SIG_BLOCK, &block, &old_mask);
  std::unique_ptr<ChildProcess> child = SpawnOrDie({"/bin/sleep", "30"});
  pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
  sigaction(SIGINT, &previous, nullptr);

  ASSERT_TRUE(child->Signal(SIGINT).ok());
  ASSERT_TRUE(child->WaitFor(absl::Seconds(10)));
  ASSERT_TRUE(WIFSIGNALED(child->wait_status()));
  EXPECT_EQ(WTERMSIG(child->wait_status()), SIGINT);
}

TEST(ChildProcessTest, DiesWithTheThreadThatStartedIt) {
  std::unique_ptr<ChildProcess> child;
  std::thread([&child] { child = SpawnOrDie({"/bin/sleep", "30"}); }).join();
  ASSERT_NE(child, nullptr);
  ASSERT_TRUE(child->WaitFor(absl::Seconds(10)));
  ASSERT_TRUE(WIFSIGNALED(child->wait_status()));
  EXPECT_EQ(WTERMSIG(child->wait_status()), SIGKILL);
}

TEST(ChildProcessTest, DestructorKillsAndReaps) {
  pid_t pid;
  {
    std::unique_ptr<ChildProcess> child = SpawnOrDie({"/bin/sleep", "30"});
    pid = child->pid();
  }
  EXPECT_EQ(kill(pid, 0), -1);
  EXPECT_EQ(errno, ESRCH);
}

// Users no account of this machine has: what they can read is what "other" may.
constexpr uid_t kOtherUid = 20001;
constexpr gid_t kOtherGid = 20002;
constexpr gid_t kOtherGroup = 20003;

RunAs OtherUser() { return RunAs{kOtherUid, kOtherGid, {kOtherGroup}}; }

TEST(ChildProcessTest, RunsAsAnotherUserWithOnlyTheGroupsGiven) {
  if (geteuid() != 0) GTEST_SKIP() << "switching users needs root here";
  SpawnOptions options;
  options.argv = {"/bin/sh", "-c", "id -u; id -g; id -G"};
  options.capture_output = true;
  options.null_stdin = true;
  options.working_dir = "/";
  options.run_as = OtherUser();
  absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Spawn(options);
  ASSERT_TRUE(child.ok()) << child.status();
  LineReader output((*child)->TakeOutputFd());
  std::vector<std::string> lines;
  std::string line;
  while (output.ReadLine(absl::Now() + absl::Seconds(10), -1, &line) == LineReader::Result::kLine) {
    lines.push_back(line);
  }
  ASSERT_TRUE((*child)->WaitFor(absl::Seconds(10)));
  EXPECT_EQ(lines, (std::vector<std::string>{"20001", "20002", "20002 20003"}));
}

TEST(ChildProcessTest, AChildRunAsAnotherUserStillDiesWithItsThread) {
  if (geteuid() != 0) GTEST_SKIP() << "switching users needs root here";
  std::unique_ptr<ChildProcess> child;
  std::thread([&child] {
    SpawnOptions options;
    options.argv = {"/bin/sleep", "30"};
    options.run_as = OtherUser();
    absl::StatusOr<std::unique_ptr<ChildProcess>> spawned = ChildProcess::Spawn(options);
    ASSERT_TRUE(spawned.ok()) << spawned.status();
    child = *std::move(spawned);
  }).join();
  ASSERT_NE(child, nullptr);
  ASSERT_TRUE(child->WaitFor(absl::Seconds(10)));
  ASSERT_TRUE(WIFSIGNALED(child->wait_status()));
  EXPECT_EQ(WTERMSIG(child->wait_status()), SIGKILL);
}

TEST(ChildProcessTest, ReadableAsTriesEachPathAsTheOtherUser) {
  if (geteuid() != 0) GTEST_SKIP() << "switching users needs root here";
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("offload-readable-as-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  chmod(dir.c_str(), 0755);
  const std::string secret = (dir / "secret").string();
  const std::string open_file = (dir / "open").string();
  const std::string group_file = (dir / "group").string();
  for (const std::string& path : {secret, open_file, group_file}) std::ofstream(path) << "x";
  chmod(secret.c_str(), 0600);
  chmod(open_file.c_str(), 0644);
  ASSERT_EQ(chown(group_file.c_str(), 0, kOtherGroup), 0);
  chmod(group_file.c_str(), 0640);
  absl::StatusOr<std::vector<std::string>> readable =
      ReadableAs(OtherUser(), {secret, open_file, group_file, (dir / "missing").string()});
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(readable.ok()) << readable.status();
  EXPECT_EQ(*readable, (std::vector<std::string>{open_file, group_file}));
}

// Without CAP_SETUID (a child process of the test that gave root up) both refuse, saying so.
TEST(ChildProcessTest, SwitchingUsersWithoutTheCapabilityIsAClearError) {
  if (geteuid() != 0) GTEST_SKIP() << "giving root up needs root here";
  const pid_t pid = fork();
  if (pid == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(2);
    absl::StatusOr<std::vector<std::string>> readable = ReadableAs(OtherUser(), {"/"});
    if (readable.ok() || !absl::StrContains(readable.status().message(), "CAP_SETUID")) _exit(3);
    SpawnOptions options;
    options.argv = {"/bin/true"};
    options.run_as = OtherUser();
    absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Spawn(options);
    if (child.ok() || !absl::StrContains(child.status().message(), "as uid 20001") ||
        !absl::StrContains(child.status().message(), "CAP_SETUID")) {
      _exit(4);
    }
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "2: could not give root up, 3: ReadableAs, 4: Spawn";
}

TEST(ChildProcessTest, KillEveryProcessOfEndsWhatAChildLeftBehind) {
  if (geteuid() != 0) GTEST_SKIP() << "switching users needs root here";
  // A uid of this test alone: the kill reaches every process of it.
  const RunAs who{20011, 20011, {}};
  SpawnOptions options;
  options.argv = {"/bin/sh", "-c", "setsid sleep 60 </dev/null >/dev/null 2>&1 & echo $!"};
  options.capture_output = true;
  options.null_stdin = true;
  options.working_dir = "/";
  options.run_as = who;
  absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Spawn(options);
  ASSERT_TRUE(child.ok()) << child.status();
  LineReader output((*child)->TakeOutputFd());
  std::string line;
  ASSERT_EQ(output.ReadLine(absl::Now() + absl::Seconds(10), -1, &line), LineReader::Result::kLine);
  ASSERT_TRUE((*child)->WaitFor(absl::Seconds(10)));
  const pid_t left = std::stoi(line);
  const std::string stat = "/proc/" + line + "/stat";
  // Gone, or a zombie its new parent has not reaped yet.
  auto alive = [&stat] {
    std::ifstream in(stat);
    std::string pid, name, state;
    return in >> pid >> name >> state && state != "Z";
  };
  ASSERT_TRUE(alive()) << "the process the child left (" << left << ") is not running";
  ASSERT_TRUE(KillEveryProcessOf(who).ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (alive() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_FALSE(alive()) << "pid " << left << " outlived KillEveryProcessOf";
  // Nothing left to kill is not an error.
  EXPECT_TRUE(KillEveryProcessOf(who).ok());
}

}  // namespace
}  // namespace offload
