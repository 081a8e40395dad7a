// The trainer as a pool worker (gpu_trainer --controller=...): it registers with the job
// controller and, for each rank of a job it is assigned, runs gpu_trainer as a child process with
// that job's flags, then reports how the child ended. A child per attempt means a job that
// crashes leaves the worker clean for the next one, and a rank runs exactly the code (and checks)
// of a rank started by hand.
#ifndef OFFLOAD_SERVICES_TRAINER_WORKER_TRAINER_WORKER_H_
#define OFFLOAD_SERVICES_TRAINER_WORKER_TRAINER_WORKER_H_

#include <csignal>
#include <optional>
#include <string>
#include <vector>

#include "offload/v1/worker.pb.h"
#include "services/spawn/child_process.h"
#include "services/trainer_worker/script_user.h"

namespace offload {

// The child's command line for `assignment`: the job spec's flags (JobSpecToFlags), then the
// rank, shards and controller flags, the security flags this process was given, and rank_args
// (this worker's own settings: display, timeouts).
std::vector<std::string> RankCommandLine(const std::string& trainer_binary,
                                         const std::string& controller,
                                         const std::string& rank_address,
                                         const std::string& error_file,
                                         const std::vector<std::string>& rank_args,
                                         const v1::Assignment& assignment);

// rank_args go to every rank after the job's flags. worker_index (-1: none) is this worker's
// place in its set, WorkerInfo.index. Runs until *stop is set (SIGINT/SIGTERM): a running rank
// is asked to stop in order (SIGINT: it checkpoints) and waited for. Returns the process exit
// status.
// `name_suffix` tells apart the workers of one process (RunTrainerWorkers). A torch job's command
// runs as `script_user` where given (script_user.h), else as this process.
int RunTrainerWorker(const std::string& trainer_binary, const std::string& controller,
                     const std::string& rank_address, int worker_index,
                     const std::vector<std::string>& rank_args, volatile std::sig_atomic_t* stop,
                     const std::string& name_suffix = "",
                     const std::optional<RunAs>& script_user = std::nullopt);

// `workers` pool workers in this process, one rank each (a node or pod of that many GPUs), each
// on a thread of its own as RunTrainerWorker. Worker k registers with index
// worker_index * workers + k (none when worker_index < 0), so an Indexed Job of P pods offers
// ranks 0 .. P * workers - 1 in order; the controller sees they share rank_address, so worker k's
// CUDA rank takes GPU k. Its rank serves metrics on rank_metrics_address's port + k (none when
// ""; port 0, any free port, for every rank). Worker k runs torch jobs' commands as
// ScriptUserOf(*script_users, k), checked (CheckScriptUsers) before any worker registers.
// Returns the first non-zero exit status; 2 for a rank_metrics_address without a port or script
// users that fail the check.
int RunTrainerWorkers(int workers, const std::string& trainer_binary, const std::string& controller,
                      const std::string& rank_address, int worker_index,
                      const std::string& rank_metrics_address,
                      const std::vector<std::string>& rank_args,
                      const std::optional<ScriptUsers>& script_users,
                      volatile std::sig_atomic_t* stop);

}  // namespace offload

#endif  // OFFLOAD_SERVICES_TRAINER_WORKER_TRAINER_WORKER_H_
