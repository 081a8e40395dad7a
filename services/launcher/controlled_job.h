// ControlledJob: one training job on this machine run the way a cluster runs it (ARCHITECTURE.md
// section 7): a local job_controller with its own store and token, S optimizer servers and W
// trainers that join its pool, and the job submitted to it as a JobSpec made from the trainer
// flags. The launcher then only watches the job through the controller's API, asks it to pause on
// Ctrl-C, and shuts the pool down when the job has ended.
#ifndef OFFLOAD_SERVICES_LAUNCHER_CONTROLLED_JOB_H_
#define OFFLOAD_SERVICES_LAUNCHER_CONTROLLED_JOB_H_

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "offload/v1/job.grpc.pb.h"
#include "services/launcher/local_job.h"
#include "services/launcher/signal_fd.h"
#include "services/spawn/child_process.h"

namespace offload {

// The job is the one LocalJobOptions describe, except that trainer_args become the JobSpec
// (JobSpecFromFlags, relative paths made absolute; flags that are no JobSpec field go to every
// rank), and that startup_timeout also covers the controller and shutdown_timeout is how long the
// job has to checkpoint and pause after Ctrl-C.
struct ControlledJobOptions : LocalJobOptions {
  std::string controller_binary;
  // The controller's SQLite store; empty: one in the job's temporary directory, removed at the end.
  std::string store;
  // When set, every process serves /metrics on a free loopback port, and the ports are written
  // there as Prometheus file_sd target files, one per scrape job: offload-controller.json,
  // offload-optimizer-server.json, offload-trainer-worker.json, offload-trainer.json.
  std::string metrics_targets_dir;
  // A job file to submit instead of a spec made from trainer_args (which must then be empty): any
  // job, a torch job's included. num_ranks and num_shards must be its own. Relative paths in it
  // are taken from this launcher's directory, which is also a torch job's default working_dir.
  std::optional<v1::JobSpec> job;
};

class ControlledJob {
 public:
  // `signals` must report SIGINT, SIGTERM and SIGCHLD.
  ControlledJob(ControlledJobOptions options, SignalFd* signals);
  // Kills and reaps whatever still runs and removes the temporary directory.
  ~ControlledJob();
  ControlledJob(const ControlledJob&) = delete;
  ControlledJob& operator=(const ControlledJob&) = delete;

  // Runs the job to its end; exit code 0 when it succeeded, 130 when it paused on Ctrl-C (resume
  // with --resume), 1 otherwise. Call it from the main thread (see ChildProcess::Spawn).
  JobOutcome Run();

 private:
  struct Process {
    std::string name;  // "controller", "server 0", "trainer 1"
    std::unique_ptr<ChildProcess> child;
    std::thread forwarder;
  };

  absl::Status Prepare();
  // "--metrics_address=127.0.0.1:PORT" with a free port recorded under the scrape `job`; empty
  // when no metrics were asked for.
  absl::StatusOr<std::string> MetricsFlag(const std::string& job,
                                          const std::string& flag = "metrics_address");
  absl::Status WriteMetricsTargets() const;
  absl::Status StartController();
  absl::Status StartPool();
  // Also sorts the trainer flags that are no JobSpec field into rank_args_.
  absl::StatusOr<v1::JobSpec> MakeSpec();
  JobOutcome Watch(const std::string& job_id);
  // The first pool process that has exited, if any (it is reaped).
  Process* ExitedProcess();
  void StopAll();

  ControlledJobOptions options_;
  SignalFd* signals_;
  std::string temp_dir_;
  std::string token_file_;
  std::string token_;
  std::vector<std::string> rank_args_;
  std::string grpc_address_;
  std::string http_address_;
  std::unique_ptr<v1::JobService::Stub> stub_;
  std::vector<Process> processes_;                                   // [0] is the controller
  std::map<std::string, std::vector<std::string>> metrics_targets_;  // scrape job -> host:port
};

}  // namespace offload

#endif  // OFFLOAD_SERVICES_LAUNCHER_CONTROLLED_JOB_H_
