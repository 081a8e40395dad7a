// The trainer as a pool worker (gpu_trainer --controller=...): it registers with the job
// controller and, for each rank of a job it is assigned, runs gpu_trainer as a child process with
// that job's flags, then reports how the child ended. A child per attempt means a job that
// crashes leaves the worker clean for the next one, and a rank runs exactly the code (and checks)
// of a rank started by hand.
#ifndef OFFLOAD_GPU_TRAINER_APP_TRAINER_WORKER_H_
#define OFFLOAD_GPU_TRAINER_APP_TRAINER_WORKER_H_

#include <csignal>
#include <string>
#include <vector>

#include "offload/v1/worker.pb.h"

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
int RunTrainerWorker(const std::string& trainer_binary, const std::string& controller,
                     const std::string& rank_address, int worker_index,
                     const std::vector<std::string>& rank_args, volatile std::sig_atomic_t* stop);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_APP_TRAINER_WORKER_H_
