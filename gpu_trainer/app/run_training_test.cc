// The training loop's cadence on a tiny model with the optimizer in process: which steps it
// evaluates and checkpoints at, how a stop request, the controller's pause, cancel and checkpoint
// requests end or interrupt it, what the controller hears, and a resume with nothing to train.
#include "gpu_trainer/app/run_training.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gpu_trainer/train/trainer.h"
#include "gpu_trainer/train/trainer_test_util.h"
#include "gtest/gtest.h"
#include "optimizer_client/backends/inprocess_optimizer.h"

namespace offload {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::IsEmpty;
using ::testing::StartsWith;

// The controller as the loop sees it: it keeps every report, and answers what the test set for
// the last step reported.
class FakeController : public ControllerLink {
 public:
  // From the report of `step` on, the controller answers `reply`.
  void AnswerFrom(uint64_t step, const v1::ProgressReply& reply) { answers_[step] = reply; }

  v1::ProgressReply reply() const override {
    v1::ProgressReply latest;
    if (reports_.empty()) return latest;
    for (auto it = answers_.begin(); it != answers_.upper_bound(reports_.back().step()); ++it) {
      latest = it->second;
    }
    return latest;
  }
  void Update(const v1::ProgressReport& progress) override { reports_.push_back(progress); }
  absl::Status Flush(absl::Duration) override {
    ++flushes_;
    return absl::OkStatus();
  }

  const std::vector<v1::ProgressReport>& reports() const { return reports_; }
  int flushes() const { return flushes_; }

  std::vector<uint64_t> ReportedSteps() const {
    std::vector<uint64_t> steps;
    for (const v1::ProgressReport& r : reports_) steps.push_back(r.step());
    return steps;
  }

 private:
  std::map<uint64_t, v1::ProgressReply> answers_;
  std::vector<v1::ProgressReport> reports_;
  int flushes_ = 0;
};

v1::ProgressReply Request(v1::JobRequest request) {
  v1::ProgressReply reply;
  reply.set_request(request);
  return reply;
}

v1::ProgressReply CheckpointRequest(uint64_t n) {
  v1::ProgressReply reply;
  reply.set_checkpoint_request(n);
  return reply;
}

class RunTrainingTest : public ::testing::Test {
 protected:
  // `steps` steps of the tiny model, checkpoints (every one kept) in a directory of the test's.
  TrainerOptions Options(uint64_t steps) const {
    TrainerOptions o = TinyOptions();
    o.steps = steps;
    o.schedule.set_total_steps(steps);
    o.checkpoint_dir = dir_.path();
    o.keep_checkpoints = 100;
    return o;
  }

  // The loop's options for `o`: log lines only at the last step, cheap evaluations.
  static TrainingLoopOptions LoopOptions(const TrainerOptions& o) {
    TrainingLoopOptions loop;
    loop.log_every = 1000;
    loop.eval_every = 0;
    loop.eval_batches = 2;
    loop.checkpoint_dir = o.checkpoint_dir;
    return loop;
  }

  // A new optimizer and trainer for `o`, started (resumed if o.resume and there is a checkpoint).
  void Start(const TrainerOptions& o) {
    trainer_.reset();
    backend_ = std::make_unique<InProcessOptimizer>(MapFor(o, 1), 1, BestSimdPath());
    absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(o, backend_.get());
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    trainer_ = std::move(*trainer);
    absl::StatusOr<std::string> started = trainer_->Start();
    ASSERT_TRUE(started.ok()) << started.status();
  }

  // RunTraining with its output in output_.
  absl::StatusOr<TrainingOutcome> Run(TrainingLoopOptions loop,
                                      ControllerLink* controller = nullptr) {
    char* buffer = nullptr;
    size_t size = 0;
    loop.out = open_memstream(&buffer, &size);
    absl::StatusOr<TrainingOutcome> outcome = RunTraining(*trainer_, loop, controller);
    std::fclose(loop.out);
    output_.assign(buffer, size);
    std::free(buffer);
    return outcome;
  }

  // The output's lines that start with `prefix`.
  std::vector<std::string> Lines(absl::string_view prefix) const {
    std::vector<std::string> lines;
    for (absl::string_view line : absl::StrSplit(output_, '\n')) {
      if (absl::StartsWith(line, prefix)) lines.emplace_back(line);
    }
    return lines;
  }

  // The steps of the evaluations the loop reported ("step N: val_loss X"), and their losses as
  // printed.
  std::map<uint64_t, std::string> Evaluations() const {
    std::map<uint64_t, std::string> evaluations;
    for (absl::string_view line : Lines("step ")) {
      const std::vector<std::string> parts = absl::StrSplit(line, ": val_loss ");
      uint64_t step;
      if (parts.size() == 2 && absl::SimpleAtoi(absl::StripPrefix(parts[0], "step "), &step)) {
        evaluations[step] = parts[1];
      }
    }
    return evaluations;
  }
  std::vector<uint64_t> EvaluatedSteps() const {
    std::vector<uint64_t> steps;
    for (const auto& [step, loss] : Evaluations()) steps.push_back(step);
    return steps;
  }

  // The steps of the checkpoints in the checkpoint directory.
  std::vector<uint64_t> CheckpointSteps() const {
    std::vector<uint64_t> steps;
    for (const auto& entry : std::filesystem::directory_iterator(dir_.path())) {
      absl::string_view name = entry.path().filename().native();
      uint64_t step;
      if (absl::ConsumePrefix(&name, "step-") && absl::SimpleAtoi(name, &step)) {
        steps.push_back(step);
      }
    }
    std::sort(steps.begin(), steps.end());
    return steps;
  }

  std::string StepDir(uint64_t step) const {
    return absl::StrFormat("%s/step-%08d", dir_.path(), step);
  }
  std::string FinalCheckpointLine(uint64_t step) const {
    return absl::StrCat("gpu_trainer: checkpoint ", StepDir(step),
                        " (continue with --resume --checkpoint_dir=", dir_.path(), ")");
  }

  // Pause and cancel stop the run as a signal does: after the next step, with a checkpoint.
  void ExpectTheRequestStopsTheRun(v1::JobRequest request, uint64_t from_step) {
    TrainerOptions o = Options(8);
    ASSERT_NO_FATAL_FAILURE(Start(o));
    FakeController controller;
    controller.AnswerFrom(from_step, Request(request));
    absl::StatusOr<TrainingOutcome> outcome = Run(LoopOptions(o), &controller);
    ASSERT_TRUE(outcome.ok()) << outcome.status();

    const uint64_t last = from_step + 1;
    EXPECT_TRUE(outcome->interrupted);
    EXPECT_EQ(trainer_->step(), last);
    EXPECT_THAT(CheckpointSteps(), ElementsAre(last));
    std::vector<uint64_t> reported;
    for (uint64_t step = 1; step <= last; ++step) reported.push_back(step);
    reported.push_back(last);  // the end's
    ASSERT_THAT(controller.ReportedSteps(), ElementsAreArray(reported));
    EXPECT_EQ(controller.reports().back().checkpoint_step(), last);
    EXPECT_EQ(controller.flushes(), 1);
    EXPECT_THAT(Lines("gpu_trainer: interrupted"),
                ElementsAre(absl::StrCat("gpu_trainer: interrupted at step ", last,
                                         "; rerun with --resume to continue")));
  }

  TempDir dir_;
  std::unique_ptr<InProcessOptimizer> backend_;
  std::unique_ptr<Trainer> trainer_;  // after backend_: goes first
  std::string output_;
};

TEST_F(RunTrainingTest, EvaluatesAtMultiplesOfEvalEveryButTheLastStepThenAtTheEnd) {
  TrainerOptions o = Options(9);
  o.checkpoint_dir.clear();
  ASSERT_NO_FATAL_FAILURE(Start(o));
  TrainingLoopOptions loop = LoopOptions(o);
  loop.eval_every = 3;
  absl::StatusOr<TrainingOutcome> outcome = Run(loop);
  ASSERT_TRUE(outcome.ok()) << outcome.status();

  EXPECT_FALSE(outcome->interrupted);
  EXPECT_EQ(trainer_->step(), 9u);
  EXPECT_THAT(EvaluatedSteps(), ElementsAre(3, 6));
  // The end evaluates again: the summary's loss is a new one, not step 6's.
  EXPECT_TRUE(outcome->evaluated);
  const std::string final_loss = absl::StrFormat("%.4f", outcome->val_loss);
  EXPECT_NE(Evaluations().at(6), final_loss);
  const std::vector<std::string> summary = Lines("gpu_trainer: step ");
  ASSERT_EQ(summary.size(), 1u) << output_;
  EXPECT_TRUE(absl::StartsWith(
      summary[0], absl::StrCat("gpu_trainer: step 9 val_loss ", final_loss, " (9 steps in ")))
      << summary[0];
  // No checkpoint directory, no checkpoint.
  EXPECT_THAT(Lines("checkpoint"), IsEmpty());
  EXPECT_THAT(Lines("gpu_trainer: checkpoint"), IsEmpty());
  EXPECT_TRUE(outcome->checkpoint.empty());
  EXPECT_TRUE(std::filesystem::is_empty(dir_.path()));
}

TEST_F(RunTrainingTest, EvalEveryZeroEvaluatesOnlyAtTheEnd) {
  TrainerOptions o = Options(4);
  ASSERT_NO_FATAL_FAILURE(Start(o));
  absl::StatusOr<TrainingOutcome> outcome = Run(LoopOptions(o));
  ASSERT_TRUE(outcome.ok()) << outcome.status();
  EXPECT_THAT(EvaluatedSteps(), IsEmpty());
  EXPECT_TRUE(outcome->evaluated);
  EXPECT_THAT(Lines("gpu_trainer: step 4 val_loss "),
              ElementsAre(StartsWith(absl::StrFormat(
                  "gpu_trainer: step 4 val_loss %.4f (4 steps in ", outcome->val_loss))));
}

TEST_F(RunTrainingTest, CheckpointsAtMultiplesOfCheckpointEveryAndAtTheEnd) {
  TrainerOptions o = Options(9);
  ASSERT_NO_FATAL_FAILURE(Start(o));
  TrainingLoopOptions loop = LoopOptions(o);
  loop.checkpoint_every = 3;
  absl::StatusOr<TrainingOutcome> outcome = Run(loop);
  ASSERT_TRUE(outcome.ok()) << outcome.status();

  EXPECT_FALSE(outcome->interrupted);
  EXPECT_THAT(CheckpointSteps(), ElementsAre(3, 6, 9));
  // Step 9 is the last: its checkpoint is the final one, written once.
  EXPECT_THAT(Lines("checkpoint "), ElementsAre(absl::StrCat("checkpoint ", StepDir(3)),
                                                absl::StrCat("checkpoint ", StepDir(6))));
  EXPECT_THAT(Lines("gpu_trainer: checkpoint "), ElementsAre(FinalCheckpointLine(9)));
  EXPECT_EQ(outcome->checkpoint, StepDir(9));
}

TEST_F(RunTrainingTest, AStopRequestEndsTheRunAfterTheNextStepWithACheckpoint) {
  TrainerOptions o = Options(10);
  ASSERT_NO_FATAL_FAILURE(Start(o));
  TrainingLoopOptions loop = LoopOptions(o);
  loop.eval_every = 2;
  loop.checkpoint_every = 3;
  // A signal during step 5: the loop sees it before step 6, which every rank then agrees is the
  // last, though 6 is a multiple of both cadences.
  loop.stop_requested = [this] { return trainer_->step() == 5; };
  absl::StatusOr<TrainingOutcome> outcome = Run(loop);
  ASSERT_TRUE(outcome.ok()) << outcome.status();

  EXPECT_TRUE(outcome->interrupted);
  EXPECT_EQ(trainer_->step(), 6u);
  EXPECT_THAT(EvaluatedSteps(), ElementsAre(2, 4));
  EXPECT_THAT(Lines("checkpoint "), ElementsAre(absl::StrCat("checkpoint ", StepDir(3))));
  EXPECT_THAT(CheckpointSteps(), ElementsAre(3, 6));
  EXPECT_THAT(Lines("gpu_trainer: checkpoint "), ElementsAre(FinalCheckpointLine(6)));
  // No evaluation at the end: the run keeps step 4's loss.
  EXPECT_EQ(absl::StrFormat("%.4f", outcome->val_loss), Evaluations().at(4));
  EXPECT_THAT(Lines("gpu_trainer: step "),
              ElementsAre(StartsWith(absl::StrCat("gpu_trainer: step 6 val_loss ",
                                                  Evaluations().at(4), " (6 steps in "))));
  EXPECT_THAT(Lines("gpu_trainer: interrupted"),
              ElementsAre("gpu_trainer: interrupted at step 6; rerun with --resume to continue"));
}

TEST_F(RunTrainingTest, AStopBeforeAnyEvaluationSaysSo) {
  TrainerOptions o = Options(10);
  o.checkpoint_dir.clear();
  ASSERT_NO_FATAL_FAILURE(Start(o));
  TrainingLoopOptions loop = LoopOptions(o);
  loop.eval_every = 2;
  loop.stop_requested = [] { return true; };
  absl::StatusOr<TrainingOutcome> outcome = Run(loop);
  ASSERT_TRUE(outcome.ok()) << outcome.status();

  EXPECT_TRUE(outcome->interrupted);
  EXPECT_FALSE(outcome->evaluated);
  EXPECT_EQ(trainer_->step(), 1u);
  EXPECT_THAT(
      Lines("gpu_trainer: step "),
      ElementsAre(StartsWith("gpu_trainer: step 1 val_loss not evaluated yet (1 steps in ")));
  // Without checkpoints there is nothing to resume from, and the line does not say to.
  EXPECT_THAT(Lines("gpu_trainer: interrupted"), ElementsAre("gpu_trainer: interrupted at step 1"));
}

TEST_F(RunTrainingTest, AControllerCheckpointRequestIsCarriedOutOnceAfterTheNextStep) {
  TrainerOptions o = Options(8);
  ASSERT_NO_FATAL_FAILURE(Start(o));
  FakeController controller;
  controller.AnswerFrom(3, CheckpointRequest(1));  // repeated in every answer after
  controller.AnswerFrom(6, CheckpointRequest(2));
  absl::StatusOr<TrainingOutcome> outcome = Run(LoopOptions(o), &controller);
  ASSERT_TRUE(outcome.ok()) << outcome.status();

  EXPECT_FALSE(outcome->interrupted);
  EXPECT_THAT(CheckpointSteps(), ElementsAre(4, 7, 8));
  EXPECT_THAT(Lines("checkpoint "),
              ElementsAre(absl::StrCat("checkpoint ", StepDir(4), " (requested)"),
                          absl::StrCat("checkpoint ", StepDir(7), " (requested)")));
  // Every step is reported, and the end once more; each request is done from the report of the
  // step it was carried out after.
  ASSERT_THAT(controller.ReportedSteps(), ElementsAre(1, 2, 3, 4, 5, 6, 7, 8, 8));
  std::vector<uint64_t> done, checkpoint_steps;
  for (const v1::ProgressReport& r : controller.reports()) {
    done.push_back(r.checkpoint_request_done());
    checkpoint_steps.push_back(r.checkpoint_step());
  }
  EXPECT_THAT(done, ElementsAre(0, 0, 0, 1, 1, 1, 2, 2, 2));
  EXPECT_THAT(checkpoint_steps, ElementsAre(0, 0, 0, 4, 4, 4, 7, 7, 8));
  EXPECT_EQ(controller.reports().back().checkpoint_dir(), StepDir(8));
  EXPECT_EQ(controller.reports().back().total_steps(), 8u);
  EXPECT_EQ(controller.reports().back().val_loss(), outcome->val_loss);
  EXPECT_EQ(controller.flushes(), 1);
}

TEST_F(RunTrainingTest, AControllerPauseStopsTheRun) {
  ExpectTheRequestStopsTheRun(v1::JOB_REQUEST_PAUSE, 3);
}

TEST_F(RunTrainingTest, AControllerCancelStopsTheRun) {
  ExpectTheRequestStopsTheRun(v1::JOB_REQUEST_CANCEL, 2);
}

TEST_F(RunTrainingTest, ARunResumedAtItsLastStepTrainsNothingAndStillCheckpoints) {
  TrainerOptions o = Options(6);
  ASSERT_NO_FATAL_FAILURE(Start(o));
  ASSERT_TRUE(Run(LoopOptions(o)).ok());
  ASSERT_THAT(CheckpointSteps(), ElementsAre(6));
  // A file only the first run's checkpoint holds: gone once the checkpoint is written again.
  const std::string marker = StepDir(6) + "/first_run";
  std::ofstream(marker) << "x";
  ASSERT_TRUE(std::filesystem::exists(marker));

  o.resume = true;
  ASSERT_NO_FATAL_FAILURE(Start(o));
  ASSERT_EQ(trainer_->step(), 6u);
  FakeController controller;
  absl::StatusOr<TrainingOutcome> outcome = Run(LoopOptions(o), &controller);
  ASSERT_TRUE(outcome.ok()) << outcome.status();

  EXPECT_FALSE(outcome->interrupted);
  EXPECT_EQ(trainer_->step(), 6u);
  EXPECT_THAT(Lines("step "), IsEmpty()) << output_;  // no step trained
  EXPECT_THAT(Lines("gpu_trainer: step "),
              ElementsAre(StartsWith(absl::StrFormat(
                  "gpu_trainer: step 6 val_loss %.4f (0 steps in ", outcome->val_loss))));
  EXPECT_THAT(Lines("gpu_trainer: checkpoint "), ElementsAre(FinalCheckpointLine(6)));
  EXPECT_THAT(CheckpointSteps(), ElementsAre(6));
  EXPECT_FALSE(std::filesystem::exists(marker));
  ASSERT_THAT(controller.ReportedSteps(), ElementsAre(6));
  EXPECT_EQ(controller.reports().back().checkpoint_dir(), StepDir(6));
  EXPECT_EQ(controller.flushes(), 1);
}

}  // namespace
}  // namespace offload
