// LocalJob: one training job on this machine — S optimizer servers and the trainer on loopback —
// started, watched and shut down in order.
#ifndef OFFLOAD_SERVICES_LAUNCHER_LOCAL_JOB_H_
#define OFFLOAD_SERVICES_LAUNCHER_LOCAL_JOB_H_

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "services/launcher/child_output.h"
#include "services/launcher/child_process.h"
#include "services/launcher/signal_fd.h"

namespace offload {

struct LocalJobOptions {
  int num_shards = 1;
  std::string server_binary;
  std::string trainer_binary;
  // Given to every server after --listen=127.0.0.1:0.
  std::vector<std::string> server_args;
  // Given to the trainer after --shards=127.0.0.1:p1,...
  std::vector<std::string> trainer_args;
  // How long the servers have, together, to announce their ports.
  absl::Duration startup_timeout = absl::Seconds(30);
  // How long the trainer has after SIGINT to finish its step and write its checkpoint.
  absl::Duration shutdown_timeout = absl::Seconds(60);
  // How long a server has after SIGTERM, and the trainer after SIGINT when a server failed under
  // it (its checkpoint cannot be complete then), before SIGKILL.
  absl::Duration kill_timeout = absl::Seconds(5);
};

struct JobOutcome {
  int exit_code = 0;
  std::string summary;  // one line: how the job ended
};

class LocalJob {
 public:
  // `signals` must report SIGINT, SIGTERM and SIGCHLD.
  LocalJob(LocalJobOptions options, SignalFd* signals);
  // Kills and reaps whatever still runs: no path out of the launcher leaves a child behind.
  ~LocalJob();
  LocalJob(const LocalJob&) = delete;
  LocalJob& operator=(const LocalJob&) = delete;

  // Runs the job to its end. Call it from the thread that outlives the children (the main
  // thread): their death signal is tied to the thread that started them.
  JobOutcome Run();

 private:
  struct Shard {
    std::unique_ptr<ChildProcess> process;
    std::unique_ptr<LineReader> output;  // until the forwarder takes it over
    std::thread forwarder;
    int port = 0;
  };

  absl::Status StartServers();
  absl::Status AwaitPort(int k, absl::Time deadline);
  absl::Status StartTrainer();
  JobOutcome Monitor();
  JobOutcome AfterStopSignal();
  JobOutcome AfterServerDied(int k);
  JobOutcome AfterTrainerExit();

  // Asks the trainer to stop with SIGINT, then kills it after `grace`.
  void StopTrainer(absl::Duration grace);
  // SIGTERM to every server still running, SIGKILL after kill_timeout, then waits for their
  // output to end.
  void StopServers();
  void KillEverything();
  void HandleSignal(int signo);
  // Waits until `child` is reaped or `deadline`, acting on signals that arrive meanwhile.
  bool WaitForChild(ChildProcess& child, absl::Time deadline);
  void JoinForwarders();

  LocalJobOptions options_;
  SignalFd* signals_;
  std::vector<Shard> shards_;
  std::unique_ptr<ChildProcess> trainer_;
  // The first SIGINT/SIGTERM; it starts the orderly shutdown.
  int stop_signal_ = 0;
  // Set once the job is ending: any signal from then on kills everything at once.
  bool shutting_down_ = false;
  // The signal that made the launcher kill everything, if one did.
  int kill_signal_ = 0;
};

}  // namespace offload

#endif  // OFFLOAD_SERVICES_LAUNCHER_LOCAL_JOB_H_
