// The gpu_trainer program (ARCHITECTURE.md section 2.1): its whole command line, whose flags are
// defined here (trainer_program.cc) and in trainer_config.cc, and one trainer rank. The program's
// main() is services/trainer_worker/gpu_trainer_main.cc: with --controller=HOST:PORT the program
// is a pool worker of the job controller, a service above the trainer that starts ranks as child
// gpu_trainer processes, so main() lives with it and hands that mode in here.
#ifndef OFFLOAD_GPU_TRAINER_APP_TRAINER_PROGRAM_H_
#define OFFLOAD_GPU_TRAINER_APP_TRAINER_PROGRAM_H_

#include <csignal>
#include <string>
#include <vector>

namespace offload {

// What `gpu_trainer --controller=HOST:PORT` runs with, from its flags.
struct PoolWorkerArgs {
  int workers = 1;                     // --workers, checked to be in [1, 1024]
  std::string trainer_binary;          // argv[0]: each rank runs as a child of it
  std::string controller;              // --controller
  std::string rank_address;            // --rank_address
  int worker_index = -1;               // --worker_index
  std::string rank_metrics_address;    // --rank_metrics_address
  std::string script_user;             // --script_user (unparsed: the worker's to check)
  std::string script_groups;           // --script_groups
  std::vector<std::string> rank_args;  // after "--": this worker's additions to every rank's flags
  volatile std::sig_atomic_t* stop = nullptr;  // set by SIGINT/SIGTERM
};
// Runs the pool workers; returns the process exit status.
using PoolWorkersFn = int (*)(const PoolWorkerArgs& args);

// gpu_trainer's main(): parses the command line, starts the metrics server, then runs the pool
// workers through `pool_workers` when --controller is given, else one rank. Returns the process
// exit status.
int TrainerProgramMain(int argc, char** argv, PoolWorkersFn pool_workers);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_APP_TRAINER_PROGRAM_H_
