// What an OffloadOptimizer* of the C ABI (offload_c.h) holds, and how the ABI's files turn
// absl::Status into a code and a thread-local message. Internal to liboffload_c.so.
#ifndef OFFLOAD_OPTIMIZER_CLIENT_CAPI_CAPI_HANDLE_H_
#define OFFLOAD_OPTIMIZER_CLIENT_CAPI_CAPI_HANDLE_H_

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "optimizer_client/backends/optimizer_backend.h"
#include "optimizer_client/backends/state_load.h"
#include "optimizer_client/capi/offload_c.h"
#include "optimizer_client/param_state/param_checkpoint.h"
#include "optimizer_client/sender/phase_trace.h"
#include "optimizer_client/step_engine/step_engine.h"

struct OffloadOptimizer {
  std::unique_ptr<offload::OptimizerBackend> backend;
  std::unique_ptr<offload::PhaseTrace> trace;  // null without a trace_file
  std::string trace_file;
  std::unique_ptr<offload::StepEngine> engine;  // after backend and trace: it uses them
  int num_groups = 1;
  std::string transport_names;
  std::unique_ptr<offload::JobStateLoad> load;  // a streamed load between begin and finish
};

namespace offload::capi {

// The message of the calling thread's last failure (offload_last_error).
std::string& LastError();

inline int32_t Fail(const absl::Status& status) {
  LastError() = std::string(status.message());
  return status.ok() ? 0 : static_cast<int32_t>(status.code());
}

// Runs fn, turning any exception (an allocation that fails, mostly) into INTERNAL: nothing
// throws across the ABI.
template <typename Fn>
int32_t Guard(Fn&& fn) {
  try {
    return Fail(fn());
  } catch (const std::exception& e) {
    return Fail(absl::InternalError(absl::StrCat("offload_c: ", e.what())));
  } catch (...) {
    return Fail(absl::InternalError("offload_c: unknown exception"));
  }
}

// The same for calls that return nothing: failures are dropped.
template <typename Fn>
void Quietly(Fn&& fn) {
  try {
    fn();
  } catch (...) {
  }
}

inline std::string Str(const char* s) { return s == nullptr ? std::string() : std::string(s); }

}  // namespace offload::capi

#endif  // OFFLOAD_OPTIMIZER_CLIENT_CAPI_CAPI_HANDLE_H_
