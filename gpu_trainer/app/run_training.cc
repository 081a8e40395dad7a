#include "gpu_trainer/app/run_training.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "gpu_trainer/app/progress.h"
#include "gpu_trainer/train/trainer_metrics.h"

namespace offload {
namespace {

// One run of the loop and the state its steps share.
class TrainingLoop {
 public:
  TrainingLoop(Trainer* trainer, const TrainingLoopOptions& options, ControllerLink* controller)
      : trainer_(trainer),
        options_(options),
        controller_(controller),
        lead_(trainer->rank() == 0),
        reporter_(options.out, options.progress_bar, trainer->total_steps(), options.log_every),
        first_step_(trainer->step()) {}

  absl::StatusOr<TrainingOutcome> Run();

 private:
  // Carries out the controller's requests before a step: pause and cancel stop the run like a
  // signal; a checkpoint request is agreed through the step.
  void HearController();
  void ReportProgress(uint64_t step, float loss, float loss_scale);
  absl::Status Evaluate();
  // Writes a checkpoint and tells the controller of it; returns its directory.
  absl::StatusOr<std::string> SaveCheckpoint();
  double Seconds() const { return absl::ToDoubleSeconds(absl::Now() - start_); }

  Trainer* const trainer_;
  const TrainingLoopOptions& options_;
  ControllerLink* const controller_;
  // Rank 0 speaks for the job; the others say only what concerns them (errors, the end).
  const bool lead_;
  ProgressReporter reporter_;
  const absl::Time start_ = absl::Now();
  const uint64_t first_step_;
  v1::ProgressReport report_;
  uint64_t checkpoint_request_done_ = 0;
  TrainingOutcome outcome_;
};

absl::StatusOr<TrainingOutcome> TrainingLoop::Run() {
  Trainer& t = *trainer_;
  const bool checkpoints = !options_.checkpoint_dir.empty();
  // This rank's share of a step's tokens, and the model FLOPs they take.
  const double rank_tokens_per_step = static_cast<double>(t.tokens_per_step()) / t.world_size();
  const double rank_flops_per_step = options_.flops_per_token * rank_tokens_per_step;

  // A signal stops the run at a step boundary every rank agrees on (the step's report says so),
  // so their collectives stay in step.
  while (t.step() < t.total_steps()) {
    if (options_.stop_requested && options_.stop_requested()) t.RequestStop();
    if (controller_ != nullptr) HearController();
    const auto step_begin = std::chrono::steady_clock::now();
    OFFLOAD_ASSIGN_OR_RETURN(const StepReport r, t.Step());
    RecordTrainerStep(
        r, std::chrono::duration<double>(std::chrono::steady_clock::now() - step_begin).count(),
        rank_tokens_per_step, rank_flops_per_step);
    if (lead_) reporter_.Step(r.step, r.loss, r.lr, r.loss_scale, r.skipped, t.tokens_per_step());
    if (r.checkpoint_request > checkpoint_request_done_ && checkpoints && !r.stop) {
      OFFLOAD_ASSIGN_OR_RETURN(const std::string dir, SaveCheckpoint());
      if (lead_) reporter_.Message(absl::StrCat("checkpoint ", dir, " (requested)"));
    }
    // Every rank records it, so a later request is told apart from this one whoever asks.
    checkpoint_request_done_ = std::max(checkpoint_request_done_, r.checkpoint_request);
    ReportProgress(r.step, r.loss, r.loss_scale);
    if (r.stop) {
      outcome_.interrupted = true;
      break;
    }
    if (options_.eval_every > 0 && r.step % options_.eval_every == 0 && r.step < t.total_steps()) {
      OFFLOAD_RETURN_IF_ERROR(Evaluate());
      if (lead_) {
        reporter_.Message(absl::StrFormat("step %d: val_loss %.4f", r.step, outcome_.val_loss));
      }
    }
    if (checkpoints && options_.checkpoint_every > 0 && r.step % options_.checkpoint_every == 0 &&
        r.step < t.total_steps()) {
      OFFLOAD_ASSIGN_OR_RETURN(const std::string dir, SaveCheckpoint());
      if (lead_) reporter_.Message(absl::StrCat("checkpoint ", dir));
    }
  }
  if (lead_) reporter_.Finish();
  const double seconds = Seconds();

  // An interrupted run keeps the last validation loss: the user asked it to stop now.
  if (!outcome_.interrupted) OFFLOAD_RETURN_IF_ERROR(Evaluate());
  if (lead_) {
    std::fprintf(options_.out,
                 "gpu_trainer: step %llu val_loss %s (%llu steps in %s, %.0f tokens/s, %llu "
                 "skipped)\n",
                 static_cast<unsigned long long>(t.step()),
                 outcome_.evaluated ? absl::StrFormat("%.4f", outcome_.val_loss).c_str()
                                    : "not evaluated yet",
                 static_cast<unsigned long long>(t.step() - first_step_),
                 FormatDuration(seconds).c_str(),
                 (t.step() - first_step_) * t.tokens_per_step() / std::max(seconds, 1e-9),
                 static_cast<unsigned long long>(t.loss_scaler().skipped_steps()));
  }
  if (checkpoints) {
    OFFLOAD_ASSIGN_OR_RETURN(const std::string dir, SaveCheckpoint());
    if (lead_) {
      std::fprintf(options_.out,
                   "gpu_trainer: checkpoint %s (continue with --resume --checkpoint_dir=%s)\n",
                   dir.c_str(), options_.checkpoint_dir.c_str());
    }
  }
  // Every rank's last commit is done before rank 0 drops the job.
  OFFLOAD_RETURN_IF_ERROR(t.Flush());
  // The controller hears the last step and checkpoint before the worker reports the exit.
  if (controller_ != nullptr) {
    ReportProgress(t.step(), report_.loss(), t.loss_scaler().scale());
    if (absl::Status s = controller_->Flush(absl::Seconds(10)); !s.ok()) {
      LOG(WARNING) << absl::StrFormat("gpu_trainer: last progress report: %s", s.ToString());
    }
  }
  if (outcome_.interrupted) {
    std::fprintf(options_.out, "gpu_trainer: %sinterrupted at step %llu%s\n",
                 lead_ ? "" : absl::StrCat("rank ", t.rank(), " ").c_str(),
                 static_cast<unsigned long long>(t.step()),
                 checkpoints && lead_ ? "; rerun with --resume to continue" : "");
  }
  return outcome_;
}

void TrainingLoop::HearController() {
  const v1::ProgressReply reply = controller_->reply();
  if (reply.request() == v1::JOB_REQUEST_PAUSE || reply.request() == v1::JOB_REQUEST_CANCEL) {
    trainer_->RequestStop();
  }
  if (reply.checkpoint_request() > checkpoint_request_done_) {
    trainer_->RequestCheckpoint(reply.checkpoint_request());
  }
}

void TrainingLoop::ReportProgress(uint64_t step, float loss, float loss_scale) {
  if (controller_ == nullptr) return;
  const double seconds = Seconds();
  report_.set_step(step);
  report_.set_total_steps(trainer_->total_steps());
  report_.set_loss(loss);
  report_.set_val_loss(outcome_.val_loss);
  report_.set_loss_scale(loss_scale);
  report_.set_tokens_per_s(
      seconds > 0 ? (step - first_step_) * trainer_->tokens_per_step() / seconds : 0);
  report_.set_checkpoint_request_done(checkpoint_request_done_);
  controller_->Update(report_);
}

absl::Status TrainingLoop::Evaluate() {
  OFFLOAD_ASSIGN_OR_RETURN(outcome_.val_loss, trainer_->Evaluate(options_.eval_batches));
  outcome_.evaluated = true;
  return absl::OkStatus();
}

absl::StatusOr<std::string> TrainingLoop::SaveCheckpoint() {
  OFFLOAD_ASSIGN_OR_RETURN(std::string dir, trainer_->SaveCheckpoint(outcome_.val_loss));
  report_.set_checkpoint_dir(dir);
  report_.set_checkpoint_step(trainer_->step());
  outcome_.checkpoint = dir;
  return dir;
}

}  // namespace

absl::StatusOr<TrainingOutcome> RunTraining(Trainer& trainer, const TrainingLoopOptions& options,
                                            ControllerLink* controller) {
  return TrainingLoop(&trainer, options, controller).Run();
}

}  // namespace offload
