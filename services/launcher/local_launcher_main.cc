// offload_local: runs a whole training job on this machine — S optimizer servers and W
// data-parallel trainer ranks on loopback — and shuts it down in order on Ctrl-C.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "base/logging.h"
#include "jobs/spec/job_spec.h"
#include "services/launcher/controlled_job.h"
#include "services/launcher/local_job.h"
#include "services/launcher/signal_fd.h"
#include "services/spawn/child_process.h"

ABSL_FLAG(std::string, controller, "local",
          "local: run the job through a job_controller started for it, with the servers and "
          "trainers as its worker pool (the way a cluster runs jobs); none: start the servers and "
          "the trainer ranks directly, with their flags");
ABSL_FLAG(std::string, metrics_targets_dir, "",
          "with --controller=local: every process serves Prometheus /metrics on a free loopback "
          "port, listed in file_sd target files in this directory (see monitoring/)");
ABSL_FLAG(std::string, job, "",
          "with --controller=local: submit this job file (YAML or JSON, e.g. a torch job that runs "
          "a PyTorch script) instead of a job made from the trainer flags; --ranks and --shards "
          "come from its parallel section");
ABSL_FLAG(std::string, store, "",
          "with --controller=local: keep the controller's job store in this SQLite file (default: "
          "a temporary one, removed at the end)");
ABSL_FLAG(std::string, controller_binary, "",
          "job_controller to run; empty = the one in the build tree next to this launcher");
ABSL_FLAG(int, shards, 1, "optimizer servers to start");
ABSL_FLAG(int, ranks, 1,
          "trainer processes (data-parallel ranks) to start; above 1 each gets --rank, "
          "--world_size and --rendezvous, and ranks >= 1 print through the launcher as [rank R]");
ABSL_FLAG(std::string, server_binary, "",
          "cpu_optimizer_server to run; empty = the one in the build tree next to this launcher");
ABSL_FLAG(std::string, trainer_binary, "",
          "gpu_trainer to run; empty = the one in the build tree next to this launcher");
ABSL_FLAG(std::string, server_args, "",
          "extra flags for every server, separated by spaces (e.g. \"--threads=8 --simd=avx2\")");
ABSL_FLAG(absl::Duration, startup_timeout, absl::Seconds(30),
          "how long the servers have to report their ports");
ABSL_FLAG(
    absl::Duration, shutdown_timeout, absl::Seconds(60),
    "after Ctrl-C, how long the trainer ranks have to finish their step and checkpoint before "
    "SIGKILL");
ABSL_FLAG(absl::Duration, kill_timeout, absl::Seconds(5),
          "how long a server has after SIGTERM (and the trainer ranks after SIGINT when a server "
          "or another rank failed) before SIGKILL");

int main(int argc, char** argv) {
  offload::InitLogging(argv[0]);
  absl::SetProgramUsageMessage(
      "Runs a training job on this machine: S optimizer servers and W trainer ranks on loopback.\n"
      "usage: offload_local [--shards=S] [--ranks=W] [flags] -- [trainer flags]\n"
      "Each rank runs: gpu_trainer --shards=127.0.0.1:P1,... [--rank=R --world_size=W "
      "--rendezvous=DIR] [trainer flags]\n"
      "(the rank flags only when W > 1; DIR is a fresh directory removed when the job ends).\n"
      "The job ends when every rank has exited; a rank that fails stops the others, and the "
      "launcher exits with its status.");
  // Everything after "--" belongs to the trainer; absl never sees it, so a trainer flag can never
  // be mistaken for one of ours.
  int ours = 1;
  while (ours < argc && std::string(argv[ours]) != "--") ++ours;
  std::vector<std::string> trainer_args(argv + std::min(ours + 1, argc), argv + argc);
  std::vector<char*> positional = absl::ParseCommandLine(ours, argv);
  if (positional.size() > 1) {
    LOG(ERROR) << absl::StrFormat(
        "offload_local: unexpected argument '%s'; trainer flags go after --", positional[1]);
    return 2;
  }
  if (absl::GetFlag(FLAGS_shards) < 1) {
    LOG(ERROR) << "offload_local: --shards must be at least 1";
    return 2;
  }
  if (absl::GetFlag(FLAGS_ranks) < 1) {
    LOG(ERROR) << absl::StrFormat("offload_local: --ranks must be at least 1 (got %d)",
                                  absl::GetFlag(FLAGS_ranks));
    return 2;
  }

  // Blocked before any thread exists, so every thread inherits the mask (see SignalFd).
  absl::StatusOr<offload::SignalFd> signals = offload::SignalFd::Create({SIGINT, SIGTERM, SIGCHLD});
  if (!signals.ok()) {
    LOG(ERROR) << absl::StrFormat("offload_local: %s", signals.status().ToString().c_str());
    return 1;
  }
  // A closed stderr must show up as a failed write, not kill the launcher and orphan the job.
  signal(SIGPIPE, SIG_IGN);

  offload::LocalJobOptions options;
  options.num_shards = absl::GetFlag(FLAGS_shards);
  options.num_ranks = absl::GetFlag(FLAGS_ranks);
  options.server_binary = absl::GetFlag(FLAGS_server_binary);
  if (options.server_binary.empty()) {
    options.server_binary = offload::BesideThisExecutable("cpu_optimizer_server");
  }
  options.trainer_binary = absl::GetFlag(FLAGS_trainer_binary);
  if (options.trainer_binary.empty()) {
    options.trainer_binary = offload::BesideThisExecutable("gpu_trainer");
  }
  options.server_args =
      absl::StrSplit(absl::GetFlag(FLAGS_server_args), ' ', absl::SkipWhitespace());
  options.trainer_args = std::move(trainer_args);
  options.startup_timeout = absl::GetFlag(FLAGS_startup_timeout);
  options.shutdown_timeout = absl::GetFlag(FLAGS_shutdown_timeout);
  options.kill_timeout = absl::GetFlag(FLAGS_kill_timeout);

  const std::string mode = absl::GetFlag(FLAGS_controller);
  if (mode != "local" && mode != "none") {
    LOG(ERROR) << absl::StrFormat("offload_local: --controller must be local or none (got '%s')",
                                  mode.c_str());
    return 2;
  }
  if (mode == "none" && !absl::GetFlag(FLAGS_metrics_targets_dir).empty()) {
    LOG(ERROR) << "offload_local: --metrics_targets_dir needs --controller=local";
    return 2;
  }
  std::optional<offload::v1::JobSpec> job_file;
  if (const std::string path = absl::GetFlag(FLAGS_job); !path.empty()) {
    absl::StatusOr<offload::v1::JobSpec> spec = offload::ReadJobSpecFile(path);
    if (!spec.ok() || mode != "local" || !options.trainer_args.empty()) {
      LOG(ERROR) << "offload_local: --job="
                 << (!spec.ok() ? spec.status().ToString()
                                : absl::StrCat(path,
                                               " needs --controller=local and no trainer "
                                               "flags after --"));
      return 2;
    }
    const offload::v1::ParallelSpec& parallel = spec->parallel();
    options.num_ranks = parallel.has_ranks() ? static_cast<int>(parallel.ranks()) : 1;
    options.num_shards =
        parallel.has_optimizer_servers() ? static_cast<int>(parallel.optimizer_servers()) : 1;
    job_file = *std::move(spec);
  }
  offload::JobOutcome outcome;
  if (mode == "local") {
    offload::ControlledJobOptions controlled;
    static_cast<offload::LocalJobOptions&>(controlled) = options;
    controlled.controller_binary = absl::GetFlag(FLAGS_controller_binary);
    if (controlled.controller_binary.empty()) {
      controlled.controller_binary = offload::BesideThisExecutable("job_controller");
    }
    controlled.store = absl::GetFlag(FLAGS_store);
    controlled.metrics_targets_dir = absl::GetFlag(FLAGS_metrics_targets_dir);
    controlled.job = std::move(job_file);
    offload::ControlledJob job(std::move(controlled), &*signals);
    outcome = job.Run();
  } else {
    offload::LocalJob job(std::move(options), &*signals);
    outcome = job.Run();
  }
  if (outcome.exit_code == 0) {
    LOG(INFO) << "offload_local: " << outcome.summary;
  } else {
    LOG(ERROR) << "offload_local: " << outcome.summary;
  }
  return outcome.exit_code;
}
