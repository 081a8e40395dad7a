#include "services/launcher/controlled_job.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/security/security.h"
#include "base/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "jobs/spec/job_spec.h"
#include "services/launcher/loopback_port.h"
#include "services/spawn/child_output.h"
#include "services/spawn/rank_devices.h"

namespace offload {
namespace {

void Say(const std::string& line) { WriteStderrLine(absl::StrCat("offload_local: ", line)); }

std::string Absolute(const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  std::error_code error;
  return std::filesystem::absolute(path, error).lexically_normal().string();
}

// "job_controller: grpc 127.0.0.1:7070 http 127.0.0.1:8080 store x.db" -> the two addresses.
bool ParseControllerAnnouncement(const std::string& line, std::string* grpc_address,
                                 std::string* http_address) {
  if (!absl::StartsWith(line, "job_controller: grpc ")) return false;
  std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipWhitespace());
  for (size_t i = 0; i + 1 < words.size(); ++i) {
    if (words[i] == "grpc") *grpc_address = words[i + 1];
    if (words[i] == "http") *http_address = words[i + 1];
  }
  return !grpc_address->empty();
}

const char* Verb(v1::JobState state) {
  switch (state) {
    case v1::JOB_STATE_SUCCEEDED:
      return "succeeded";
    case v1::JOB_STATE_FAILED:
      return "failed";
    case v1::JOB_STATE_CANCELLED:
      return "was cancelled";
    case v1::JOB_STATE_PAUSED:
      return "paused";
    default:
      return "ended";
  }
}

}  // namespace

ControlledJob::ControlledJob(ControlledJobOptions options, SignalFd* signals)
    : options_(std::move(options)), signals_(signals) {}

ControlledJob::~ControlledJob() {
  for (Process& p : processes_) p.child.reset();  // kills the group if it still runs
  for (Process& p : processes_) {
    if (p.forwarder.joinable()) p.forwarder.join();
  }
  if (!temp_dir_.empty()) {
    std::error_code error;
    std::filesystem::remove_all(temp_dir_, error);
  }
}

absl::Status ControlledJob::Prepare() {
  char dir[] = "/tmp/offload-local-XXXXXX";
  if (mkdtemp(dir) == nullptr) return absl::InternalError("cannot create a temporary directory");
  temp_dir_ = dir;
  OFFLOAD_ASSIGN_OR_RETURN(std::string token, RandomToken());
  token_ = token;
  token_file_ = temp_dir_ + "/token";
  int fd = open(token_file_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return absl::InternalError(absl::StrCat("cannot create ", token_file_));
  const std::string line = token_ + "\n";
  const bool written = write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size());
  close(fd);
  if (!written) return absl::InternalError(absl::StrCat("cannot write ", token_file_));
  if (options_.store.empty()) options_.store = temp_dir_ + "/jobs.db";
  return absl::OkStatus();
}

absl::StatusOr<std::string> ControlledJob::MetricsFlag(const std::string& job,
                                                       const std::string& flag) {
  if (options_.metrics_targets_dir.empty()) return std::string();
  OFFLOAD_ASSIGN_OR_RETURN(int port, FreeLoopbackPort());
  const std::string address = absl::StrCat("127.0.0.1:", port);
  metrics_targets_[job].push_back(address);
  return absl::StrCat("--", flag, "=", address);
}

absl::Status ControlledJob::WriteMetricsTargets() const {
  const std::string& dir = options_.metrics_targets_dir;
  if (dir.empty()) return absl::OkStatus();
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  for (const auto& [job, addresses] : metrics_targets_) {
    // Prometheus re-reads the files when they change: write whole files, then rename.
    const std::string path = absl::StrCat(dir, "/", job, ".json");
    const std::string temp = path + ".tmp";
    std::FILE* f = std::fopen(temp.c_str(), "w");
    if (f == nullptr) return absl::InternalError(absl::StrCat("cannot write ", temp));
    std::fprintf(f, "[{\"targets\": [\"%s\"], \"labels\": {}}]\n",
                 absl::StrJoin(addresses, "\", \"").c_str());
    const bool written = std::fclose(f) == 0;
    if (!written || std::rename(temp.c_str(), path.c_str()) != 0) {
      return absl::InternalError(absl::StrCat("cannot write ", path));
    }
  }
  Say(absl::StrCat("Prometheus targets in ", dir));
  return absl::OkStatus();
}

absl::Status ControlledJob::StartController() {
  SpawnOptions spawn;
  spawn.argv = {options_.controller_binary, "--grpc_address=127.0.0.1:0",
                "--http_address=127.0.0.1:0", absl::StrCat("--store=", options_.store),
                absl::StrCat("--token_file=", token_file_)};
  OFFLOAD_ASSIGN_OR_RETURN(std::string metrics, MetricsFlag("offload-controller"));
  if (!metrics.empty()) spawn.argv.push_back(metrics);
  spawn.capture_output = true;
  spawn.null_stdin = true;
  absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Spawn(spawn);
  if (!child.ok()) return child.status();
  Process p{"controller", std::move(*child), {}};
  auto reader = std::make_unique<LineReader>(p.child->TakeOutputFd());
  const absl::Time deadline = absl::Now() + options_.startup_timeout;
  std::string line;
  for (;;) {
    LineReader::Result r = reader->ReadLine(deadline, -1, &line);
    if (r == LineReader::Result::kLine) {
      WriteStderrLine(absl::StrCat("[controller] ", line));
      if (ParseControllerAnnouncement(line, &grpc_address_, &http_address_)) break;
      continue;
    }
    processes_.push_back(std::move(p));
    return absl::UnavailableError(r == LineReader::Result::kEnd
                                      ? "the job controller exited before it listened"
                                      : "the job controller did not announce its address in time");
  }
  p.forwarder = ForwardLines(std::move(reader), "[controller] ");
  processes_.push_back(std::move(p));
  stub_ = v1::JobService::NewStub(
      grpc::CreateChannel(grpc_address_, grpc::InsecureChannelCredentials()));
  return absl::OkStatus();
}

absl::Status ControlledJob::StartPool() {
  const std::string controller = absl::StrCat("--controller=", grpc_address_);
  const std::string token = absl::StrCat("--token_file=", token_file_);
  for (int k = 0; k < options_.num_shards; ++k) {
    SpawnOptions spawn;
    spawn.argv = {options_.server_binary, "--listen=127.0.0.1:0", controller, token};
    OFFLOAD_ASSIGN_OR_RETURN(std::string metrics, MetricsFlag("offload-optimizer-server"));
    if (!metrics.empty()) spawn.argv.push_back(metrics);
    spawn.argv.insert(spawn.argv.end(), options_.server_args.begin(), options_.server_args.end());
    spawn.capture_output = true;
    spawn.null_stdin = true;
    absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Spawn(spawn);
    if (!child.ok()) return child.status();
    Process p{absl::StrCat("server ", k), std::move(*child), {}};
    p.forwarder = ForwardLines(std::make_unique<LineReader>(p.child->TakeOutputFd()),
                               absl::StrCat("[server ", k, "] "));
    processes_.push_back(std::move(p));
  }
  // The trainers keep the terminal: rank 0 draws its progress bar there, as without a controller.
  for (int r = 0; r < options_.num_ranks; ++r) {
    SpawnOptions spawn;
    spawn.argv = {options_.trainer_binary, controller, token, "--rank_address=127.0.0.1",
                  absl::StrCat("--worker_index=", r)};
    // The worker's own metrics, and those of the rank it runs (scrape jobs of docs/METRICS.md).
    const std::pair<const char*, const char*> kTrainerMetrics[] = {
        {"offload-trainer-worker", "metrics_address"}, {"offload-trainer", "rank_metrics_address"}};
    for (const auto& [job, flag] : kTrainerMetrics) {
      OFFLOAD_ASSIGN_OR_RETURN(std::string metrics, MetricsFlag(job, flag));
      if (!metrics.empty()) spawn.argv.push_back(metrics);
    }
    spawn.argv.push_back("--");
    spawn.argv.insert(spawn.argv.end(), rank_args_.begin(), rank_args_.end());
    spawn.null_stdin = true;
    OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<ChildProcess> child, ChildProcess::Spawn(spawn));
    processes_.push_back(Process{absl::StrCat("trainer ", r), std::move(child), {}});
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::JobSpec> ControlledJob::MakeSpec() {
  if (options_.job.has_value()) {
    v1::JobSpec spec = *options_.job;
    if (spec.name().empty()) spec.set_name("local");
    if (spec.checkpoint().has_dir()) {
      spec.mutable_checkpoint()->set_dir(Absolute(spec.checkpoint().dir()));
    }
    if (spec.data().has_path()) spec.mutable_data()->set_path(Absolute(spec.data().path()));
    if (spec.model().has_init_from()) {
      spec.mutable_model()->set_init_from(Absolute(spec.model().init_from()));
    }
    if (spec.has_torch()) {
      v1::TorchSpec& torch = *spec.mutable_torch();
      torch.set_working_dir(Absolute(torch.working_dir().empty() ? "." : torch.working_dir()));
    }
    return spec;
  }
  // Flags of the job go into the spec; the others (display, timeouts, traces) are settings of
  // the trainers on this machine, which pass them to every rank they run.
  std::vector<std::string> job_args;
  for (const std::string& arg : options_.trainer_args) {
    (IsJobSpecFlag(arg) ? job_args : rank_args_).push_back(arg);
  }
  OFFLOAD_ASSIGN_OR_RETURN(v1::JobSpec spec, JobSpecFromFlags(job_args));
  spec.set_name("local");
  spec.mutable_parallel()->set_ranks(options_.num_ranks);
  spec.mutable_parallel()->set_optimizer_servers(options_.num_shards);
  // The workers resolve paths from their own directories; this launcher's is the user's.
  if (!spec.data().has_path()) {
    return absl::InvalidArgumentError("give the training data with --data=FILE after --");
  }
  spec.mutable_data()->set_path(Absolute(spec.data().path()));
  if (spec.checkpoint().has_dir()) {
    spec.mutable_checkpoint()->set_dir(Absolute(spec.checkpoint().dir()));
  }
  if (spec.model().has_init_from()) {
    spec.mutable_model()->set_init_from(Absolute(spec.model().init_from()));
  }
  return spec;
}

ControlledJob::Process* ControlledJob::ExitedProcess() {
  for (Process& p : processes_) {
    if (p.child != nullptr && p.child->WaitFor(absl::ZeroDuration())) return &p;
  }
  return nullptr;
}

JobOutcome ControlledJob::Run() {
  absl::StatusOr<v1::JobSpec> spec = MakeSpec();
  if (!spec.ok()) return {2, std::string(spec.status().message())};
  // The trainer workers give each rank its GPU; a host without enough fails the job before
  // anything starts, as without a controller.
  if (absl::StatusOr<std::vector<std::string>> devices =
          CudaDeviceFlags(options_.trainer_args, options_.num_ranks);
      !devices.ok()) {
    return {1, std::string(devices.status().message())};
  }
  if (absl::Status s = Prepare(); !s.ok()) return {1, s.ToString()};
  if (absl::Status s = StartController(); !s.ok()) {
    StopAll();
    return {1, s.ToString()};
  }
  if (absl::Status s = StartPool(); !s.ok()) {
    StopAll();
    return {1, s.ToString()};
  }
  if (absl::Status s = WriteMetricsTargets(); !s.ok()) {
    StopAll();
    return {1, s.ToString()};
  }
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.startup_timeout));
  AttachBearer(&context, token_);
  v1::SubmitJobRequest request;
  *request.mutable_spec() = *spec;
  v1::Job job;
  grpc::Status submitted = stub_->SubmitJob(&context, request, &job);
  if (!submitted.ok()) {
    StopAll();
    return {submitted.error_code() == grpc::StatusCode::INVALID_ARGUMENT ? 2 : 1,
            absl::StrCat("the job controller refused the job: ", submitted.error_message())};
  }
  Say(absl::StrCat("job ", job.id(), " submitted to the job controller (grpc ", grpc_address_,
                   ", http ", http_address_, ", token in ", token_file_, "); ", options_.num_shards,
                   " optimizer server(s), ", options_.num_ranks, " trainer(s)"));
  JobOutcome outcome = Watch(job.id());
  StopAll();
  return outcome;
}

JobOutcome ControlledJob::Watch(const std::string& job_id) {
  bool pausing = false;
  absl::Time pause_deadline = absl::InfiniteFuture();
  v1::JobState last_state = v1::JOB_STATE_UNSPECIFIED;
  for (;;) {
    const int signo = signals_->Wait(absl::Now() + absl::Milliseconds(500));
    if (signo == SIGINT || signo == SIGTERM) {
      if (pausing) return {128 + signo, "a second signal: stopped everything at once"};
      pausing = true;
      pause_deadline = absl::Now() + options_.shutdown_timeout;
      Say("stopping: the trainers finish their step and checkpoint (again to kill at once)");
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
      AttachBearer(&context, token_);
      v1::JobActionRequest request;
      request.set_id(job_id);
      request.set_reason(absl::StrCat("offload_local got signal ", signo));
      v1::Job ignored;
      grpc::Status s = stub_->PauseJob(&context, request, &ignored);
      if (!s.ok()) Say(absl::StrCat("pause: ", s.error_message()));
    }
    if (Process* p = ExitedProcess()) {
      return {1, absl::StrCat(p->name, " ", DescribeWaitStatus(p->child->wait_status()),
                              " while job ", job_id, " ran")};
    }
    if (absl::Now() > pause_deadline) {
      return {1, absl::StrCat("job ", job_id, " did not pause within ",
                              absl::FormatDuration(options_.shutdown_timeout))};
    }
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    AttachBearer(&context, token_);
    v1::GetJobRequest request;
    request.set_id(job_id);
    v1::Job job;
    if (!stub_->GetJob(&context, request, &job).ok()) continue;
    if (job.state() != last_state && job.state() == v1::JOB_STATE_PENDING &&
        last_state != v1::JOB_STATE_UNSPECIFIED) {
      Say(absl::StrCat("job ", job_id, " is pending again: ", job.reason()));
    }
    last_state = job.state();
    switch (job.state()) {
      case v1::JOB_STATE_SUCCEEDED:
        return {0, absl::StrCat("job ", job_id, " succeeded at step ", job.progress().step())};
      case v1::JOB_STATE_PAUSED:
        return {130,
                absl::StrCat("job ", job_id, " paused at step ", job.progress().step(),
                             job.progress().last_checkpoint().empty()
                                 ? ""
                                 : absl::StrCat(" (checkpoint ", job.progress().last_checkpoint(),
                                                "; continue with --resume)"))};
      case v1::JOB_STATE_FAILED:
      case v1::JOB_STATE_CANCELLED:
        return {1, absl::StrCat("job ", job_id, " ", Verb(job.state()), ": ", job.reason())};
      default:
        break;
    }
  }
}

void ControlledJob::StopAll() {
  // Trainers first (idle by now, or stopping their rank in order), then servers, then the
  // controller, which must outlive their last reports.
  auto stop = [this](bool (*which)(const std::string&)) {
    const absl::Time deadline = absl::Now() + options_.kill_timeout;
    for (Process& p : processes_) {
      if (which(p.name) && p.child != nullptr) p.child->Signal(SIGTERM).IgnoreError();
    }
    for (Process& p : processes_) {
      if (!which(p.name) || p.child == nullptr) continue;
      if (!p.child->WaitFor(deadline - absl::Now())) p.child->Signal(SIGKILL).IgnoreError();
      p.child->WaitFor(absl::InfiniteDuration());
    }
  };
  stop([](const std::string& n) { return absl::StartsWith(n, "trainer"); });
  stop([](const std::string& n) { return absl::StartsWith(n, "server"); });
  stop([](const std::string& n) { return n == "controller"; });
  for (Process& p : processes_) {
    if (p.forwarder.joinable()) p.forwarder.join();
  }
}

}  // namespace offload
