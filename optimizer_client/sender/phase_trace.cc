#include "optimizer_client/sender/phase_trace.h"

#include <atomic>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "optimizer_client/checkpoint/atomic_file.h"

namespace offload {
namespace {

std::atomic<PhaseObserver> g_phase_observer{nullptr};

}  // namespace

void SetPhaseObserver(PhaseObserver observer) {
  g_phase_observer.store(observer, std::memory_order_release);
}

TracePhase::~TracePhase() {
  const PhaseTrace::Clock::time_point end = PhaseTrace::Clock::now();
  if (PhaseObserver observe = g_phase_observer.load(std::memory_order_acquire)) {
    observe(name_, std::chrono::duration<double>(end - begin_).count());
  }
  if (trace_ != nullptr) trace_->Record(name_, step_, begin_, end);
}

void PhaseTrace::Record(const std::string& name, uint64_t step, Clock::time_point begin,
                        Clock::time_point end) {
  const std::size_t hash = std::hash<std::thread::id>()(std::this_thread::get_id());
  auto us = [this](Clock::time_point t) {
    return std::chrono::duration<double, std::micro>(t - start_).count();
  };
  std::lock_guard<std::mutex> lock(mu_);
  int thread = 0;
  while (thread < static_cast<int>(thread_hashes_.size()) && thread_hashes_[thread] != hash) {
    ++thread;
  }
  if (thread == static_cast<int>(thread_hashes_.size())) thread_hashes_.push_back(hash);
  events_.push_back(Event{name, step, thread, us(begin), us(end)});
}

std::vector<PhaseTrace::Event> PhaseTrace::Events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_;
}

double OverlapFraction(const std::vector<PhaseTrace::Event>& events, const std::string& span,
                       const std::string& within, uint64_t step) {
  double total = 0, inside = 0;
  for (const PhaseTrace::Event& s : events) {
    if (s.name != span || s.step != step) continue;
    total += s.end_us - s.begin_us;
    for (const PhaseTrace::Event& w : events) {
      if (w.name != within || w.step != step) continue;
      inside += std::max(0.0, std::min(s.end_us, w.end_us) - std::max(s.begin_us, w.begin_us));
    }
  }
  return total > 0 ? inside / total : 0.0;
}

absl::Status PhaseTrace::WriteChromeTrace(const std::string& path) const {
  std::string json = "[\n";
  const std::vector<Event> events = Events();
  for (size_t i = 0; i < events.size(); ++i) {
    const Event& e = events[i];
    // Names are the trainer's own phase names: no characters JSON would need escaped.
    absl::StrAppend(&json, absl::StrFormat("{\"name\":\"%s\",\"ph\":\"X\",\"pid\":1,\"tid\":%d,"
                                           "\"ts\":%.3f,\"dur\":%.3f,\"args\":{\"step\":%d}}%s\n",
                                           e.name, e.thread, e.begin_us, e.end_us - e.begin_us,
                                           e.step, i + 1 < events.size() ? "," : ""));
  }
  json += "]\n";
  return WriteFileAtomic(path, json);
}

}  // namespace offload
