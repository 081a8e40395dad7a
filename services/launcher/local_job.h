// LocalJob: one training job on this machine — S optimizer servers and W data-parallel trainer
// ranks on loopback — started, watched and shut down in order.
#ifndef OFFLOAD_SERVICES_LAUNCHER_LOCAL_JOB_H_
#define OFFLOAD_SERVICES_LAUNCHER_LOCAL_JOB_H_

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "services/launcher/signal_fd.h"
#include "services/spawn/child_output.h"
#include "services/spawn/child_process.h"

namespace offload {

struct LocalJobOptions {
  int num_shards = 1;
  // Trainer processes. Above 1 each gets --rank, --world_size and --rendezvous (a directory the
  // job creates and removes); with 1 the trainer's command line has none of them.
  int num_ranks = 1;
  std::string server_binary;
  std::string trainer_binary;
  // Given to every server after --listen=127.0.0.1:0.
  std::vector<std::string> server_args;
  // Given to every rank after --shards=127.0.0.1:p1,... (and the rank flags). With --device=cuda
  // each rank also gets its own GPU, --cuda_device=R (rank_devices.h), unless these set one.
  std::vector<std::string> trainer_args;
  // How long the servers have, together, to announce their ports.
  absl::Duration startup_timeout = absl::Seconds(30);
  // How long the ranks have after SIGINT to finish their step and write their checkpoint.
  absl::Duration shutdown_timeout = absl::Seconds(60);
  // How long a server has after SIGTERM, and the ranks after SIGINT when a server or a rank failed
  // under them (their checkpoint cannot be complete then), before SIGKILL.
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
  // Kills and reaps whatever still runs: no path out of the launcher leaves a child behind. Then
  // removes the rendezvous directory, which no rank can write to any more.
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

  struct Rank {
    std::unique_ptr<ChildProcess> process;
    std::thread forwarder;  // ranks >= 1: their output, prefixed; rank 0 has the terminal
  };

  absl::Status StartServers();
  absl::Status AwaitPort(int k, absl::Time deadline);
  absl::Status CreateRendezvous();
  void RemoveRendezvous();
  absl::Status StartRanks();
  JobOutcome Monitor();
  JobOutcome AfterStopSignal();
  JobOutcome AfterServerDied(int k);
  JobOutcome AfterRankFailed(int r);
  JobOutcome AfterRanksSucceeded();

  // "trainer" for a single rank, "trainer rank R" otherwise, so single-rank jobs read as before.
  std::string RankName(int r) const;
  // How every rank ended ("trainer rank 0 exited with status 130, trainer rank 1 ..."), leaving
  // out rank `except`. Call it once every rank is reaped.
  std::string DescribeRanks(int except = -1) const;
  // Asks every rank still running to stop with SIGINT, then kills those left after `grace`.
  void StopRanks(absl::Duration grace);
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
  std::vector<Rank> ranks_;
  // Empty until created (only for more than one rank).
  std::string rendezvous_dir_;
  std::vector<std::string> rank_device_flags_;  // (num_ranks,) "--cuda_device=K" or ""
  std::string shard_token_;                     // what the servers accept and the ranks present
  // The first SIGINT/SIGTERM; it starts the orderly shutdown.
  int stop_signal_ = 0;
  // Set once the job is ending: any signal from then on kills everything at once.
  bool shutting_down_ = false;
  // The signal that made the launcher kill everything, if one did.
  int kill_signal_ = 0;
};

}  // namespace offload

#endif  // OFFLOAD_SERVICES_LAUNCHER_LOCAL_JOB_H_
