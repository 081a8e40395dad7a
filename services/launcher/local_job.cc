#include "services/launcher/local_job.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/security/security.h"
#include "base/status_macros.h"
#include "services/spawn/rank_devices.h"

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

bool ExitedCleanly(int wait_status) {
  return WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0;
}

bool StoppedNormally(int wait_status) {
  return ExitedCleanly(wait_status) ||
         (WIFSIGNALED(wait_status) && WTERMSIG(wait_status) == SIGTERM);
}

}  // namespace

LocalJob::LocalJob(LocalJobOptions options, SignalFd* signals)
    : options_(std::move(options)), signals_(signals) {}

LocalJob::~LocalJob() {
  KillEverything();  // a no-op for children already reaped
  JoinForwarders();
  RemoveRendezvous();
}

JobOutcome LocalJob::Run() {
  for (absl::Status s : {CheckExecutable("server binary", options_.server_binary),
                         CheckExecutable("trainer binary", options_.trainer_binary)}) {
    if (!s.ok()) return {1, std::string(s.message())};
  }
  // Each CUDA rank's GPU, before anything starts: a host without enough of them fails the job now.
  absl::StatusOr<std::vector<std::string>> device_flags =
      CudaDeviceFlags(options_.trainer_args, options_.num_ranks);
  if (!device_flags.ok()) return {1, std::string(device_flags.status().message())};
  rank_device_flags_ = *std::move(device_flags);
  absl::Status started = StartServers();
  if (started.ok()) started = CreateRendezvous();
  if (started.ok()) started = StartRanks();
  JobOutcome outcome;
  if (started.ok()) {
    outcome = Monitor();
  } else {
    shutting_down_ = true;
    // Ranks started before one failed to would otherwise wait for their missing peer until their
    // collective timeout.
    StopRanks(options_.kill_timeout);
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
  // The servers refuse callers without a token; this run's own one reaches them and the ranks in
  // the environment, never in argv.
  OFFLOAD_ASSIGN_OR_RETURN(shard_token_, RandomToken());
  shards_.resize(options_.num_shards);
  std::vector<std::string> argv = {options_.server_binary, "--listen=127.0.0.1:0"};
  argv.insert(argv.end(), options_.server_args.begin(), options_.server_args.end());
  // All servers start at once and load in parallel; their ports are collected afterwards.
  for (int k = 0; k < options_.num_shards; ++k) {
    SpawnOptions spawn;
    spawn.argv = argv;
    spawn.capture_output = true;
    spawn.null_stdin = true;
    spawn.env = {absl::StrCat("OFFLOAD_TOKEN=", shard_token_)};
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
    OFFLOAD_RETURN_IF_ERROR(AwaitPort(k, deadline));
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

absl::Status LocalJob::CreateRendezvous() {
  if (options_.num_ranks == 1) return absl::OkStatus();
  // A fresh directory per job: one left behind by a launcher killed with -9 would otherwise show
  // the ranks a dead job's peers.
  const char* tmpdir = std::getenv("TMPDIR");
  std::string path = absl::StrCat(tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp",
                                  "/offload-rendezvous-XXXXXX");
  if (mkdtemp(path.data()) == nullptr) {
    return absl::ErrnoToStatus(errno,
                               absl::StrCat("cannot create the rendezvous directory ", path));
  }
  rendezvous_dir_ = std::move(path);
  return absl::OkStatus();
}

void LocalJob::RemoveRendezvous() {
  if (rendezvous_dir_.empty()) return;
  std::error_code error;
  std::filesystem::remove_all(rendezvous_dir_, error);
  if (error) {
    Say(absl::StrCat("cannot remove the rendezvous directory ", rendezvous_dir_, ": ",
                     error.message()));
  }
  rendezvous_dir_.clear();
}

absl::Status LocalJob::StartRanks() {
  std::vector<std::string> shard_addresses;
  for (const Shard& shard : shards_) {
    shard_addresses.push_back(absl::StrCat("127.0.0.1:", shard.port));
  }
  const std::string shards_flag = absl::StrCat("--shards=", absl::StrJoin(shard_addresses, ","));
  ranks_.reserve(options_.num_ranks);
  for (int r = 0; r < options_.num_ranks; ++r) {
    SpawnOptions spawn;
    spawn.argv = {options_.trainer_binary, shards_flag};
    spawn.env = {absl::StrCat(kShardTokenEnv, "=", shard_token_)};
    if (options_.num_ranks > 1) {
      spawn.argv.push_back(absl::StrCat("--rank=", r));
      spawn.argv.push_back(absl::StrCat("--world_size=", options_.num_ranks));
      spawn.argv.push_back(absl::StrCat("--rendezvous=", rendezvous_dir_));
    }
    spawn.argv.insert(spawn.argv.end(), options_.trainer_args.begin(), options_.trainer_args.end());
    if (!rank_device_flags_[r].empty()) spawn.argv.push_back(rank_device_flags_[r]);
    // Rank 0 keeps the launcher's terminal: it draws a progress bar when stdout is one. The other
    // ranks' output would tear it, so it comes through a pipe, line by line and marked; and in a
    // background process group they must not read the terminal either (SIGTTIN would stop them).
    spawn.capture_output = r > 0;
    spawn.null_stdin = r > 0;
    absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Spawn(spawn);
    if (!child.ok()) {
      return absl::Status(child.status().code(), absl::StrCat("cannot start the ", RankName(r),
                                                              ": ", child.status().message()));
    }
    Rank& rank = ranks_.emplace_back();
    rank.process = *std::move(child);
    if (r > 0) {
      rank.forwarder = ForwardLines(std::make_unique<LineReader>(rank.process->TakeOutputFd()),
                                    absl::StrCat("[rank ", r, "] "));
    }
    Say(absl::StrCat(RankName(r), " started (pid ", rank.process->pid(),
                     "): ", absl::StrJoin(spawn.argv, " ")));
  }
  return absl::OkStatus();
}

JobOutcome LocalJob::Monitor() {
  for (;;) {
    // A dead server goes first: it is usually why the ranks failed too.
    for (int k = 0; k < options_.num_shards; ++k) {
      if (shards_[k].process->WaitFor(absl::ZeroDuration())) return AfterServerDied(k);
    }
    // A rank that finished cleanly leaves the others running: they finish on their own.
    bool all_exited = true;
    for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
      ChildProcess& process = *ranks_[r].process;
      if (!process.WaitFor(absl::ZeroDuration())) {
        all_exited = false;
      } else if (!ExitedCleanly(process.wait_status())) {
        return AfterRankFailed(r);
      }
    }
    if (all_exited) return AfterRanksSucceeded();
    if (stop_signal_ != 0) return AfterStopSignal();
    const int signo = signals_->Wait(absl::Now() + kPollInterval);
    if (signo == SIGINT || signo == SIGTERM) HandleSignal(signo);
  }
}

JobOutcome LocalJob::AfterStopSignal() {
  shutting_down_ = true;
  Say(absl::StrCat(SignalName(stop_signal_), ": letting ",
                   options_.num_ranks == 1 ? "the trainer" : "every trainer rank",
                   " finish its step and checkpoint (up to ",
                   absl::FormatDuration(options_.shutdown_timeout),
                   "); Ctrl-C again kills everything"));
  StopRanks(options_.shutdown_timeout);
  StopServers();
  return {128 + stop_signal_,
          absl::StrCat("stopped on ", SignalName(stop_signal_), "; ", DescribeRanks())};
}

JobOutcome LocalJob::AfterServerDied(int k) {
  shutting_down_ = true;
  const ChildProcess& dead = *shards_[k].process;
  std::string what =
      absl::StrCat("shard ", k, " (pid ", dead.pid(), ") ", DescribeWaitStatus(dead.wait_status()),
                   " while the trainer was running");
  Say(absl::StrCat(what, "; stopping the job"));
  StopRanks(options_.kill_timeout);
  StopServers();
  return {1, absl::StrCat(what, "; ", DescribeRanks())};
}

JobOutcome LocalJob::AfterRankFailed(int r) {
  shutting_down_ = true;
  const ChildProcess& failed = *ranks_[r].process;
  JobOutcome outcome{ExitCodeOf(failed.wait_status()),
                     absl::StrCat(RankName(r), " ", DescribeWaitStatus(failed.wait_status()))};
  if (options_.num_ranks > 1) {
    // The others would notice the missing peer only at their collective timeout, and a
    // checkpoint written now could not hold this rank's part of the step anyway.
    Say(absl::StrCat(RankName(r), " (pid ", failed.pid(), ") ",
                     DescribeWaitStatus(failed.wait_status()), "; stopping the other ranks"));
    StopRanks(options_.kill_timeout);
    absl::StrAppend(&outcome.summary, "; ", DescribeRanks(r));
  }
  StopServers();
  return outcome;
}

JobOutcome LocalJob::AfterRanksSucceeded() {
  shutting_down_ = true;
  StopServers();
  return {0, options_.num_ranks == 1
                 ? DescribeRanks()
                 : absl::StrCat("all ", options_.num_ranks, " trainer ranks exited with status 0")};
}

std::string LocalJob::RankName(int r) const {
  return options_.num_ranks == 1 ? "trainer" : absl::StrCat("trainer rank ", r);
}

std::string LocalJob::DescribeRanks(int except) const {
  std::vector<std::string> parts;
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
    if (r == except) continue;
    parts.push_back(
        absl::StrCat(RankName(r), " ", DescribeWaitStatus(ranks_[r].process->wait_status())));
  }
  return absl::StrJoin(parts, ", ");
}

void LocalJob::StopRanks(absl::Duration grace) {
  for (Rank& rank : ranks_) rank.process->Signal(SIGINT).IgnoreError();  // no-op once reaped
  // One deadline for all: the ranks checkpoint in parallel, so the job stops within `grace`.
  const absl::Time deadline = absl::Now() + grace;
  for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
    ChildProcess& process = *ranks_[r].process;
    if (WaitForChild(process, deadline)) continue;
    Say(absl::StrCat(RankName(r), " did not stop within ", absl::FormatDuration(grace),
                     " of SIGINT; killing it"));
    process.Signal(SIGKILL).IgnoreError();
    process.WaitFor(absl::InfiniteDuration());
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
  for (Rank& rank : ranks_) rank.process->Signal(SIGKILL).IgnoreError();
  for (Shard& shard : shards_) {
    if (shard.process != nullptr) shard.process->WaitFor(absl::InfiniteDuration());
  }
  for (Rank& rank : ranks_) rank.process->WaitFor(absl::InfiniteDuration());
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
  for (Rank& rank : ranks_) {
    if (rank.forwarder.joinable()) rank.forwarder.join();
  }
}

}  // namespace offload
