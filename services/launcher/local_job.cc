#include "services/launcher/local_job.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <deque>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace offload {
namespace {

// SIGCHLD wakes the launcher when a child exits; this only bounds the wait should one be missed.
constexpr absl::Duration kPollInterval = absl::Milliseconds(200);
// Enough of a failed server's output to say why, without flooding the terminal.
constexpr size_t kStartupLinesKept = 50;

constexpr absl::string_view kPortMarker = "listening port=";

std::string SignalName(int signo) {
  if (signo == SIGINT) return "SIGINT";
  if (signo == SIGTERM) return "SIGTERM";
  return absl::StrCat("signal ", signo);
}

// The port a server announces; 0 if `line` is not the announcement.
int ParsePort(absl::string_view line) {
  const size_t at = line.find(kPortMarker);
  if (at == absl::string_view::npos) return 0;
  absl::string_view digits = line.substr(at + kPortMarker.size());
  digits = digits.substr(0, std::min(digits.find_first_not_of("0123456789"), digits.size()));
  int port = 0;
  if (!absl::SimpleAtoi(digits, &port) || port <= 0 || port > 65535) return 0;
  return port;
}

void Say(absl::string_view message) { WriteStderrLine(absl::StrCat("offload_local: ", message)); }

// Checked before anything starts, so a wrong path fails at once instead of after the servers
// have loaded.
absl::Status CheckExecutable(absl::string_view what, const std::string& path) {
  if (access(path.c_str(), X_OK) == 0) return absl::OkStatus();
  return absl::ErrnoToStatus(errno, absl::StrCat("cannot execute the ", what, " ", path));
}

bool StoppedNormally(int wait_status) {
  return (WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0) ||
         (WIFSIGNALED(wait_status) && WTERMSIG(wait_status) == SIGTERM);
}

}  // namespace

LocalJob::LocalJob(LocalJobOptions options, SignalFd* signals)
    : options_(std::move(options)), signals_(signals) {}

LocalJob::~LocalJob() {
  KillEverything();  // a no-op for children already reaped
  JoinForwarders();
}

JobOutcome LocalJob::Run() {
  for (absl::Status s : {CheckExecutable("server binary", options_.server_binary),
                         CheckExecutable("trainer binary", options_.trainer_binary)}) {
    if (!s.ok()) return {1, std::string(s.message())};
  }
  absl::Status started = StartServers();
  if (started.ok()) started = StartTrainer();
  JobOutcome outcome;
  if (started.ok()) {
    outcome = Monitor();
  } else {
    shutting_down_ = true;
    StopServers();
    outcome = stop_signal_ != 0 ? JobOutcome{128 + stop_signal_,
                                             absl::StrCat("stopped by ", SignalName(stop_signal_),
                                                          " before the trainer started")}
                                : JobOutcome{1, std::string(started.message())};
  }
  if (kill_signal_ != 0) {
    outcome.exit_code = 128 + kill_signal_;
    absl::StrAppend(&outcome.summary, "; killed everything on a second ", SignalName(kill_signal_));
  }
  return outcome;
}

absl::Status LocalJob::StartServers() {
  shards_.resize(options_.num_shards);
  std::vector<std::string> argv = {options_.server_binary, "--listen=127.0.0.1:0"};
  argv.insert(argv.end(), options_.server_args.begin(), options_.server_args.end());
  // All servers start at once and load in parallel; their ports are collected afterwards.
  for (int k = 0; k < options_.num_shards; ++k) {
    SpawnOptions spawn;
    spawn.argv = argv;
    spawn.capture_output = true;
    spawn.null_stdin = true;
    absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Spawn(spawn);
    if (!child.ok()) {
      return absl::Status(child.status().code(),
                          absl::StrCat("cannot start shard ", k, ": ", child.status().message()));
    }
    shards_[k].process = *std::move(child);
    shards_[k].output = std::make_unique<LineReader>(shards_[k].process->TakeOutputFd());
  }
  const absl::Time deadline = absl::Now() + options_.startup_timeout;
  for (int k = 0; k < options_.num_shards; ++k) {
    if (absl::Status s = AwaitPort(k, deadline); !s.ok()) return s;
  }
  for (int k = 0; k < options_.num_shards; ++k) {
    Shard& shard = shards_[k];
    Say(absl::StrCat("shard ", k, " listening on 127.0.0.1:", shard.port, " (pid ",
                     shard.process->pid(), ")"));
    shard.forwarder = ForwardLines(std::move(shard.output), absl::StrCat("[shard ", k, "] "));
  }
  return absl::OkStatus();
}

absl::Status LocalJob::AwaitPort(int k, absl::Time deadline) {
  Shard& shard = shards_[k];
  const std::string prefix = absl::StrCat("[shard ", k, "] ");
  // Held back until the port is known, so that a failure shows them next to its reason and a
  // success shows them in the same form as everything the server prints later.
  std::deque<std::string> lines;
  LineReader::Result result;
  for (;;) {
    std::string line;
    result = shard.output->ReadLine(deadline, signals_->fd(), &line);
    if (result == LineReader::Result::kLine) {
      shard.port = ParsePort(line);
      lines.push_back(std::move(line));
      if (lines.size() > kStartupLinesKept) lines.pop_front();
      if (shard.port != 0) {
        for (const std::string& l : lines) WriteStderrLine(absl::StrCat(prefix, l));
        return absl::OkStatus();
      }
    } else if (result == LineReader::Result::kWoken) {
      const int signo = signals_->Wait(absl::InfinitePast());
      if (signo == SIGINT || signo == SIGTERM) {
        HandleSignal(signo);
        return absl::CancelledError(SignalName(signo));
      }
      // Otherwise SIGCHLD: if it was this server, the end of its output will tell.
    } else {
      break;
    }
  }
  for (const std::string& l : lines) WriteStderrLine(absl::StrCat(prefix, l));
  const std::string last =
      lines.empty() ? "it printed nothing" : absl::StrCat("last output: ", lines.back());
  const std::string who = absl::StrCat("shard ", k, " (", shard.process->program(), ", pid ",
                                       shard.process->pid(), ")");
  if (result == LineReader::Result::kTimeout) {
    return absl::DeadlineExceededError(
        absl::StrCat(who, " did not report '", kPortMarker, "N' within ",
                     absl::FormatDuration(options_.startup_timeout), "; ", last));
  }
  // A server that closed its output is normally exiting; give it a moment so the message can say
  // how.
  if (shard.process->WaitFor(absl::Seconds(1))) {
    return absl::UnavailableError(absl::StrCat(who, " ",
                                               DescribeWaitStatus(shard.process->wait_status()),
                                               " before it was listening; ", last));
  }
  return absl::UnavailableError(
      absl::StrCat(who, " closed its output before it was listening; ", last));
}

absl::Status LocalJob::StartTrainer() {
  std::vector<std::string> shard_addresses;
  for (const Shard& shard : shards_) {
    shard_addresses.push_back(absl::StrCat("127.0.0.1:", shard.port));
  }
  std::vector<std::string> argv = {options_.trainer_binary,
                                   absl::StrCat("--shards=", absl::StrJoin(shard_addresses, ","))};
  argv.insert(argv.end(), options_.trainer_args.begin(), options_.trainer_args.end());
  // The trainer keeps the launcher's terminal: it draws a progress bar when stdout is one.
  SpawnOptions spawn;
  spawn.argv = std::move(argv);
  absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Spawn(spawn);
  if (!child.ok()) {
    return absl::Status(child.status().code(),
                        absl::StrCat("cannot start the trainer: ", child.status().message()));
  }
  trainer_ = *std::move(child);
  Say(absl::StrCat("trainer started (pid ", trainer_->pid(),
                   "): ", absl::StrJoin(spawn.argv, " ")));
  return absl::OkStatus();
}

JobOutcome LocalJob::Monitor() {
  for (;;) {
    // A dead server goes first: it is usually why the trainer failed too.
    for (int k = 0; k < options_.num_shards; ++k) {
      if (shards_[k].process->WaitFor(absl::ZeroDuration())) return AfterServerDied(k);
    }
    if (trainer_->WaitFor(absl::ZeroDuration())) return AfterTrainerExit();
    if (stop_signal_ != 0) return AfterStopSignal();
    const int signo = signals_->Wait(absl::Now() + kPollInterval);
    if (signo == SIGINT || signo == SIGTERM) HandleSignal(signo);
  }
}

JobOutcome LocalJob::AfterStopSignal() {
  shutting_down_ = true;
  Say(absl::StrCat(
      SignalName(stop_signal_), ": letting the trainer finish its step and checkpoint (up to ",
      absl::FormatDuration(options_.shutdown_timeout), "); Ctrl-C again kills everything"));
  StopTrainer(options_.shutdown_timeout);
  StopServers();
  return {128 + stop_signal_, absl::StrCat("stopped on ", SignalName(stop_signal_), "; trainer ",
                                           DescribeWaitStatus(trainer_->wait_status()))};
}

JobOutcome LocalJob::AfterServerDied(int k) {
  shutting_down_ = true;
  const ChildProcess& dead = *shards_[k].process;
  std::string what =
      absl::StrCat("shard ", k, " (pid ", dead.pid(), ") ", DescribeWaitStatus(dead.wait_status()),
                   " while the trainer was running");
  Say(absl::StrCat(what, "; stopping the job"));
  StopTrainer(options_.kill_timeout);
  StopServers();
  return {1, absl::StrCat(what, "; trainer ", DescribeWaitStatus(trainer_->wait_status()))};
}

JobOutcome LocalJob::AfterTrainerExit() {
  shutting_down_ = true;
  StopServers();
  const int status = trainer_->wait_status();
  return {ExitCodeOf(status), absl::StrCat("trainer ", DescribeWaitStatus(status))};
}

void LocalJob::StopTrainer(absl::Duration grace) {
  trainer_->Signal(SIGINT).IgnoreError();
  if (!WaitForChild(*trainer_, absl::Now() + grace)) {
    Say(absl::StrCat("the trainer did not stop within ", absl::FormatDuration(grace),
                     " of SIGINT; killing it"));
    trainer_->Signal(SIGKILL).IgnoreError();
    trainer_->WaitFor(absl::InfiniteDuration());
  }
}

void LocalJob::StopServers() {
  std::vector<int> stopping;
  for (int k = 0; k < static_cast<int>(shards_.size()); ++k) {
    ChildProcess* process = shards_[k].process.get();
    if (process == nullptr || process->reaped()) continue;
    process->Signal(SIGTERM).IgnoreError();
    stopping.push_back(k);
  }
  const absl::Time deadline = absl::Now() + options_.kill_timeout;
  for (int k : stopping) {
    ChildProcess& process = *shards_[k].process;
    if (!WaitForChild(process, deadline)) {
      Say(absl::StrCat("shard ", k, " did not stop within ",
                       absl::FormatDuration(options_.kill_timeout), " of SIGTERM; killing it"));
      process.Signal(SIGKILL).IgnoreError();
      process.WaitFor(absl::InfiniteDuration());
    } else if (kill_signal_ == 0 && !StoppedNormally(process.wait_status())) {
      Say(absl::StrCat("shard ", k, " (pid ", process.pid(), ") ",
                       DescribeWaitStatus(process.wait_status())));
    }
  }
  JoinForwarders();
}

void LocalJob::KillEverything() {
  for (Shard& shard : shards_) {
    if (shard.process != nullptr) shard.process->Signal(SIGKILL).IgnoreError();
  }
  if (trainer_ != nullptr) trainer_->Signal(SIGKILL).IgnoreError();
  for (Shard& shard : shards_) {
    if (shard.process != nullptr) shard.process->WaitFor(absl::InfiniteDuration());
  }
  if (trainer_ != nullptr) trainer_->WaitFor(absl::InfiniteDuration());
}

void LocalJob::HandleSignal(int signo) {
  if (!shutting_down_ && stop_signal_ == 0) {
    stop_signal_ = signo;
    return;
  }
  if (kill_signal_ != 0) return;
  kill_signal_ = signo;
  Say(absl::StrCat(SignalName(signo), " again: killing everything"));
  KillEverything();
}

bool LocalJob::WaitForChild(ChildProcess& child, absl::Time deadline) {
  while (!child.WaitFor(absl::ZeroDuration())) {
    const absl::Time now = absl::Now();
    if (now >= deadline) return false;
    const int signo = signals_->Wait(std::min(deadline, now + kPollInterval));
    if (signo == SIGINT || signo == SIGTERM) HandleSignal(signo);
  }
  return true;
}

void LocalJob::JoinForwarders() {
  for (Shard& shard : shards_) {
    if (shard.forwarder.joinable()) shard.forwarder.join();
  }
}

}  // namespace offload
