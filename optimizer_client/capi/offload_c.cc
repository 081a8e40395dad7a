// The C ABI's job and step (offload_c.h): every entry point validates its arguments, then calls
// the step engine the C++ trainer drives too (step_engine/step_engine.h). Statuses become a code
// plus a thread-local message, and nothing (exceptions included) crosses the boundary. Loads,
// reads and checkpoints are in offload_c_state.cc.
#include "optimizer_client/capi/offload_c.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "base/status_macros.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"
#include "model_spec/partition.h"
#include "optimizer_client/backends/inprocess_optimizer.h"
#include "optimizer_client/backends/remote_optimizer.h"
#include "optimizer_client/capi/capi_handle.h"

namespace offload {

namespace capi {

std::string& LastError() {
  thread_local std::string error;
  return error;
}

namespace {

absl::StatusOr<std::vector<v1::ParamGroup>> GroupsFromConfig(const OffloadConfig& c,
                                                             int64_t padded) {
  if (c.num_groups < 1 || c.num_groups > 64 || c.groups == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_groups is ", c.num_groups, "; a job has 1 to 64 parameter groups"));
  }
  std::vector<v1::ParamGroup> groups;
  uint64_t next = 0;
  for (int i = 0; i < c.num_groups; ++i) {
    const OffloadGroup& g = c.groups[i];
    if (g.offset != next || g.length == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter group ", i, " is [", g.offset, ", ", g.offset + g.length,
          "); groups must be non-empty and follow each other from element 0 (next is ", next, ")"));
    }
    if (g.kind != OFFLOAD_ADAM && g.kind != OFFLOAD_ADAMW) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter group ", i, ": kind ", g.kind, " is neither Adam nor AdamW"));
    }
    next = g.offset + g.length;
    v1::ParamGroup& p = groups.emplace_back();
    p.set_offset(g.offset);
    // The padding after the last parameter belongs to the last group.
    p.set_length(i + 1 == c.num_groups ? padded - static_cast<int64_t>(g.offset) : g.length);
    v1::AdamConfig* adam = p.mutable_adam();
    adam->set_kind(g.kind == OFFLOAD_ADAM ? v1::OPTIMIZER_KIND_ADAM : v1::OPTIMIZER_KIND_ADAMW);
    adam->set_lr(g.lr);
    adam->set_beta1(g.beta1);
    adam->set_beta2(g.beta2);
    adam->set_eps(g.eps);
    adam->set_weight_decay(g.weight_decay);
    // Unknown values are refused where the job is made (wire_convert), by name.
    adam->set_form(static_cast<v1::AdamForm>(c.adam_form));
  }
  if (next != c.num_params) {
    return absl::InvalidArgumentError(
        absl::StrCat("the parameter groups cover ", next, " of ", c.num_params, " parameters"));
  }
  return groups;
}

// The remote half of MakeBackend: the config's shards, connected.
absl::StatusOr<std::unique_ptr<OptimizerBackend>> MakeRemoteBackend(const OffloadConfig& c,
                                                                    const v1::PartitionMap& map,
                                                                    std::string* transport_names) {
  ClientOptions options;
  options.token = Str(c.token);
  options.tls.ca_file = Str(c.tls_ca);
  options.tls.cert_file = Str(c.tls_cert);
  options.tls.key_file = Str(c.tls_key);
  options.tls.server_name_override = Str(c.tls_server_name);
  if (c.call_timeout_seconds > 0) options.call_timeout = absl::Seconds(c.call_timeout_seconds);
  if (c.step_timeout_floor_seconds > 0) {
    options.step_timeout_floor = absl::Seconds(c.step_timeout_floor_seconds);
  }
  OFFLOAD_ASSIGN_OR_RETURN(TransportChoice transport,
                           ParseTransportChoice(c.transport == nullptr ? "auto" : c.transport));
  std::vector<std::string> addresses(c.shard_addresses, c.shard_addresses + c.num_shards);
  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<RemoteOptimizer> remote,
                           RemoteOptimizer::Connect(map, addresses, options, transport));
  *transport_names = remote->TransportNames();
  remote->SetStateTier(static_cast<v1::StateTier>(c.state_tier));
  return remote;
}

// The shards of the config (or the in-process engine), connected, not yet holding the job.
absl::StatusOr<std::unique_ptr<OptimizerBackend>> MakeBackend(const OffloadConfig& c,
                                                              const v1::PartitionMap& map,
                                                              std::string* transport_names) {
  if (c.state_tier < OFFLOAD_TIER_AUTO || c.state_tier > OFFLOAD_TIER_DISK) {
    return absl::InvalidArgumentError(
        absl::StrCat("state_tier ", c.state_tier, " is none of auto (0), memory (1), disk (2)"));
  }
  if (c.state_dtype != 0 && c.state_dtype != OFFLOAD_FP32 && c.state_dtype != OFFLOAD_BF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("state_dtype ", c.state_dtype, " is neither fp32 (1) nor bf16 (3)"));
  }
  if (c.state_rounding != OFFLOAD_ROUND_STOCHASTIC && c.state_rounding != OFFLOAD_ROUND_NEAREST) {
    return absl::InvalidArgumentError(absl::StrCat("state_rounding ", c.state_rounding,
                                                   " is neither stochastic (0) nor nearest (1)"));
  }
  std::unique_ptr<OptimizerBackend> backend;
  if (c.num_shards == 0) {
    if (c.state_tier == OFFLOAD_TIER_DISK) {
      return absl::InvalidArgumentError(
          "the in-process engine keeps its state in memory: the disk tier needs a server with "
          "--state_dir (a local one, or running servers)");
    }
    *transport_names = "inprocess";
    backend = std::make_unique<InProcessOptimizer>(map, c.threads, BestSimdPath());
  } else {
    OFFLOAD_ASSIGN_OR_RETURN(backend, MakeRemoteBackend(c, map, transport_names));
  }
  backend->SetStateStorage(c.state_dtype == OFFLOAD_BF16 ? v1::DTYPE_BF16 : v1::DTYPE_FP32,
                           static_cast<v1::StateRounding>(c.state_rounding));
  return backend;
}

absl::Status Create(const OffloadConfig* c, OffloadOptimizer** out) {
  if (out == nullptr || c == nullptr) return absl::InvalidArgumentError("null config or out");
  *out = nullptr;
  if (c->abi_version != OFFLOAD_C_ABI_VERSION) {
    return absl::InvalidArgumentError(absl::StrCat("the caller speaks ABI version ", c->abi_version,
                                                   " but this library ", OFFLOAD_C_ABI_VERSION));
  }
  if (c->dtype != OFFLOAD_FP16 && c->dtype != OFFLOAD_BF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype ", c->dtype, " is neither fp16 nor bf16"));
  }
  if (c->num_params == 0) return absl::InvalidArgumentError("num_params is 0");
  if (c->num_shards < 0 || (c->num_shards > 0 && c->shard_addresses == nullptr)) {
    return absl::InvalidArgumentError("num_shards < 0, or shard addresses missing");
  }
  for (int i = 0; i < c->num_shards; ++i) {
    if (c->shard_addresses[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("shard address ", i, " is null"));
    }
  }
  OFFLOAD_ASSIGN_OR_RETURN(v1::PartitionMap map,
                           MakePartitionMap(static_cast<int64_t>(c->num_params), c->world_size,
                                            std::max(1, c->num_shards)));
  OFFLOAD_ASSIGN_OR_RETURN(std::vector<v1::ParamGroup> groups,
                           GroupsFromConfig(*c, static_cast<int64_t>(map.padded_length())));

  auto opt = std::make_unique<OffloadOptimizer>();
  const DType dtype = c->dtype == OFFLOAD_FP16 ? DType::kFp16 : DType::kBf16;
  opt->num_groups = c->num_groups;
  OFFLOAD_ASSIGN_OR_RETURN(opt->backend, MakeBackend(*c, map, &opt->transport_names));
  OFFLOAD_RETURN_IF_ERROR(opt->backend->SetRank(c->rank));
  const std::string job_id = Str(c->job_id);
  if (c->create_job) {
    OFFLOAD_RETURN_IF_ERROR(opt->backend->CreateJob(job_id, groups[0].adam(), dtype, groups));
  } else {
    OFFLOAD_RETURN_IF_ERROR(ValidateJobId(job_id));
    opt->backend->UseJob(job_id, dtype);
  }
  opt->trace_file = Str(c->trace_file);
  if (!opt->trace_file.empty()) opt->trace = std::make_unique<PhaseTrace>();
  StepEngineOptions engine;
  engine.dtype = dtype;
  engine.policy.loss_scaling = dtype == DType::kFp16;
  if (c->loss_scale_init > 0) engine.policy.loss_scaler.init_scale = c->loss_scale_init;
  if (c->loss_scale_window > 0) engine.policy.loss_scaler.growth_interval = c->loss_scale_window;
  engine.policy.grad_clip = c->grad_clip;
  engine.trace = opt->trace.get();
  engine.measure_gradients = true;  // the front end hands over rounded gradients only
  OFFLOAD_ASSIGN_OR_RETURN(opt->engine, StepEngine::Create(opt->backend.get(), engine));
  *out = opt.release();
  return absl::OkStatus();
}

// One finite, non-negative lr per parameter group of the job.
absl::Status CheckGroupLrs(const OffloadOptimizer* opt, const double* group_lr,
                           int32_t num_groups) {
  if (group_lr == nullptr) return absl::InvalidArgumentError("null group_lr");
  if (num_groups != opt->num_groups) {
    return absl::InvalidArgumentError(absl::StrCat(num_groups, " learning rates for a job of ",
                                                   opt->num_groups, " parameter groups"));
  }
  for (int i = 0; i < num_groups; ++i) {
    if (!std::isfinite(group_lr[i]) || group_lr[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("the lr of parameter group ", i, " is ",
                                                     group_lr[i], "; it must be finite and >= 0"));
    }
  }
  return absl::OkStatus();
}

// An offset or length of the ABI's (uint64_t) as the engine's int64_t: past 2^62 is past any flat
// space, so the engine's own range checks refuse it, naming the range, without an overflow.
int64_t Flat(uint64_t v) { return static_cast<int64_t>(std::min<uint64_t>(v, uint64_t{1} << 62)); }

absl::StatusOr<std::vector<RangeStep>> RangeSteps(const OffloadRangeStep* ranges, int32_t n) {
  if (n < 0 || (n > 0 && ranges == nullptr)) {
    return absl::InvalidArgumentError("n < 0, or ranges missing");
  }
  std::vector<RangeStep> steps;
  for (int32_t i = 0; i < n; ++i) {
    const OffloadRangeStep& r = ranges[i];
    steps.push_back(RangeStep{Flat(r.offset), Flat(r.length), r.t});
  }
  return steps;
}

// The arguments every commit checks before the engine closes the step: a refused call changes
// nothing.
absl::Status CheckCommit(const OffloadOptimizer* opt, const double* group_lr, int32_t num_groups,
                         float max_grad_norm, const uint16_t* params16, const void* report) {
  if (!opt->engine->in_step())
    return absl::FailedPreconditionError("offload_commit outside a step");
  if (params16 == nullptr || report == nullptr || group_lr == nullptr) {
    return absl::InvalidArgumentError("null params16, report or group_lr");
  }
  OFFLOAD_RETURN_IF_ERROR(CheckGroupLrs(opt, group_lr, num_groups));
  if (std::isnan(max_grad_norm)) return absl::InvalidArgumentError("max_grad_norm is NaN");
  return absl::OkStatus();
}

// offload_commit's global_stats: the sum of squares and the overflow flag over every rank, or
// none (null: this rank's own).
std::optional<GradStats> GlobalStats(const double* global_stats) {
  if (global_stats == nullptr) return std::nullopt;
  return GradStats{global_stats[0], global_stats[1] > 0};
}

void FillReport(const OffloadOptimizer* opt, const StepDecision& d, const StepCounters& counters,
                OffloadStepReport* report) {
  *report = OffloadStepReport{};
  report->step = counters.completed_step;
  report->skipped = d.skip ? 1 : 0;
  report->loss_scale = d.loss_scale;
  report->next_loss_scale = opt->engine->policy().loss_scale();
  report->grad_norm = d.grad_norm;
  report->clip_coef = d.clip_coef;
  report->grad_multiplier = d.grad_multiplier;
  report->adam_step = counters.adam_step;
  report->skipped_steps = counters.completed_step - counters.adam_step;
  report->early_updated = counters.early_updated;
  report->early_rolled_back = counters.early_rolled_back;
}

}  // namespace
}  // namespace capi
}  // namespace offload

using offload::capi::Guard;
using offload::capi::Quietly;

extern "C" {

const char* offload_last_error(void) { return offload::capi::LastError().c_str(); }

int32_t offload_abi_version(void) { return OFFLOAD_C_ABI_VERSION; }

int32_t offload_create(const OffloadConfig* config, OffloadOptimizer** out) {
  return Guard([&] { return offload::capi::Create(config, out); });
}

void offload_destroy(OffloadOptimizer* opt) {
  if (opt == nullptr) return;
  Quietly([&] {
    opt->load.reset();
    opt->engine.reset();  // waits for a delayed commit, ends an open step
    if (opt->trace != nullptr) opt->trace->WriteChromeTrace(opt->trace_file).IgnoreError();
    delete opt;
  });
}

int32_t offload_drop_job(OffloadOptimizer* opt) {
  return Guard([&] {
    if (opt == nullptr) return absl::InvalidArgumentError("null optimizer");
    if (opt->engine->commit_in_flight()) opt->engine->WaitCommit().IgnoreError();
    opt->engine->AbortStep();
    return opt->backend->DropJob();
  });
}

uint64_t offload_padded_length(const OffloadOptimizer* opt) {
  return opt->backend->partition().padded_length();
}
uint64_t offload_partition_offset(const OffloadOptimizer* opt) {
  return opt->backend->partition_offset();
}
uint64_t offload_partition_length(const OffloadOptimizer* opt) {
  return opt->backend->partition_length();
}
const char* offload_transport_names(const OffloadOptimizer* opt) {
  return opt->transport_names.c_str();
}

int32_t offload_begin_step(OffloadOptimizer* opt, uint64_t step) {
  return Guard([&] { return opt->engine->BeginStep(step); });
}

int32_t offload_in_step(const OffloadOptimizer* opt) { return opt->engine->in_step() ? 1 : 0; }

uint16_t* offload_gradient_buffer(OffloadOptimizer* opt, uint64_t offset, uint64_t n) {
  uint16_t* buffer = nullptr;
  Guard([&] {
    OFFLOAD_RETURN_IF_ERROR(opt->engine->CheckGradientRange(offset, n));
    buffer = opt->engine->GradientBuffer(offset, n);
    return absl::OkStatus();
  });
  return buffer;
}

int32_t offload_gradients_ready(OffloadOptimizer* opt, uint64_t offset, uint64_t n,
                                const uint16_t* where) {
  return Guard([&] {
    OFFLOAD_RETURN_IF_ERROR(opt->engine->CheckGradientRange(offset, n));
    const uint16_t* buffer = opt->engine->GradientBuffer(offset, n);
    if (where != nullptr && where != buffer) {
      // Pieces written into different places (two shards' segments, or a segment and the
      // library's buffer) cannot leave as one range.
      return absl::InvalidArgumentError(absl::StrCat(
          "gradients [", offset, ", ", offset + n,
          ") were not written where "
          "offload_gradient_buffer puts that range: hand over each place's pieces separately"));
    }
    opt->engine->Enqueue(offset, n, buffer);
    return absl::OkStatus();
  });
}

int32_t offload_send_gradients_f32(OffloadOptimizer* opt, uint64_t offset, const float* grads,
                                   uint64_t n, float scale) {
  return Guard([&] {
    OFFLOAD_RETURN_IF_ERROR(opt->engine->CheckGradientRange(offset, n));
    if (grads == nullptr) return absl::InvalidArgumentError("null grads");
    opt->engine->RoundAndEnqueue(offset, grads, n, scale);
    return absl::OkStatus();
  });
}

int32_t offload_set_range_steps(OffloadOptimizer* opt, const OffloadRangeStep* ranges, int32_t n) {
  return Guard([&]() -> absl::Status {
    if (!opt->engine->in_step()) return absl::FailedPreconditionError("no step is open");
    OFFLOAD_ASSIGN_OR_RETURN(std::vector<offload::RangeStep> steps,
                             offload::capi::RangeSteps(ranges, n));
    return opt->engine->SetRangeSteps(std::move(steps));
  });
}

int32_t offload_speculate(OffloadOptimizer* opt, const double* group_lr, int32_t num_groups,
                          const OffloadRangeStep* ranges, int32_t n) {
  return Guard([&]() -> absl::Status {
    if (!opt->engine->in_step()) return absl::FailedPreconditionError("no step is open");
    OFFLOAD_RETURN_IF_ERROR(offload::capi::CheckGroupLrs(opt, group_lr, num_groups));
    OFFLOAD_ASSIGN_OR_RETURN(std::vector<offload::RangeStep> steps,
                             offload::capi::RangeSteps(ranges, n));
    return opt->engine->Speculate(std::vector<double>(group_lr, group_lr + num_groups),
                                  std::move(steps));
  });
}

int32_t offload_update_ready(OffloadOptimizer* opt, uint64_t offset, uint64_t n) {
  return Guard([&] {
    return opt->engine->UpdateReady(offload::capi::Flat(offset), offload::capi::Flat(n));
  });
}

int32_t offload_read_gradient_sum(OffloadOptimizer* opt, uint64_t offset, uint64_t n, float* out) {
  return Guard([&] { return opt->engine->ReadGradientSum(offset, n, out); });
}

int32_t offload_restore_gradient_sum(OffloadOptimizer* opt, const float* sums) {
  return Guard([&] { return opt->engine->RestoreGradientSum(sums); });
}

int32_t offload_next_micro_batch(OffloadOptimizer* opt) {
  return Guard([&] { return opt->engine->NextMicroBatch(); });
}

int32_t offload_local_stats(OffloadOptimizer* opt, double out[2]) {
  return Guard([&]() -> absl::Status {
    OFFLOAD_ASSIGN_OR_RETURN(const offload::GradStats stats, opt->engine->Drain());
    out[0] = stats.sum_squares;
    out[1] = stats.nonfinite ? 1.0 : 0.0;
    return absl::OkStatus();
  });
}

int32_t offload_commit(OffloadOptimizer* opt, const double* global_stats, const double* group_lr,
                       int32_t num_groups, float max_grad_norm, uint16_t* params16,
                       OffloadStepReport* report) {
  return Guard([&]() -> absl::Status {
    OFFLOAD_RETURN_IF_ERROR(
        offload::capi::CheckCommit(opt, group_lr, num_groups, max_grad_norm, params16, report));
    OFFLOAD_ASSIGN_OR_RETURN(
        const offload::CommitOutcome outcome,
        opt->engine->Commit(offload::capi::GlobalStats(global_stats), max_grad_norm, group_lr[0],
                            absl::MakeConstSpan(group_lr, num_groups),
                            params16 + opt->backend->partition_offset()));
    offload::capi::FillReport(opt, outcome.decision, outcome.counters, report);
    return absl::OkStatus();
  });
}

int32_t offload_commit_async(OffloadOptimizer* opt, const double* global_stats,
                             const double* group_lr, int32_t num_groups, float max_grad_norm,
                             uint16_t* params16, OffloadStepReport* report) {
  return Guard([&]() -> absl::Status {
    OFFLOAD_RETURN_IF_ERROR(
        offload::capi::CheckCommit(opt, group_lr, num_groups, max_grad_norm, params16, report));
    const uint64_t step = opt->engine->open_step();
    OFFLOAD_ASSIGN_OR_RETURN(
        const offload::StepDecision d,
        opt->engine->CommitAsync(offload::capi::GlobalStats(global_stats), max_grad_norm,
                                 group_lr[0], std::vector<double>(group_lr, group_lr + num_groups),
                                 params16 + opt->backend->partition_offset()));
    // The shards' counters are known at offload_wait_commit.
    offload::capi::FillReport(opt, d, offload::StepCounters{step, step}, report);
    report->adam_step = 0;
    report->skipped_steps = 0;
    return absl::OkStatus();
  });
}

int32_t offload_wait_commit(OffloadOptimizer* opt, OffloadStepReport* report) {
  return Guard([&]() -> absl::Status {
    OFFLOAD_ASSIGN_OR_RETURN(const offload::CommitOutcome outcome, opt->engine->WaitCommit());
    if (report != nullptr) {
      offload::capi::FillReport(opt, outcome.decision, outcome.counters, report);
    }
    return absl::OkStatus();
  });
}

int32_t offload_preview(OffloadOptimizer* opt, const double* global_stats, float max_grad_norm,
                        OffloadStepReport* report) {
  return Guard([&]() -> absl::Status {
    if (!opt->engine->in_step()) return absl::FailedPreconditionError("no step is open");
    if (report == nullptr) return absl::InvalidArgumentError("null report");
    OFFLOAD_ASSIGN_OR_RETURN(
        const offload::StepDecision d,
        opt->engine->Preview(offload::capi::GlobalStats(global_stats), max_grad_norm));
    *report = OffloadStepReport{};
    report->skipped = d.skip ? 1 : 0;
    report->loss_scale = d.loss_scale;
    report->next_loss_scale = d.loss_scale;
    report->grad_norm = d.grad_norm;
    report->clip_coef = d.clip_coef;
    report->grad_multiplier = d.grad_multiplier;
    return absl::OkStatus();
  });
}

void offload_abort_step(OffloadOptimizer* opt) {
  Quietly([&] { opt->engine->AbortStep(); });
}

}  // extern "C"
