// Per-phase timestamps of the training loop, written as a Chrome trace (the JSON array format
// chrome://tracing and Perfetto open): forward, backward, each gradient range on its way to the
// optimizer, the commit, and waits, one row per thread. It shows what overlaps what, e.g. that
// gradient offload starts before backward ends (ARCHITECTURE.md section 1).
#ifndef OFFLOAD_OPTIMIZER_CLIENT_SENDER_PHASE_TRACE_H_
#define OFFLOAD_OPTIMIZER_CLIENT_SENDER_PHASE_TRACE_H_

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace offload {

class PhaseTrace {
 public:
  using Clock = std::chrono::steady_clock;

  struct Event {
    std::string name;
    uint64_t step = 0;
    int thread = 0;       // a small id per recording thread, in order of first use
    double begin_us = 0;  // since the trace started
    double end_us = 0;
  };

  PhaseTrace() : start_(Clock::now()) {}

  // Thread-safe: the trainer, the gradient sender and a background commit record at once.
  void Record(const std::string& name, uint64_t step, Clock::time_point begin,
              Clock::time_point end);

  std::vector<Event> Events() const;
  // Writes the events as a Chrome trace JSON file, atomically (temp file, then rename).
  absl::Status WriteChromeTrace(const std::string& path) const;

 private:
  const Clock::time_point start_;
  mutable std::mutex mu_;
  std::vector<Event> events_;               // guarded by mu_
  std::vector<std::size_t> thread_hashes_;  // guarded by mu_; index = Event::thread
};

// Of the time the events named `span` of `step` took, the share that fell inside events named
// `within` of the same step (which must not overlap each other): e.g. how much of the gradients'
// device-to-host copies ran while backward still computed. 0 when there is no `span` event or it
// took no time.
double OverlapFraction(const std::vector<PhaseTrace::Event>& events, const std::string& span,
                       const std::string& within, uint64_t step);

// Where every phase's duration goes besides a trace, e.g. the gpu_trainer program's
// offload_trainer_phase_seconds histogram (gpu_trainer/train/trainer_metrics.h): the program sets
// it at start, so this layer needs no metrics of its own and a process that sets none (a front
// end's, a test's) pays one atomic load per phase. Thread-safe; nullptr (the default) observes
// nothing.
using PhaseObserver = void (*)(const char* phase, double seconds);
void SetPhaseObserver(PhaseObserver observer);

// Records [construction, destruction) as one event, and its duration with the phase observer; a
// null trace records only the observation.
class TracePhase {
 public:
  TracePhase(PhaseTrace* trace, const char* name, uint64_t step)
      : trace_(trace), name_(name), step_(step), begin_(PhaseTrace::Clock::now()) {}
  ~TracePhase();
  TracePhase(const TracePhase&) = delete;
  TracePhase& operator=(const TracePhase&) = delete;

 private:
  PhaseTrace* const trace_;
  const char* const name_;
  const uint64_t step_;
  const PhaseTrace::Clock::time_point begin_;
};

}  // namespace offload

#endif  // OFFLOAD_OPTIMIZER_CLIENT_SENDER_PHASE_TRACE_H_
