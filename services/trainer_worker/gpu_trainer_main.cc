// gpu_trainer's main(). The program trains one rank (gpu_trainer/app/trainer_program.h, where its
// command line is), or, with --controller=HOST:PORT, is a pool worker of the job controller that
// runs each rank it is assigned as a child gpu_trainer process (trainer_worker.h). main() lives
// here, beside the pool worker, because the worker is a service that controls trainer ranks: it
// may depend on the trainer, and the trainer never on it.
#include <cstdio>

#include "gpu_trainer/app/trainer_program.h"
#include "services/trainer_worker/script_user.h"
#include "services/trainer_worker/trainer_worker.h"

int main(int argc, char** argv) {
  return offload::TrainerProgramMain(argc, argv, [](const offload::PoolWorkerArgs& args) {
    absl::StatusOr<std::optional<offload::ScriptUsers>> script_users =
        offload::ParseScriptUsers(args.script_user, args.script_groups);
    if (!script_users.ok()) {
      std::fprintf(stderr, "gpu_trainer: %s\n", script_users.status().ToString().c_str());
      return 2;
    }
    return offload::RunTrainerWorkers(
        args.workers, args.trainer_binary, args.controller, args.rank_address, args.worker_index,
        args.rank_metrics_address, args.rank_args, *script_users, args.stop);
  });
}
