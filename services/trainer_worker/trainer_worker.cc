#include "services/trainer_worker/trainer_worker.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <deque>
#include <fstream>
#include <memory>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/security/security.h"
#include "gpu_trainer/train/trainer_metrics.h"
#include "jobs/spec/job_spec.h"
#include "jobs/worker/worker_agent.h"
#include "services/spawn/child_process.h"
#include "services/spawn/rank_devices.h"
#include "services/trainer_worker/torch_attempt.h"

namespace offload {
namespace {

bool SameAttempt(const v1::AttemptRef& ref, const v1::Assignment& a) {
  return ref.job_id() == a.job_id() && ref.attempt() == a.attempt();
}

std::string ReadSmallFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The attempts the agent's thread hands over, for the main thread (which must start the children:
// their death signal is tied to the thread that spawned them).
class Mailbox {
 public:
  void Start(const v1::Assignment& a) {
    absl::MutexLock lock(&mu_);
    starts_.push_back(a);
  }
  void Stop(const v1::AttemptRef& ref) {
    absl::MutexLock lock(&mu_);
    stops_.push_back(ref);
  }
  bool TakeStart(absl::Duration wait, v1::Assignment* a) {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !starts_.empty(); };
    mu_.AwaitWithTimeout(absl::Condition(&ready), wait);
    if (starts_.empty()) return false;
    *a = starts_.front();
    starts_.pop_front();
    return true;
  }
  // Whether the controller withdrew `a`; forgets the withdrawal once seen.
  bool Withdrawn(const v1::Assignment& a) {
    absl::MutexLock lock(&mu_);
    for (auto it = stops_.begin(); it != stops_.end(); ++it) {
      if (SameAttempt(*it, a)) {
        stops_.erase(it);
        return true;
      }
    }
    return false;
  }

 private:
  absl::Mutex mu_;
  std::deque<v1::Assignment> starts_ ABSL_GUARDED_BY(mu_);
  std::deque<v1::AttemptRef> stops_ ABSL_GUARDED_BY(mu_);
};

// A torch job's rank: the job's command instead of a gpu_trainer child, its progress relayed to
// the controller and to this worker's trainer metrics.
v1::AttemptResult RunTorchRank(const v1::Assignment& a, std::shared_ptr<grpc::Channel> channel,
                               const std::string& token, const std::string& rank_address,
                               const std::optional<RunAs>& script_user, Mailbox* mailbox,
                               volatile std::sig_atomic_t* stop) {
  TrainerInfo info;
  info.job_id = a.job_id();
  info.rank = static_cast<int>(a.rank());
  info.world_size = static_cast<int>(a.world_size());
  info.device = "script";
  info.model = "torch";
  TrainerInfoScope info_series(info);
  TorchAttemptOptions options;
  options.channel = std::move(channel);
  options.token = token;
  options.rank_address = rank_address;
  options.tls_env =
      TorchTlsEnvironment(SecurityFlagsForChild(), /*client_identity=*/!script_user.has_value());
  options.run_as = script_user;
  if (!script_user) {
    LOG(WARNING) << absl::StrFormat(
        "gpu_trainer: torch job %s's script runs as this worker's user and can read its "
        "credentials; give the worker --script_user to run scripts as users of their own",
        a.job_id().c_str());
  }
  options.output_prefix = absl::StrFormat("[%s rank %u] ", a.job_id(), a.rank());
  options.withdrawn = [mailbox, &a] { return mailbox->Withdrawn(a); };
  options.stop = stop;
  // A restarted attempt starts again from its checkpoint's step: counters only grow.
  uint64_t last_step = 0;
  double last_tokens = 0;
  options.on_progress = [&](const v1::ScriptProgress& p) {
    ReportedProgress r;
    r.step = p.step();
    r.new_steps = p.step() > last_step ? p.step() - last_step : 0;
    r.new_tokens = p.tokens() > last_tokens ? p.tokens() - last_tokens : 0;
    last_step = std::max(last_step, p.step());
    last_tokens = std::max(last_tokens, p.tokens());
    r.loss = p.loss();
    r.loss_scale = p.loss_scale();
    r.lr = p.lr();
    r.grad_norm = p.grad_norm();
    r.tokens_per_s = p.tokens_per_s();
    RecordReportedProgress(r);
  };
  return RunTorchAttempt(a, options);
}

}  // namespace

std::vector<std::string> RankCommandLine(const std::string& trainer_binary,
                                         const std::string& controller,
                                         const std::string& rank_address,
                                         const std::string& error_file,
                                         const std::vector<std::string>& rank_args,
                                         const v1::Assignment& a) {
  std::vector<std::string> argv = {trainer_binary};
  for (std::string& flag : JobSpecToFlags(a.spec())) argv.push_back(std::move(flag));
  argv.push_back(absl::StrCat("--world_size=", a.world_size()));
  argv.push_back(absl::StrCat("--rank=", a.rank()));
  argv.push_back(absl::StrCat("--shards=", absl::StrJoin(a.shard_addresses(), ",")));
  argv.push_back(absl::StrCat("--job_id=", a.shard_job_id()));
  if (a.resume()) argv.push_back("--resume=true");
  if (a.world_size() > 1) {
    argv.push_back("--rendezvous=controller");
    argv.push_back(absl::StrCat("--rank_address=", rank_address));
  }
  argv.push_back(absl::StrCat("--report_to=", controller));
  argv.push_back(absl::StrCat("--report_job=", a.job_id()));
  argv.push_back(absl::StrCat("--report_attempt=", a.attempt()));
  argv.push_back(absl::StrCat("--error_file=", error_file));
  for (std::string& flag : SecurityFlagsForChild()) argv.push_back(std::move(flag));
  argv.insert(argv.end(), rank_args.begin(), rank_args.end());
  return argv;
}

int RunTrainerWorker(const std::string& trainer_binary, const std::string& controller,
                     const std::string& rank_address, int worker_index,
                     const std::vector<std::string>& rank_args, volatile std::sig_atomic_t* stop,
                     const std::string& name_suffix, const std::optional<RunAs>& script_user) {
  const std::string self = ThisExecutable(trainer_binary);

  absl::StatusOr<SecurityOptions> security = SecurityFromFlags();
  if (!security.ok()) {
    LOG(ERROR) << absl::StrFormat("gpu_trainer: %s", security.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = MakeChannel(controller, security->tls);
  if (!channel.ok()) {
    LOG(ERROR) << "gpu_trainer: " << channel.status();
    return 1;
  }
  const std::string name = absl::StrCat(ThisHostName(), ":", getpid(), name_suffix);
  WorkerAgentOptions options;
  options.controller = controller;
  options.channel = *channel;
  options.token = security->client_token;
  options.info.set_kind(v1::WORKER_KIND_TRAINER);
  options.info.set_name(name);
  options.info.set_hostname(rank_address);
  if (worker_index >= 0) options.info.set_index(worker_index);
  Mailbox mailbox;
  WorkerHooks hooks;
  hooks.start = [&mailbox](const v1::Assignment& a) { mailbox.Start(a); };
  hooks.stop = [&mailbox](const v1::AttemptRef& ref) { mailbox.Stop(ref); };
  absl::StatusOr<std::unique_ptr<WorkerAgent>> agent = WorkerAgent::Start(options, hooks);
  if (!agent.ok()) {
    LOG(ERROR) << absl::StrFormat("gpu_trainer: %s", agent.status().ToString().c_str());
    return 1;
  }
  LOG(INFO) << absl::StrFormat(
      "gpu_trainer: pool worker %s (%s) registered with the job controller at %s",
      (*agent)->worker_id().c_str(), name.c_str(), controller.c_str());

  while (!*stop) {
    v1::Assignment a;
    if (!mailbox.TakeStart(absl::Milliseconds(200), &a)) continue;
    v1::AttemptResult result;
    result.mutable_attempt()->set_job_id(a.job_id());
    result.mutable_attempt()->set_attempt(a.attempt());
    if (mailbox.Withdrawn(a)) continue;  // withdrawn before it started: nothing to report
    if (a.spec().has_torch()) {
      LOG(INFO) << absl::StrFormat(
          "gpu_trainer: worker %s runs rank %u of %u of torch job %s (attempt %u)",
          (*agent)->worker_id().c_str(), a.rank(), a.world_size(), a.job_id().c_str(), a.attempt());
      (*agent)->Finished(RunTorchRank(a, *channel, security->client_token, rank_address,
                                      script_user, &mailbox, stop));
      continue;
    }
    const std::string error_file =
        absl::StrCat("/tmp/offload-rank-", getpid(), "-", a.job_id(), "-", a.attempt(), ".err");
    unlink(error_file.c_str());
    SpawnOptions spawn;
    spawn.argv = RankCommandLine(self, controller, rank_address, error_file, rank_args, a);
    // The rank's GPU among this host's (the job's flags and this worker's rank flags say CUDA).
    absl::StatusOr<std::string> device_flag = CudaDeviceFlag(
        ReadRankDeviceSettings(spawn.argv), static_cast<int>(a.local_rank()),
        static_cast<int>(std::max(a.local_ranks(), a.local_rank() + 1)), VisibleGpuCount());
    if (!device_flag.ok()) {
      LOG(ERROR) << "gpu_trainer: " << device_flag.status();
      result.set_exit_code(1);
      result.set_message(std::string(device_flag.status().message()));
      (*agent)->Finished(result);
      continue;
    }
    if (!device_flag->empty()) spawn.argv.push_back(*device_flag);
    spawn.null_stdin = true;
    spawn.env = {absl::StrCat(kShardTokenEnv, "=", a.shard_secret())};
    LOG(INFO) << absl::StrFormat("gpu_trainer: worker %s runs rank %u of %u of %s (attempt %u)",
                                 (*agent)->worker_id().c_str(), a.rank(), a.world_size(),
                                 a.job_id().c_str(), a.attempt());
    absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Spawn(spawn);
    if (!child.ok()) {
      result.set_exit_code(127);
      result.set_message(std::string(child.status().message()));
      (*agent)->Finished(result);
      continue;
    }
    bool interrupted = false;
    absl::Time kill_at = absl::InfiniteFuture();
    while (!(*child)->WaitFor(absl::Milliseconds(200))) {
      if (mailbox.Withdrawn(a)) {
        // The attempt is over elsewhere (a peer died, the job was cancelled): the rank's
        // collectives could only time out, and its checkpoints are atomic, so end it now.
        (*child)->Signal(SIGKILL).IgnoreError();
      }
      if (*stop && !interrupted) {
        // Stop in order: the rank finishes its step and checkpoints, like a Ctrl-C.
        (*child)->Signal(SIGINT).IgnoreError();
        interrupted = true;
        kill_at = absl::Now() + absl::Seconds(60);
      }
      if (absl::Now() > kill_at) (*child)->Signal(SIGKILL).IgnoreError();
    }
    const int status = (*child)->wait_status();
    result.set_exit_code(ExitCodeOf(status));
    std::string message = ReadSmallFile(error_file);
    if (message.empty() && result.exit_code() != 0 && result.exit_code() != 130) {
      message = absl::StrCat("gpu_trainer rank ", a.rank(), " ", DescribeWaitStatus(status));
    }
    result.set_message(message);
    unlink(error_file.c_str());
    (*agent)->Finished(result);
  }
  // The last result goes out with the next heartbeat before the agent stops.
  (*agent)->Drain(absl::Seconds(5));
  return 0;
}

int RunTrainerWorkers(int workers, const std::string& trainer_binary, const std::string& controller,
                      const std::string& rank_address, int worker_index,
                      const std::string& rank_metrics_address,
                      const std::vector<std::string>& rank_args,
                      const std::optional<ScriptUsers>& script_users,
                      volatile std::sig_atomic_t* stop) {
  if (script_users) {
    absl::Status checked =
        CheckScriptUsers(*script_users, workers, CredentialFiles(SecurityFlagsForChild()));
    if (!checked.ok()) {
      LOG(ERROR) << "gpu_trainer: " << checked;
      return 2;
    }
  }
  std::string metrics_host;
  int metrics_port = 0;
  if (!rank_metrics_address.empty()) {
    const size_t colon = rank_metrics_address.rfind(':');
    if (colon == std::string::npos ||
        !absl::SimpleAtoi(rank_metrics_address.substr(colon + 1), &metrics_port) ||
        metrics_port < 0 || metrics_port + workers - 1 > 65535) {
      LOG(ERROR) << absl::StrFormat(
          "gpu_trainer: --rank_metrics_address=%s is not HOST:PORT with room for %d ports",
          rank_metrics_address.c_str(), workers);
      return 2;
    }
    metrics_host = rank_metrics_address.substr(0, colon);
  }
  std::vector<int> status(workers, 0);
  auto run = [&](int k) {
    std::vector<std::string> args = rank_args;
    if (!rank_metrics_address.empty()) {
      // Port 0 (any free port) stays 0 for every rank.
      const int port = metrics_port == 0 ? 0 : metrics_port + k;
      args.push_back(absl::StrCat("--metrics_address=", metrics_host, ":", port));
    }
    status[k] = RunTrainerWorker(
        trainer_binary, controller, rank_address,
        worker_index < 0 ? -1 : worker_index * workers + k, args, stop,
        workers > 1 ? absl::StrCat("/", k) : "",
        script_users ? std::optional<RunAs>(ScriptUserOf(*script_users, k)) : std::nullopt);
  };
  std::vector<std::thread> threads;
  for (int k = 1; k < workers; ++k) threads.emplace_back(run, k);
  run(0);
  for (std::thread& t : threads) t.join();
  for (int s : status) {
    if (s != 0) return s;
  }
  return 0;
}

}  // namespace offload
