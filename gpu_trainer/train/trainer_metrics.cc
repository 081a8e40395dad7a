#include "gpu_trainer/train/trainer_metrics.h"

#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/metrics/metrics.h"

namespace offload {
namespace {

// Every phase the training loop times (trainer.cc, gradient_sender.cc, gradient_reducer.cc);
// commit_delayed is a delayed update's commit, run in the background (--dpu).
constexpr const char* kPhases[] = {
    "forward",     "backward",   "wait_reduce",    "wait_offload",   "commit",
    "wait_commit", "all_gather", "reduce_scatter", "send_gradients", "commit_delayed"};
constexpr int kNumPhases = sizeof(kPhases) / sizeof(kPhases[0]);

struct Metrics {
  prometheus::Family<prometheus::Histogram>& phase_family;
  prometheus::Histogram* phases[kNumPhases];
  prometheus::Counter& steps;
  prometheus::Counter& skipped;
  prometheus::Counter& tokens;
  prometheus::Gauge& step;
  prometheus::Gauge& last_step_time;
  prometheus::Histogram& step_seconds;
  prometheus::Gauge& loss;
  prometheus::Gauge& loss_scale;
  prometheus::Gauge& lr;
  prometheus::Gauge& grad_norm;
  prometheus::Gauge& tokens_per_second;
  prometheus::Gauge& flops_per_second;
  prometheus::Family<prometheus::Gauge>& memory_used;
  prometheus::Family<prometheus::Gauge>& memory_total;

  static Metrics& Get() {
    static Metrics* m = Make();
    return *m;
  }

 private:
  static Metrics* Make() {
    prometheus::Registry& r = MetricsRegistry();
    auto gauge = [&r](const char* name, const char* help) -> prometheus::Gauge& {
      return prometheus::BuildGauge().Name(name).Help(help).Register(r).Add({});
    };
    auto counter = [&r](const char* name, const char* help) -> prometheus::Counter& {
      return prometheus::BuildCounter().Name(name).Help(help).Register(r).Add({});
    };
    auto* m = new Metrics{
        prometheus::BuildHistogram()
            .Name("offload_trainer_phase_seconds")
            .Help("Time in one phase of a training step.")
            .Register(r),
        {},
        counter("offload_trainer_steps_total", "Optimizer steps finished, skipped ones included."),
        counter("offload_trainer_skipped_steps_total", "Steps dropped for fp16 overflow."),
        counter("offload_trainer_tokens_total", "Tokens this rank trained on."),
        gauge("offload_trainer_step", "The last finished step."),
        gauge("offload_trainer_last_step_timestamp_seconds",
              "When the last step finished, seconds since the Unix epoch."),
        prometheus::BuildHistogram()
            .Name("offload_trainer_step_seconds")
            .Help("Wall time of a whole training step.")
            .Register(r)
            .Add({}, DurationBuckets()),
        gauge("offload_trainer_loss", "Training loss of the last step."),
        gauge("offload_trainer_loss_scale", "fp16 loss scale (1 for bf16)."),
        gauge("offload_trainer_learning_rate", "Learning rate of the last step."),
        gauge("offload_trainer_grad_norm", "Global gradient norm of the last step."),
        gauge("offload_trainer_tokens_per_second", "This rank's tokens per second, last step."),
        gauge("offload_trainer_flops_per_second",
              "Achieved model FLOP/s of this rank in the last step."),
        prometheus::BuildGauge()
            .Name("offload_trainer_device_memory_used_bytes")
            .Help("Memory the model holds on its device.")
            .Register(r),
        prometheus::BuildGauge()
            .Name("offload_trainer_device_memory_total_bytes")
            .Help("The device's memory.")
            .Register(r)};
    for (int i = 0; i < kNumPhases; ++i) {
      m->phases[i] = &m->phase_family.Add({{"phase", kPhases[i]}}, DurationBuckets());
    }
    return m;
  }
};

}  // namespace

void ObserveTrainerPhaseSeconds(const char* phase, double seconds) {
  Metrics& m = Metrics::Get();
  for (int i = 0; i < kNumPhases; ++i) {
    if (std::strcmp(phase, kPhases[i]) == 0) {
      m.phases[i]->Observe(seconds);
      return;
    }
  }
  m.phase_family.Add({{"phase", phase}}, DurationBuckets()).Observe(seconds);
}

namespace {

prometheus::Family<prometheus::Gauge>& InfoFamily() {
  static prometheus::Family<prometheus::Gauge>& family =
      prometheus::BuildGauge()
          .Name("offload_trainer_info")
          .Help("What this trainer rank runs; always 1.")
          .Register(MetricsRegistry());
  return family;
}

prometheus::Gauge& AddInfo(const TrainerInfo& info) {
  Metrics::Get();  // every trainer family exists from the start, before the first step
  prometheus::Gauge& gauge = InfoFamily().Add({{"job_id", info.job_id},
                                               {"rank", absl::StrCat(info.rank)},
                                               {"world_size", absl::StrCat(info.world_size)},
                                               {"device", info.device},
                                               {"model", info.model}});
  gauge.Set(1);
  return gauge;
}

}  // namespace

void SetTrainerInfo(const TrainerInfo& info) { AddInfo(info); }

TrainerInfoScope::TrainerInfoScope(const TrainerInfo& info) : gauge_(&AddInfo(info)) {}

TrainerInfoScope::~TrainerInfoScope() { InfoFamily().Remove(gauge_); }

void RecordReportedProgress(const ReportedProgress& p) {
  Metrics& m = Metrics::Get();
  m.steps.Increment(static_cast<double>(p.new_steps));
  m.tokens.Increment(p.new_tokens);
  m.step.Set(static_cast<double>(p.step));
  if (p.new_steps > 0) {
    m.last_step_time.Set(
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  }
  m.loss.Set(p.loss);
  m.loss_scale.Set(p.loss_scale);
  m.lr.Set(p.lr);
  m.grad_norm.Set(p.grad_norm);
  m.tokens_per_second.Set(p.tokens_per_s);
}

void RecordTrainerStep(const StepReport& report, double step_seconds, double tokens, double flops) {
  Metrics& m = Metrics::Get();
  m.steps.Increment();
  if (report.skipped) m.skipped.Increment();
  m.tokens.Increment(tokens);
  m.step.Set(static_cast<double>(report.step));
  m.last_step_time.Set(
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  m.step_seconds.Observe(step_seconds);
  m.loss.Set(report.loss);
  m.loss_scale.Set(report.loss_scale);
  m.lr.Set(report.lr);
  m.grad_norm.Set(report.grad_norm);
  if (step_seconds > 0) {
    m.tokens_per_second.Set(tokens / step_seconds);
    m.flops_per_second.Set(flops / step_seconds);
  }
}

void RecordDeviceMemory(const ModelRunner::DeviceMemory& memory) {
  Metrics& m = Metrics::Get();
  m.memory_used.Add({{"device", memory.device}}).Set(static_cast<double>(memory.used_bytes));
  m.memory_total.Add({{"device", memory.device}}).Set(static_cast<double>(memory.total_bytes));
}

}  // namespace offload
