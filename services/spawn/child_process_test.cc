#include "services/spawn/child_process.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <string>
#include <thread>

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

}  // namespace
}  // namespace offload
