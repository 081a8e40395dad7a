// The training loop of gpu_trainer around a started Trainer: the steps up to the last, with the
// evaluation and checkpoint cadence, a stop asked by a signal or by the job controller, the
// controller's checkpoint requests, the progress display and metrics, and the run's end (the
// last evaluation, the final checkpoint, the last report). A unit of its own so that tests run
// it with a fake controller and read its output.
#ifndef OFFLOAD_GPU_TRAINER_APP_RUN_TRAINING_H_
#define OFFLOAD_GPU_TRAINER_APP_RUN_TRAINING_H_

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "gpu_trainer/train/trainer.h"
#include "offload/v1/worker.pb.h"

namespace offload {

// The job controller as rank 0 of one of its jobs sees it: the loop reports every step and
// carries out what the controller asks in return.
class ControllerLink {
 public:
  virtual ~ControllerLink() = default;

  // The controller's latest answer: a pause or cancel request, and its checkpoint request
  // counter.
  virtual v1::ProgressReply reply() const = 0;
  // The progress the next report carries; must not block on the network, since it runs between
  // two training steps.
  virtual void Update(const v1::ProgressReport& progress) = 0;
  // Sends the current report now and waits for the answer, up to `timeout`.
  virtual absl::Status Flush(absl::Duration timeout) = 0;
};

struct TrainingLoopOptions {
  // Where rank 0 shows progress, evaluations, checkpoints and the summary, and where any rank
  // says it was interrupted.
  std::FILE* out = stdout;
  bool progress_bar = false;  // else a log line every log_every steps
  int log_every = 10;
  int eval_every = 100;  // steps between validation evaluations; 0: only at the end
  int eval_batches = 20;
  // The trainer's checkpoint directory; empty: the run writes no checkpoint.
  std::string checkpoint_dir;
  int checkpoint_every = 0;  // steps between checkpoints; 0: only at the end
  // The model FLOPs of one token, for the step metrics.
  double flops_per_token = 0;
  // Asked before every step; true stops the run (with a checkpoint) after the next step, which
  // every rank agrees on. Null: never.
  std::function<bool()> stop_requested;
};

struct TrainingOutcome {
  // A stop request (a signal, the controller's pause or cancel) ended the run, possibly short of
  // total_steps(), without the final evaluation.
  bool interrupted = false;
  bool evaluated = false;  // an interrupted run may stop before its first evaluation
  // The latest evaluation's; checkpoints carry it, so one taken before any evaluation holds 0.
  float val_loss = 0;
  std::string checkpoint;  // the last checkpoint written; empty: none
};

// Trains `trainer`, started, from its current step to total_steps(), then evaluates (unless
// interrupted), writes the final checkpoint and flushes the trainer. `controller` is null but on
// rank 0 of a job the controller runs. Every rank of the job calls it with the same options; an
// error of any collective step ends the run with that error.
absl::StatusOr<TrainingOutcome> RunTraining(Trainer& trainer, const TrainingLoopOptions& options,
                                            ControllerLink* controller);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_APP_RUN_TRAINING_H_
