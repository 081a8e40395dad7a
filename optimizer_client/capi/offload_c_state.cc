// The C ABI's state (offload_c.h): loads streamed in chunks, reads, the step policy's loss-scale
// state, checkpoints by parameter name (param_state/) and the phase trace. Each entry point
// validates, then calls the same C++ the trainer uses; no step logic lives here.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "base/status_macros.h"
#include "optimizer_client/capi/capi_handle.h"
#include "optimizer_client/capi/offload_c.h"

namespace offload::capi {
namespace {

// Loads, reads and checkpoints reach every shard: not while a step is open on this rank (where
// the caller says so) nor while a delayed commit runs.
absl::Status Quiet(const OffloadOptimizer* opt, bool step_too) {
  if (step_too && opt->engine->in_step()) {
    return absl::FailedPreconditionError("a step is open: finish it first");
  }
  return opt->engine->NoCommitInFlight();
}

absl::Status LoadBegin(OffloadOptimizer* opt, const StepCounters* counters) {
  if (opt->engine->in_step()) return absl::FailedPreconditionError("a step is open");
  OFFLOAD_RETURN_IF_ERROR(Quiet(opt, false));
  opt->load.reset();  // a load left open is dropped, nothing applied
  OFFLOAD_ASSIGN_OR_RETURN(opt->load, JobStateLoad::Begin(opt->backend.get(), counters));
  return absl::OkStatus();
}

absl::Status LoadChunk(OffloadOptimizer* opt, int32_t tensor, uint64_t offset, uint64_t n,
                       const float* values) {
  if (opt->load == nullptr) return absl::FailedPreconditionError("no load is open");
  if (n == 0) return absl::OkStatus();
  absl::Status s = opt->load->Add(static_cast<v1::StateTensor>(tensor),
                                  static_cast<int64_t>(offset), values, static_cast<int64_t>(n));
  if (!s.ok()) opt->load.reset();
  return s;
}

absl::Status ReadState(OffloadOptimizer* opt, int32_t tensor, uint64_t offset, uint64_t n,
                       float* out) {
  if (tensor != OFFLOAD_MASTER && tensor != OFFLOAD_EXP_AVG && tensor != OFFLOAD_EXP_AVG_SQ) {
    return absl::InvalidArgumentError(absl::StrCat("no state tensor ", tensor));
  }
  OFFLOAD_RETURN_IF_ERROR(Quiet(opt, false));
  return opt->backend->ReadRange(static_cast<v1::StateTensor>(tensor), static_cast<int64_t>(offset),
                                 static_cast<int64_t>(n), out);
}

absl::Status ReadWeights16(OffloadOptimizer* opt, uint64_t offset, uint64_t n, uint16_t* out) {
  if (out == nullptr) return absl::InvalidArgumentError("null out");
  constexpr uint64_t kChunk = uint64_t{1} << 20;
  std::vector<float> master(std::min(n, kChunk));  // (<= 1 Mi,) fp32, one chunk at a time
  for (uint64_t done = 0; done < n;) {
    const uint64_t m = std::min(n - done, kChunk);
    OFFLOAD_RETURN_IF_ERROR(ReadState(opt, OFFLOAD_MASTER, offset + done, m, master.data()));
    ConvertFromFloat(master.data(), static_cast<int64_t>(m), opt->engine->dtype(), out + done);
    done += m;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<NamedParam>> NamedParams(const OffloadNamedTensor* tensors,
                                                    int32_t num_tensors) {
  if (num_tensors < 0 || (num_tensors > 0 && tensors == nullptr)) {
    return absl::InvalidArgumentError("num_tensors < 0, or tensors missing");
  }
  std::vector<NamedParam> params;
  for (int32_t i = 0; i < num_tensors; ++i) {
    const OffloadNamedTensor& t = tensors[i];
    if (t.name == nullptr || t.ndim < 0 || t.ndim > 64 || (t.ndim > 0 && t.shape == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", i, ": no name, or ndim ", t.ndim, " without a shape"));
    }
    NamedParam& p = params.emplace_back();
    p.name = t.name;
    p.shape.assign(t.shape, t.shape + t.ndim);
    p.offset = static_cast<int64_t>(t.offset);
  }
  return params;
}

absl::Status CopyOut(const std::string& s, char* out, uint64_t size) {
  if (out == nullptr || size < s.size() + 1) {
    return absl::OutOfRangeError(
        absl::StrCat("an output of ", size, " bytes cannot hold ", s.size() + 1, ": ", s));
  }
  std::memcpy(out, s.c_str(), s.size() + 1);
  return absl::OkStatus();
}

absl::Status SaveCheckpoint(OffloadOptimizer* opt, const char* root,
                            const OffloadNamedTensor* tensors, int32_t num_tensors,
                            uint64_t completed, uint64_t adam, const char* front_end, int32_t keep,
                            char* dir_out, uint64_t dir_out_size) {
  if (root == nullptr || *root == 0) return absl::InvalidArgumentError("no checkpoint directory");
  OFFLOAD_RETURN_IF_ERROR(Quiet(opt, false));
  if (adam > completed) {
    return absl::InvalidArgumentError(
        absl::StrCat("adam_step ", adam, " > completed_step ", completed));
  }
  OFFLOAD_ASSIGN_OR_RETURN(std::vector<NamedParam> params, NamedParams(tensors, num_tensors));
  ParamStateInfo info;
  info.counters = StepCounters{completed, adam};
  info.loss_scale = opt->engine->policy().State();
  info.param_dtype = opt->engine->dtype();
  info.state_dtype = opt->backend->state_dtype();
  info.front_end = Str(front_end);
  // Between two micro-batches: the step's gradient sum so far goes with the state, so that a
  // run that loads it can go on with the step (offload_read_checkpoint_gradient_sum).
  std::vector<float> grad_sum;
  if (opt->engine->in_step()) {
    const int64_t num_params = static_cast<int64_t>(opt->backend->partition().num_params());
    if (opt->backend->partition_length() !=
        static_cast<int64_t>(opt->backend->partition().padded_length())) {
      return absl::FailedPreconditionError(
          "a step is open on one of several ranks: each holds only its partition's gradients; "
          "finish the step first");
    }
    grad_sum.resize(static_cast<size_t>(num_params));
    OFFLOAD_RETURN_IF_ERROR(opt->engine->ReadGradientSum(0, num_params, grad_sum.data()));
    info.grad_sum = grad_sum.data();
  }
  OFFLOAD_ASSIGN_OR_RETURN(std::string dir,
                           SaveParamState(root, params, info, opt->backend.get(), keep));
  return CopyOut(dir, dir_out, dir_out_size);
}

absl::Status LoadCheckpoint(OffloadOptimizer* opt, const char* dir,
                            const OffloadNamedTensor* tensors, int32_t num_tensors) {
  if (dir == nullptr || *dir == 0) return absl::InvalidArgumentError("no checkpoint directory");
  OFFLOAD_RETURN_IF_ERROR(Quiet(opt, true));
  OFFLOAD_ASSIGN_OR_RETURN(std::vector<NamedParam> params, NamedParams(tensors, num_tensors));
  return LoadParamState(dir, params, opt->engine->dtype(), opt->backend.get()).status();
}

}  // namespace
}  // namespace offload::capi

using offload::capi::Guard;
using offload::capi::Quietly;

extern "C" {

int32_t offload_load_begin(OffloadOptimizer* opt, int32_t with_counters, uint64_t completed_step,
                           uint64_t adam_step) {
  return Guard([&] {
    if (with_counters && adam_step > completed_step) {
      return absl::InvalidArgumentError(
          absl::StrCat("adam_step ", adam_step, " > completed_step ", completed_step));
    }
    const offload::StepCounters counters{completed_step, adam_step};
    return offload::capi::LoadBegin(opt, with_counters ? &counters : nullptr);
  });
}

int32_t offload_load_chunk(OffloadOptimizer* opt, int32_t tensor, uint64_t offset, uint64_t n,
                           const float* values) {
  return Guard([&] { return offload::capi::LoadChunk(opt, tensor, offset, n, values); });
}

int32_t offload_load_finish(OffloadOptimizer* opt) {
  return Guard([&] {
    if (opt->load == nullptr) return absl::FailedPreconditionError("no load is open");
    std::unique_ptr<offload::JobStateLoad> load = std::move(opt->load);
    return load->Finish();
  });
}

void offload_load_abort(OffloadOptimizer* opt) {
  Quietly([&] { opt->load.reset(); });
}

int32_t offload_read_state(OffloadOptimizer* opt, int32_t tensor, uint64_t offset, uint64_t n,
                           float* out) {
  return Guard([&] { return offload::capi::ReadState(opt, tensor, offset, n, out); });
}

int32_t offload_read_weights16(OffloadOptimizer* opt, uint64_t offset, uint64_t n, uint16_t* out) {
  return Guard([&] { return offload::capi::ReadWeights16(opt, offset, n, out); });
}

int32_t offload_save_checkpoint(OffloadOptimizer* opt, const char* root,
                                const OffloadNamedTensor* tensors, int32_t num_tensors,
                                uint64_t completed_step, uint64_t adam_step, const char* front_end,
                                int32_t keep, char* dir_out, uint64_t dir_out_size) {
  return Guard([&] {
    return offload::capi::SaveCheckpoint(opt, root, tensors, num_tensors, completed_step, adam_step,
                                         front_end, keep, dir_out, dir_out_size);
  });
}

int32_t offload_read_checkpoint_gradient_sum(const char* dir, const OffloadNamedTensor* tensors,
                                             int32_t num_tensors, uint64_t num_params, float* out) {
  return Guard([&]() -> absl::Status {
    if (dir == nullptr || *dir == 0) return absl::InvalidArgumentError("no checkpoint directory");
    if (out == nullptr) return absl::InvalidArgumentError("null out");
    OFFLOAD_ASSIGN_OR_RETURN(std::vector<offload::NamedParam> params,
                             offload::capi::NamedParams(tensors, num_tensors));
    return offload::ReadParamGradSum(dir, params, static_cast<int64_t>(num_params), out);
  });
}

int32_t offload_find_checkpoint(const char* path, char* dir_out, uint64_t dir_out_size) {
  return Guard([&]() -> absl::Status {
    if (path == nullptr || *path == 0) return absl::InvalidArgumentError("no checkpoint path");
    OFFLOAD_ASSIGN_OR_RETURN(std::string dir, offload::FindParamState(path));
    return offload::capi::CopyOut(dir, dir_out, dir_out_size);
  });
}

int32_t offload_check_checkpoint(const char* dir, const OffloadNamedTensor* tensors,
                                 int32_t num_tensors) {
  return Guard([&]() -> absl::Status {
    if (dir == nullptr || *dir == 0) return absl::InvalidArgumentError("no checkpoint directory");
    OFFLOAD_ASSIGN_OR_RETURN(std::vector<offload::NamedParam> params,
                             offload::capi::NamedParams(tensors, num_tensors));
    return offload::CheckParamState(dir, params);
  });
}

int32_t offload_load_checkpoint(OffloadOptimizer* opt, const char* dir,
                                const OffloadNamedTensor* tensors, int32_t num_tensors) {
  return Guard([&] { return offload::capi::LoadCheckpoint(opt, dir, tensors, num_tensors); });
}

float offload_loss_scale(const OffloadOptimizer* opt) { return opt->engine->policy().loss_scale(); }

void offload_get_scaler(const OffloadOptimizer* opt, float* scale, uint32_t* clean_steps,
                        uint64_t* skipped_steps) {
  const offload::v1::LossScaleState s = opt->engine->policy().State();
  *scale = s.scale();
  *clean_steps = s.clean_steps();
  *skipped_steps = s.skipped_steps();
}

int32_t offload_set_scaler(OffloadOptimizer* opt, float scale, uint32_t clean_steps,
                           uint64_t skipped_steps) {
  return Guard([&] {
    // The open step's gradients were computed with the current scale.
    if (opt->engine->in_step()) return absl::FailedPreconditionError("a step is open");
    OFFLOAD_RETURN_IF_ERROR(opt->engine->NoCommitInFlight());
    offload::v1::LossScaleState s;
    s.set_scale(scale);
    s.set_clean_steps(clean_steps);
    s.set_skipped_steps(skipped_steps);
    return opt->engine->policy().Restore(s);
  });
}

void offload_trace_phase(OffloadOptimizer* opt, const char* name, uint64_t step, double begin,
                         double end) {
  if (opt->trace == nullptr || name == nullptr) return;
  // The trace writes names unescaped (phase_trace.cc): only plain names are taken.
  for (const char* c = name; *c != 0; ++c) {
    if (!std::isalnum(static_cast<unsigned char>(*c)) && *c != '_' && *c != '-' && *c != '.') {
      return;
    }
  }
  Quietly([&] {
    // steady_clock is CLOCK_MONOTONIC on Linux, the clock of Python's time.monotonic().
    using Clock = offload::PhaseTrace::Clock;
    auto at = [](double seconds) {
      return Clock::time_point(
          std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds)));
    };
    opt->trace->Record(name, step, at(begin), at(end));
  });
}

int32_t offload_write_trace(OffloadOptimizer* opt) {
  return Guard([&] {
    if (opt->trace == nullptr) return absl::FailedPreconditionError("no trace_file was given");
    return opt->trace->WriteChromeTrace(opt->trace_file);
  });
}

}  // extern "C"
