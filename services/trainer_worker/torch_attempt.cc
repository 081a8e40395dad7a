#include "services/trainer_worker/torch_attempt.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "base/grpc_status.h"
#include "base/logging.h"
#include "base/security/security.h"
#include "base/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "jobs/spec/job_spec.h"
#include "jobs/worker/progress_client.h"
#include "offload/v1/worker.grpc.pb.h"
#include "optimizer_client/checkpoint/atomic_file.h"
#include "services/spawn/child_output.h"
#include "services/spawn/child_process.h"

namespace offload {
namespace {

// How often the worker looks at the script's progress and the controller's answer: a report
// reaches the controller within this plus the progress client's own interval.
constexpr absl::Duration kTick = absl::Milliseconds(200);
// A progress file is a few hundred bytes; one far larger is not the script's report.
constexpr size_t kMaxProgressBytes = 64 << 10;
constexpr char kMasterKey[] = "torch/master";

// The script's file, as the script left it: not through a link (the script may own the directory,
// and a link to the worker's token would have the worker read it out), a regular file of at most
// twice the largest report (a larger one is refused by ParseScriptProgress, which says so).
bool ReadScriptFile(const std::string& path, std::string* text) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return false;
  struct stat st;
  bool ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_nlink == 1 &&
            static_cast<size_t>(st.st_size) <= 2 * kMaxProgressBytes;
  if (ok) {
    text->assign(static_cast<size_t>(st.st_size), '\0');
    ssize_t n;
    do {
      n = pread(fd, text->data(), text->size(), 0);
    } while (n < 0 && errno == EINTR);
    ok = n >= 0;
    if (ok) text->resize(static_cast<size_t>(n));
  }
  close(fd);
  return ok;
}

// A port nobody listens on now, for rank 0's torch.distributed store. Another process could take
// it before the script binds it; the attempt then fails and restarts with a new one.
absl::StatusOr<int> FreePort() {
  const int fd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::ErrnoToStatus(errno, "socket");
  sockaddr_in6 address = {};
  address.sin6_family = AF_INET6;
  address.sin6_addr = in6addr_any;
  socklen_t length = sizeof(address);
  int port = -1;
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port = ntohs(address.sin6_port);
  }
  const int error = errno;
  close(fd);
  if (port < 0) return absl::ErrnoToStatus(error, "finding a free port");
  return port;
}

// Rank 0 publishes "host:port" in the attempt's rendezvous store; every other rank waits for it.
absl::StatusOr<std::string> AgreeOnMaster(const v1::Assignment& a,
                                          const TorchAttemptOptions& options) {
  std::unique_ptr<v1::WorkerService::Stub> stub = v1::WorkerService::NewStub(options.channel);
  v1::AttemptRef attempt;
  attempt.set_job_id(a.job_id());
  attempt.set_attempt(a.attempt());
  const absl::Time give_up = absl::Now() + options.rendezvous_timeout;
  if (a.rank() == 0) {
    absl::StatusOr<int> port = FreePort();
    if (!port.ok()) return port.status();
    const std::string master = absl::StrCat(options.rank_address, ":", *port);
    v1::RendezvousSetRequest request;
    *request.mutable_attempt() = attempt;
    request.set_key(kMasterKey);
    request.set_value(master);
    absl::Status last;
    while (absl::Now() < give_up && !(options.withdrawn && options.withdrawn())) {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
      AttachBearer(&context, options.token);
      v1::RendezvousSetResponse response;
      grpc::Status s = stub->RendezvousSet(&context, request, &response);
      if (s.ok()) return master;
      last = FromGrpcStatus(s);
      if (last.code() != absl::StatusCode::kUnavailable &&
          last.code() != absl::StatusCode::kDeadlineExceeded) {
        break;
      }
      absl::SleepFor(absl::Seconds(1));
    }
    return absl::Status(last.code(), absl::StrCat("publishing rank 0's address in the "
                                                  "controller's rendezvous: ",
                                                  last.message()));
  }
  v1::RendezvousGetRequest request;
  *request.mutable_attempt() = attempt;
  request.add_keys(kMasterKey);
  request.set_timeout_ms(10000);
  absl::Status last = absl::DeadlineExceededError("no answer");
  while (absl::Now() < give_up && !(options.withdrawn && options.withdrawn())) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(15)));
    AttachBearer(&context, options.token);
    v1::RendezvousGetResponse response;
    grpc::Status s = stub->RendezvousGet(&context, request, &response);
    if (s.ok() && response.values_size() == 1) return response.values(0);
    last = s.ok() ? absl::InternalError("the controller answered no value") : FromGrpcStatus(s);
    if (last.code() != absl::StatusCode::kUnavailable &&
        last.code() != absl::StatusCode::kDeadlineExceeded) {
      break;
    }
  }
  return absl::Status(last.code(), absl::StrCat("waiting for rank 0's address in the controller's "
                                                "rendezvous: ",
                                                last.message()));
}

v1::AttemptResult Failed(v1::AttemptResult result, std::string message) {
  result.set_exit_code(127);
  result.set_message(std::move(message));
  return result;
}

// The directories of an attempt, removed with it: by then no process of a script user is left
// to swap a link into them.
struct AttemptDirs {
  std::string control;  // the script's and the worker's: progress.json one way, request.json back
  std::string home;     // a script of its own user: its $HOME (the worker's is not its to write)
  AttemptDirs() = default;
  AttemptDirs(const AttemptDirs&) = delete;
  AttemptDirs& operator=(const AttemptDirs&) = delete;
  ~AttemptDirs() {
    std::error_code ignored;
    for (const std::string* dir : {&control, &home}) {
      if (!dir->empty()) std::filesystem::remove_all(*dir, ignored);
    }
  }
};

absl::Status MakeTempDir(const char* prefix, std::string* dir) {
  std::string name = (std::filesystem::temp_directory_path() / prefix).string() + "-XXXXXX";
  if (mkdtemp(name.data()) == nullptr) {
    return absl::ErrnoToStatus(errno, absl::StrCat("creating a directory ", name));
  }
  *dir = std::move(name);
  return absl::OkStatus();
}

absl::Status MakeAttemptDirs(const std::optional<RunAs>& run_as, AttemptDirs* dirs) {
  OFFLOAD_RETURN_IF_ERROR(MakeTempDir("offload-torch", &dirs->control));
  if (!run_as) return absl::OkStatus();
  // A script of its own user writes its files in the control directory but may not own it (it
  // could move it and leave a link to another in its place): the worker's, in the script user's
  // group, sticky, so neither can replace the other's files.
  if (chown(dirs->control.c_str(), static_cast<uid_t>(-1), run_as->gid) != 0 ||
      chmod(dirs->control.c_str(), 01770) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("handing the control directory ", dirs->control,
                                                   " to the script's user"));
  }
  OFFLOAD_RETURN_IF_ERROR(MakeTempDir("offload-home", &dirs->home));
  if (chown(dirs->home.c_str(), run_as->uid, run_as->gid) != 0 ||
      chmod(dirs->home.c_str(), 0700) != 0) {
    return absl::ErrnoToStatus(
        errno, absl::StrCat("handing the home directory ", dirs->home, " to the script's user"));
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<std::string> TorchEnvironment(const v1::Assignment& a, const std::string& control_dir,
                                          const std::string& master) {
  const v1::JobSpec& spec = a.spec();
  std::vector<std::string> env = {
      absl::StrCat("OFFLOAD_SERVERS=", absl::StrJoin(a.shard_addresses(), ",")),
      // The attempt's shard secret: what the optimizer servers accept for OFFLOAD_JOB_ID. The
      // worker's own token for the controller is not the script's business.
      absl::StrCat("OFFLOAD_TOKEN=", a.shard_secret()),
      absl::StrCat("OFFLOAD_SHARD_TOKEN=", a.shard_secret()),
      absl::StrCat("OFFLOAD_JOB_ID=", a.shard_job_id()),
      absl::StrCat("OFFLOAD_CHECKPOINT_DIR=", spec.checkpoint().dir()),
      absl::StrCat("OFFLOAD_TRANSPORT=",
                   spec.parallel().has_transport() ? spec.parallel().transport() : "auto"),
      absl::StrCat("OFFLOAD_CONTROL_DIR=", control_dir),
      absl::StrCat("RANK=", a.rank()),
      absl::StrCat("WORLD_SIZE=", std::max(a.world_size(), 1u)),
      absl::StrCat("LOCAL_RANK=", a.local_rank()),
      absl::StrCat("LOCAL_WORLD_SIZE=", std::max(a.local_ranks(), a.local_rank() + 1)),
  };
  // Validated with the spec; a torch job's script has no flags of ours to take it.
  if (absl::StatusOr<absl::Duration> floor = ShardStepTimeoutFloor(spec.parallel());
      spec.parallel().has_shard_step_timeout_floor() && floor.ok()) {
    env.push_back(absl::StrCat("OFFLOAD_STEP_TIMEOUT_FLOOR=", absl::ToDoubleSeconds(*floor)));
  }
  const size_t colon = master.rfind(':');
  if (colon != std::string::npos) {
    env.push_back(absl::StrCat("MASTER_ADDR=", master.substr(0, colon)));
    env.push_back(absl::StrCat("MASTER_PORT=", master.substr(colon + 1)));
  } else {
    env.push_back("MASTER_ADDR=127.0.0.1");
    env.push_back("MASTER_PORT=0");
  }
  return env;
}

std::vector<std::string> TorchTlsEnvironment(const std::vector<std::string>& security_flags,
                                             bool client_identity) {
  std::vector<std::string> env;
  for (const absl::string_view name : {"tls_ca", "tls_cert", "tls_key", "tls_server_name"}) {
    if (!client_identity && (name == "tls_cert" || name == "tls_key")) continue;
    const std::string prefix = absl::StrCat("--", name, "=");
    for (const std::string& flag : security_flags) {
      if (flag.rfind(prefix, 0) == 0) {
        env.push_back(
            absl::StrCat("OFFLOAD_", absl::AsciiStrToUpper(name), "=", flag.substr(prefix.size())));
      }
    }
  }
  return env;
}

absl::StatusOr<std::string> ResolveProgram(const std::string& program, const std::string& path,
                                           const std::string& working_dir) {
  namespace fs = std::filesystem;
  if (program.find('/') != std::string::npos) {
    fs::path p(program);
    if (p.is_relative() && !working_dir.empty()) p = fs::path(working_dir) / p;
    if (access(p.c_str(), X_OK) == 0 && !fs::is_directory(p)) return p.string();
    return absl::NotFoundError(
        absl::StrCat("torch.command[0]: ", p.string(), " is not an executable file"));
  }
  for (absl::string_view dir : absl::StrSplit(path, ':', absl::SkipEmpty())) {
    const fs::path candidate = fs::path(std::string(dir)) / program;
    std::error_code error;
    if (access(candidate.c_str(), X_OK) == 0 && !fs::is_directory(candidate, error)) {
      return candidate.string();
    }
  }
  return absl::NotFoundError(
      absl::StrCat("torch.command[0]: ", program, " is not on the worker's PATH (", path, ")"));
}

absl::StatusOr<v1::ScriptProgress> ParseScriptProgress(absl::string_view json) {
  if (json.size() > kMaxProgressBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("progress report of ", json.size(), " bytes, more than ", kMaxProgressBytes));
  }
  v1::ScriptProgress progress;
  google::protobuf::util::JsonParseOptions parse;
  parse.ignore_unknown_fields = false;
  const auto status =
      google::protobuf::util::JsonStringToMessage(std::string(json), &progress, parse);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("progress report is not a ScriptProgress: ", status.message().ToString()));
  }
  return progress;
}

v1::ProgressReport ReportOf(const v1::ScriptProgress& p) {
  v1::ProgressReport report;
  report.set_step(p.step());
  report.set_total_steps(p.total_steps());
  report.set_loss(p.loss());
  report.set_val_loss(p.val_loss());
  report.set_tokens_per_s(p.tokens_per_s());
  report.set_loss_scale(p.loss_scale());
  report.set_checkpoint_dir(p.checkpoint_dir());
  report.set_checkpoint_step(p.checkpoint_step());
  report.set_checkpoint_request_done(p.checkpoint_request_done());
  return report;
}

std::string RequestJson(const v1::ProgressReply& reply) {
  google::protobuf::util::JsonPrintOptions print;
  print.always_print_primitive_fields = true;
  print.preserve_proto_field_names = true;
  std::string json;
  (void)google::protobuf::util::MessageToJsonString(reply, &json, print);
  return json;
}

void OutputTail::Add(absl::string_view line) {
  lines_.emplace_back(line.substr(0, max_line_bytes_));
  while (lines_.size() > max_lines_) lines_.pop_front();
}

std::string OutputTail::Text() const {
  std::string text;
  for (const std::string& line : lines_) absl::StrAppend(&text, line, "\n");
  return text;
}

v1::AttemptResult RunTorchAttempt(const v1::Assignment& a, const TorchAttemptOptions& options) {
  namespace fs = std::filesystem;
  v1::AttemptResult result;
  result.mutable_attempt()->set_job_id(a.job_id());
  result.mutable_attempt()->set_attempt(a.attempt());
  const v1::TorchSpec& torch = a.spec().torch();
  if (torch.command().empty()) return Failed(result, "torch.command is empty");

  AttemptDirs dirs;
  if (absl::Status made = MakeAttemptDirs(options.run_as, &dirs); !made.ok()) {
    return Failed(result, std::string(made.message()));
  }
  const std::string& control_dir = dirs.control;
  const std::string progress_file = (fs::path(control_dir) / "progress.json").string();
  const std::string request_file = (fs::path(control_dir) / "request.json").string();

  std::string master;
  if (a.world_size() > 1) {
    absl::StatusOr<std::string> agreed = AgreeOnMaster(a, options);
    if (!agreed.ok()) return Failed(result, std::string(agreed.status().message()));
    master = *agreed;
  }

  SpawnOptions spawn;
  spawn.env = TorchEnvironment(a, control_dir, master);
  spawn.env.insert(spawn.env.end(), options.tls_env.begin(), options.tls_env.end());
  if (!dirs.home.empty()) spawn.env.push_back(absl::StrCat("HOME=", dirs.home));
  spawn.env.insert(spawn.env.end(), torch.env().begin(), torch.env().end());
  std::string path = getenv("PATH") != nullptr ? getenv("PATH") : "/usr/local/bin:/usr/bin:/bin";
  for (const std::string& entry : torch.env()) {
    if (entry.rfind("PATH=", 0) == 0) path = entry.substr(5);
  }
  absl::StatusOr<std::string> program = ResolveProgram(torch.command(0), path, torch.working_dir());
  if (!program.ok()) return Failed(result, std::string(program.status().message()));
  spawn.argv.assign(torch.command().begin(), torch.command().end());
  spawn.argv[0] = *program;
  spawn.working_dir = torch.working_dir();
  spawn.capture_output = true;
  spawn.null_stdin = true;
  spawn.run_as = options.run_as;
  // Nothing an earlier attempt of this user left (its worker killed -9 before its sweep) may see
  // this one.
  if (options.run_as) {
    if (absl::Status killed = KillEveryProcessOf(*options.run_as); !killed.ok()) {
      return Failed(result, absl::StrCat("torch.command: ", killed.message()));
    }
  }
  absl::StatusOr<std::unique_ptr<ChildProcess>> spawned = ChildProcess::Spawn(spawn);
  if (!spawned.ok()) {
    return Failed(result, absl::StrCat("torch.command: ", spawned.status().message()));
  }
  ChildProcess& child = **spawned;
  LineReader output(child.TakeOutputFd());
  OutputTail tail;
  v1::ProgressReport first;
  first.mutable_attempt()->set_job_id(a.job_id());
  first.mutable_attempt()->set_attempt(a.attempt());
  first.set_rank(a.rank());
  ProgressClient progress(options.channel, options.token, first);

  std::string last_progress, last_request;
  // Reads the script's report if it changed, and passes the controller's answer back.
  auto relay = [&]() {
    std::string text;
    if (ReadScriptFile(progress_file, &text) && text != last_progress) {
      last_progress = text;
      absl::StatusOr<v1::ScriptProgress> p = ParseScriptProgress(text);
      if (p.ok()) {
        progress.Update(ReportOf(*p));
        if (options.on_progress) options.on_progress(*p);
      } else {
        LOG(WARNING) << absl::StrFormat("%s%s: %s", options.output_prefix, progress_file,
                                        std::string(p.status().message()));
      }
    }
    const std::string request = RequestJson(progress.reply());
    // Replaced whole (the script reads the old text or the new), through a temporary file of a
    // name nobody knows in advance, so a link the script planted is never written through.
    if (request != last_request && WriteFileAtomic(request_file, request).ok()) {
      last_request = request;
    }
  };
  // Copies the output that is there until `deadline` (or its end).
  bool output_ended = false;
  auto copy_output = [&](absl::Time deadline) {
    std::string line;
    while (!output_ended) {
      const LineReader::Result r = output.ReadLine(deadline, -1, &line);
      if (r == LineReader::Result::kEnd) output_ended = true;
      if (r != LineReader::Result::kLine) return;
      WriteStderrLine(absl::StrCat(options.output_prefix, line));
      tail.Add(line);
    }
  };

  absl::Time interrupt_at = absl::InfiniteFuture();
  absl::Time kill_at = absl::InfiniteFuture();
  bool interrupted = false;
  for (;;) {
    const absl::Time tick_end = absl::Now() + kTick;
    copy_output(tick_end);
    if (child.WaitFor(std::max(tick_end - absl::Now(), absl::ZeroDuration()))) break;
    relay();
    const absl::Time now = absl::Now();
    const v1::JobRequest request = progress.reply().request();
    if ((request == v1::JOB_REQUEST_PAUSE || request == v1::JOB_REQUEST_CANCEL) &&
        interrupt_at == absl::InfiniteFuture()) {
      // offload.torch checkpoints and exits at its next step; a script that never steps is
      // interrupted after the grace.
      interrupt_at = now + options.stop_grace;
    }
    if (options.stop != nullptr && *options.stop) interrupt_at = std::min(interrupt_at, now);
    if (!interrupted && now >= interrupt_at) {
      child.Signal(SIGINT).IgnoreError();
      interrupted = true;
      kill_at = now + options.kill_grace;
    }
    if (now >= kill_at || (options.withdrawn && options.withdrawn())) {
      // Withdrawn: the attempt is over elsewhere, and the script's checkpoints are atomic.
      child.Signal(SIGKILL).IgnoreError();
    }
  }
  // A script of its own user leaves nothing behind for the next attempt that user runs.
  if (options.run_as) {
    absl::Status killed = KillEveryProcessOf(*options.run_as);
    if (!killed.ok()) LOG(WARNING) << options.output_prefix << killed;
  }
  // Helpers the script started may hold the output open after it exits: read for a moment only.
  copy_output(absl::Now() + absl::Seconds(1));
  relay();
  // The controller hears the last step and checkpoint before the attempt's result.
  progress.Flush(absl::Seconds(5)).IgnoreError();

  const int status = child.wait_status();
  result.set_exit_code(ExitCodeOf(status));
  if (result.exit_code() != 0 && result.exit_code() != 130) {
    const std::string lines = tail.Text();
    result.set_message(absl::StrCat(
        "torch command ", torch.command(0), " ", DescribeWaitStatus(status),
        lines.empty() ? " and printed nothing" : "; the last lines of its output:\n", lines));
  }
  return result;
}

}  // namespace offload
