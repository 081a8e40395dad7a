// The C ABI over OptimizerBackend and StepPolicy (offload_c.h). Every entry point validates, then
// calls the same C++ the trainer uses; statuses become a code plus a thread-local message, and
// nothing (exceptions included) crosses the boundary.
#include "optimizer_client/capi/offload_c.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "base/dtype.h"
#include "base/dtype_proto.h"
#include "base/host_buffer.h"
#include "base/status_macros.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"
#include "cpu_optimizer_server/shard/range_steps.h"
#include "model_spec/partition.h"
#include "optimizer_client/backends/inprocess_optimizer.h"
#include "optimizer_client/backends/remote_optimizer.h"
#include "optimizer_client/backends/state_load.h"
#include "optimizer_client/param_state/param_checkpoint.h"
#include "optimizer_client/precision/grad_stats.h"
#include "optimizer_client/precision/step_policy.h"
#include "optimizer_client/sender/gradient_sender.h"

struct OffloadOptimizer {
  std::unique_ptr<offload::OptimizerBackend> backend;
  std::unique_ptr<offload::StepPolicy> policy;
  offload::DType dtype = offload::DType::kBf16;
  int num_groups = 1;
  std::string transport_names;
  // Where gradients wait when the data plane has no place for them: (padded_length,) 16-bit,
  // only this rank's partition used. Mapped, not written: where the shared-memory plane takes the
  // gradients in place, its pages are never touched and cost no memory.
  offload::HostBuffer grads16_buffer;
  uint16_t* grads16 = nullptr;
  std::string trace_file;
  std::unique_ptr<offload::PhaseTrace> trace;       // null without a trace_file
  std::unique_ptr<offload::GradientSender> sender;  // after grads16 and trace: it uses them
  bool in_step = false;
  offload::GradStats step_stats;                // what the sender measured so far this step
  std::unique_ptr<offload::JobStateLoad> load;  // a streamed load between begin and finish
  // Gradient accumulation (offload_next_micro_batch). micro_batch: of the open step. The first
  // micro-batch's ranges as sent (where they still are when the second begins), and acc32: this
  // rank's fp32 sum of the micro-batches' 16-bit gradients, (partition_length,), which decides
  // the step. It mirrors the shards' accumulator, as the C++ trainer's AccumulatePartition
  // does, since the step's norm and overflow are of the sum; allocated at the first step that
  // has a second micro-batch (4 bytes a parameter of the partition, host memory).
  struct SentRange {
    uint64_t offset, n;
    const uint16_t* src;
  };
  int micro_batch = 0;
  std::mutex first_mu;                       // autograd's threads record sends
  std::vector<SentRange> first_micro_batch;  // guarded by first_mu
  offload::HostBuffer acc_buffer;
  // acc32's statistics, measured once after the last range added to it (a step may ask twice:
  // offload_local_stats, then the commit).
  offload::GradStats acc_stats;
  std::atomic<bool> acc_stats_stale{true};
  uint64_t open_step = 0;  // the step offload_begin_step opened
  // offload_set_range_steps's list for the open step's commit (global flat offsets).
  std::vector<offload::RangeStep> range_steps;
  // The update during backward (offload_speculate): whether the open step speculates, and the
  // range steps its early updates take their t from.
  bool speculating = false;
  std::vector<offload::RangeStep> speculative_steps;
  // The delayed parameter update: the shards' commit of a decided step, run by a thread of its
  // own between offload_commit_async and offload_wait_commit.
  std::future<absl::StatusOr<offload::StepCounters>> pending_commit;
  offload::StepDecision pending_decision;
};

namespace offload {

// The sender's phases (phase_trace.h) feed the trainer's Prometheus histograms in a gpu_trainer
// process (train/trainer_metrics.cc). A front end's process serves no /metrics, so the library
// takes the observations and drops them instead of linking the trainer's metric families.
void ObservePhaseSeconds(const char* /*phase*/, double /*seconds*/) {}

namespace {

thread_local std::string g_last_error;

int32_t Fail(const absl::Status& status) {
  g_last_error = std::string(status.message());
  return status.ok() ? 0 : static_cast<int32_t>(status.code());
}

// Runs fn, turning any exception (an allocation that fails, mostly) into INTERNAL.
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

std::string Str(const char* s) { return s == nullptr ? std::string() : std::string(s); }

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
  const std::string job_id = Str(c->job_id);
  const int shards = std::max(1, c->num_shards);
  absl::StatusOr<v1::PartitionMap> map =
      MakePartitionMap(static_cast<int64_t>(c->num_params), c->world_size, shards);
  if (!map.ok()) return map.status();
  const int64_t padded = static_cast<int64_t>(map->padded_length());
  absl::StatusOr<std::vector<v1::ParamGroup>> groups = GroupsFromConfig(*c, padded);
  if (!groups.ok()) return groups.status();

  auto opt = std::make_unique<OffloadOptimizer>();
  opt->dtype = c->dtype == OFFLOAD_FP16 ? DType::kFp16 : DType::kBf16;
  opt->num_groups = c->num_groups;
  if (c->state_tier < OFFLOAD_TIER_AUTO || c->state_tier > OFFLOAD_TIER_DISK) {
    return absl::InvalidArgumentError(
        absl::StrCat("state_tier ", c->state_tier, " is none of auto (0), memory (1), disk (2)"));
  }
  if (c->num_shards == 0) {
    if (c->state_tier == OFFLOAD_TIER_DISK) {
      return absl::InvalidArgumentError(
          "the in-process engine keeps its state in memory: the disk tier needs a server with "
          "--state_dir (a local one, or running servers)");
    }
    opt->backend = std::make_unique<InProcessOptimizer>(*map, c->threads, BestSimdPath());
    opt->transport_names = "inprocess";
  } else {
    ClientOptions options;
    options.token = Str(c->token);
    options.tls.ca_file = Str(c->tls_ca);
    options.tls.cert_file = Str(c->tls_cert);
    options.tls.key_file = Str(c->tls_key);
    options.tls.server_name_override = Str(c->tls_server_name);
    if (c->call_timeout_seconds > 0) options.call_timeout = absl::Seconds(c->call_timeout_seconds);
    absl::StatusOr<TransportChoice> transport =
        ParseTransportChoice(c->transport == nullptr ? "auto" : c->transport);
    if (!transport.ok()) return transport.status();
    std::vector<std::string> addresses;
    for (int i = 0; i < c->num_shards; ++i) addresses.push_back(Str(c->shard_addresses[i]));
    absl::StatusOr<std::unique_ptr<RemoteOptimizer>> remote =
        RemoteOptimizer::Connect(*map, addresses, options, *transport);
    if (!remote.ok()) return remote.status();
    opt->transport_names = (*remote)->TransportNames();
    (*remote)->SetStateTier(static_cast<v1::StateTier>(c->state_tier));
    opt->backend = std::move(*remote);
  }
  if (absl::Status s = opt->backend->SetRank(c->rank); !s.ok()) return s;
  if (c->create_job) {
    const v1::AdamConfig adam = (*groups)[0].adam();
    if (absl::Status s = opt->backend->CreateJob(job_id, adam, opt->dtype, *groups); !s.ok()) {
      return s;
    }
  } else {
    if (absl::Status s = ValidateJobId(job_id); !s.ok()) return s;
    opt->backend->UseJob(job_id, opt->dtype);
  }
  StepPolicyOptions policy;
  policy.loss_scaling = opt->dtype == DType::kFp16;
  if (c->loss_scale_init > 0) policy.loss_scaler.init_scale = c->loss_scale_init;
  if (c->loss_scale_window > 0) policy.loss_scaler.growth_interval = c->loss_scale_window;
  policy.grad_clip = c->grad_clip;
  opt->policy = std::make_unique<StepPolicy>(policy);
  absl::StatusOr<HostBuffer> grads16 = HostBuffer::Allocate(padded * sizeof(uint16_t));
  if (!grads16.ok()) return grads16.status();
  opt->grads16_buffer = std::move(*grads16);
  opt->grads16 = static_cast<uint16_t*>(opt->grads16_buffer.data());
  opt->trace_file = Str(c->trace_file);
  if (!opt->trace_file.empty()) opt->trace = std::make_unique<PhaseTrace>();
  opt->sender =
      std::make_unique<GradientSender>(opt->backend.get(), opt->grads16, opt->trace.get());
  opt->sender->MeasureAs(opt->dtype);
  *out = opt.release();
  return absl::OkStatus();
}

// What every gradient entry point checks first: an open step, and [offset, offset + n) inside
// this rank's partition.
absl::Status CheckGradientRange(const OffloadOptimizer* opt, uint64_t offset, uint64_t n) {
  if (!opt->in_step) return absl::FailedPreconditionError("no step is open");
  const uint64_t lo = opt->backend->partition_offset();
  const uint64_t hi = lo + opt->backend->partition_length();
  if (n > 0 && offset >= lo && offset <= hi && n <= hi - offset) return absl::OkStatus();
  return absl::OutOfRangeError(absl::StrCat("gradients [", offset, ", ", offset + n,
                                            ") are not inside this rank's partition"));
}

// Where [offset, offset + n) is written: the plane's place, else the library's buffer. After the
// first micro-batch always the buffer: the place still holds the first micro-batch's gradients,
// which a shard may not have folded into its accumulator yet.
uint16_t* GradientBuffer(OffloadOptimizer* opt, uint64_t offset, uint64_t n) {
  if (opt->micro_batch > 0) return opt->grads16 + offset;
  uint16_t* place =
      opt->backend->GradientPlace(static_cast<int64_t>(offset), static_cast<int64_t>(n));
  return place != nullptr ? place : opt->grads16 + offset;
}

// What may not run while a delayed commit is in flight: anything else on the shards.
absl::Status NoCommitInFlight(const OffloadOptimizer* opt) {
  if (!opt->pending_commit.valid()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "a delayed commit is in flight (offload_commit_async): offload_wait_commit first");
}

absl::Status LoadBegin(OffloadOptimizer* opt, const StepCounters* counters) {
  if (opt->in_step) return absl::FailedPreconditionError("a step is open");
  OFFLOAD_RETURN_IF_ERROR(NoCommitInFlight(opt));
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

absl::Status LoadFinish(OffloadOptimizer* opt) {
  if (opt->load == nullptr) return absl::FailedPreconditionError("no load is open");
  std::unique_ptr<JobStateLoad> load = std::move(opt->load);
  return load->Finish();
}

absl::Status ReadState(OffloadOptimizer* opt, int32_t tensor, uint64_t offset, uint64_t n,
                       float* out) {
  if (tensor != OFFLOAD_MASTER && tensor != OFFLOAD_EXP_AVG && tensor != OFFLOAD_EXP_AVG_SQ) {
    return absl::InvalidArgumentError(absl::StrCat("no state tensor ", tensor));
  }
  OFFLOAD_RETURN_IF_ERROR(NoCommitInFlight(opt));
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
    ConvertFromFloat(master.data(), static_cast<int64_t>(m), opt->dtype, out + done);
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

absl::Status ReadGradientSum(OffloadOptimizer* opt, uint64_t offset, uint64_t n, float* out);

absl::Status SaveCheckpoint(OffloadOptimizer* opt, const char* root,
                            const OffloadNamedTensor* tensors, int32_t num_tensors,
                            uint64_t completed, uint64_t adam, const char* front_end, int32_t keep,
                            char* dir_out, uint64_t dir_out_size) {
  if (root == nullptr || *root == 0) return absl::InvalidArgumentError("no checkpoint directory");
  OFFLOAD_RETURN_IF_ERROR(NoCommitInFlight(opt));
  if (adam > completed) {
    return absl::InvalidArgumentError(
        absl::StrCat("adam_step ", adam, " > completed_step ", completed));
  }
  OFFLOAD_ASSIGN_OR_RETURN(std::vector<NamedParam> params, NamedParams(tensors, num_tensors));
  ParamStateInfo info;
  info.counters = StepCounters{completed, adam};
  info.loss_scale = opt->policy->State();
  info.param_dtype = opt->dtype;
  info.front_end = Str(front_end);
  // Between two micro-batches: the step's gradient sum so far goes with the state, so that a
  // run that loads it can go on with the step (offload_read_checkpoint_gradient_sum).
  std::vector<float> grad_sum;
  if (opt->in_step) {
    const int64_t num_params = static_cast<int64_t>(opt->backend->partition().num_params());
    if (opt->backend->partition_length() !=
        static_cast<int64_t>(opt->backend->partition().padded_length())) {
      return absl::FailedPreconditionError(
          "a step is open on one of several ranks: each holds only its partition's gradients; "
          "finish the step first");
    }
    grad_sum.resize(static_cast<size_t>(num_params));
    OFFLOAD_RETURN_IF_ERROR(
        ReadGradientSum(opt, 0, static_cast<uint64_t>(num_params), grad_sum.data()));
    info.grad_sum = grad_sum.data();
  }
  OFFLOAD_ASSIGN_OR_RETURN(std::string dir,
                           SaveParamState(root, params, info, opt->backend.get(), keep));
  return CopyOut(dir, dir_out, dir_out_size);
}

absl::Status LoadCheckpoint(OffloadOptimizer* opt, const char* dir,
                            const OffloadNamedTensor* tensors, int32_t num_tensors) {
  if (dir == nullptr || *dir == 0) return absl::InvalidArgumentError("no checkpoint directory");
  if (opt->in_step) return absl::FailedPreconditionError("a step is open: finish it first");
  OFFLOAD_RETURN_IF_ERROR(NoCommitInFlight(opt));
  OFFLOAD_ASSIGN_OR_RETURN(std::vector<NamedParam> params, NamedParams(tensors, num_tensors));
  return LoadParamState(dir, params, opt->dtype, opt->backend.get()).status();
}

// Queues a range whose gradients are at src for the sender: added to the earlier micro-batches'
// after the first, and remembered for the fold while in the first.
void EnqueueGradients(OffloadOptimizer* opt, uint64_t offset, uint64_t n, const uint16_t* src,
                      const GradStats* known = nullptr) {
  const bool accumulate = opt->micro_batch > 0;
  if (accumulate) {
    opt->acc_stats_stale = true;
  } else {
    std::lock_guard<std::mutex> lock(opt->first_mu);
    opt->first_micro_batch.push_back({offset, n, src});
  }
  opt->sender->Enqueue(static_cast<int64_t>(offset), static_cast<int64_t>(n), accumulate, src,
                       accumulate ? nullptr : known);
}

float* Accumulator(OffloadOptimizer* opt) { return static_cast<float*>(opt->acc_buffer.data()); }

absl::Status TakeStats(OffloadOptimizer* opt) {
  absl::Status sent = opt->sender->Drain();
  opt->step_stats.Merge(opt->sender->TakeStats());
  if (sent.ok() && opt->micro_batch > 0) {
    // The step is decided on the sum, as the shards will apply it.
    if (opt->acc_stats_stale.exchange(false)) {
      opt->acc_stats = MeasureGradients32(Accumulator(opt), opt->backend->partition_length());
    }
    opt->step_stats = opt->acc_stats;
  }
  return sent;
}

// Back to one micro-batch for the next step.
void EndMicroBatches(OffloadOptimizer* opt) {
  if (opt->micro_batch > 0) opt->sender->AccumulateInto(nullptr, 0);
  opt->micro_batch = 0;
  opt->speculating = false;
  opt->speculative_steps.clear();
  std::lock_guard<std::mutex> lock(opt->first_mu);
  opt->first_micro_batch.clear();
}

void AbortStep(OffloadOptimizer* opt) {
  if (!opt->in_step) return;
  opt->sender->Drain().IgnoreError();
  opt->sender->TakeStats();
  opt->backend->AbortStep();
  EndMicroBatches(opt);
  opt->range_steps.clear();
  opt->in_step = false;
  opt->step_stats = GradStats{};
}

// acc32, (partition_length,) fp32, allocated at the first step that needs it.
absl::Status EnsureAccumulator(OffloadOptimizer* opt) {
  if (opt->acc_buffer.data() != nullptr) return absl::OkStatus();
  OFFLOAD_ASSIGN_OR_RETURN(opt->acc_buffer,
                           HostBuffer::Allocate(opt->backend->partition_length() * sizeof(float)));
  return absl::OkStatus();
}

// out (n,) = the first micro-batch's gradients of flat [offset, offset + n), added in fp32 onto
// zeros as the shards fold them (zeros where none was sent).
void FirstMicroBatchSum(OffloadOptimizer* opt, int64_t offset, int64_t n, float* out) {
  std::fill(out, out + n, 0.0f);
  std::lock_guard<std::mutex> lock(opt->first_mu);
  for (const OffloadOptimizer::SentRange& r : opt->first_micro_batch) {
    const int64_t lo = std::max<int64_t>(offset, static_cast<int64_t>(r.offset));
    const int64_t hi = std::min<int64_t>(offset + n, static_cast<int64_t>(r.offset + r.n));
    if (lo >= hi) continue;
    AddAsFloat(r.src + (lo - static_cast<int64_t>(r.offset)), opt->dtype, hi - lo,
               out + (lo - offset));
  }
}

absl::Status ReadGradientSum(OffloadOptimizer* opt, uint64_t offset, uint64_t n, float* out) {
  OFFLOAD_RETURN_IF_ERROR(CheckGradientRange(opt, offset, n));
  if (out == nullptr) return absl::InvalidArgumentError("null out");
  // Everything handed over is sent (and, after the first micro-batch, in acc32) first.
  if (absl::Status sent = opt->sender->Drain(); !sent.ok()) {
    AbortStep(opt);
    return sent;
  }
  opt->step_stats.Merge(opt->sender->TakeStats());
  if (opt->micro_batch == 0) {
    FirstMicroBatchSum(opt, static_cast<int64_t>(offset), static_cast<int64_t>(n), out);
  } else {
    const float* acc = Accumulator(opt) + (offset - opt->backend->partition_offset());
    std::copy(acc, acc + n, out);
  }
  return absl::OkStatus();
}

absl::Status RestoreGradientSum(OffloadOptimizer* opt, const float* sums) {
  if (!opt->in_step) return absl::FailedPreconditionError("no step is open");
  if (sums == nullptr) return absl::InvalidArgumentError("null sums");
  {
    std::lock_guard<std::mutex> lock(opt->first_mu);
    if (opt->micro_batch > 0 || !opt->first_micro_batch.empty()) {
      return absl::FailedPreconditionError(
          "gradients were handed over in this step already: restore a sum into a step just "
          "opened");
    }
  }
  OFFLOAD_RETURN_IF_ERROR(EnsureAccumulator(opt));
  const int64_t lo = opt->backend->partition_offset();
  const int64_t n = opt->backend->partition_length();
  float* acc = Accumulator(opt);  // (partition_length,)
  std::copy(sums, sums + n, acc);
  // To the shards as fp32 accumulate chunks, so their sum keeps every bit; in pieces of 4 MiB.
  constexpr int64_t kPiece = int64_t{1} << 20;
  for (int64_t done = 0; done < n; done += kPiece) {
    const int64_t m = std::min(kPiece, n - done);
    if (absl::Status s = opt->backend->SendGradients32(lo + done, acc + done, m); !s.ok()) {
      AbortStep(opt);
      return s;
    }
  }
  opt->micro_batch = 1;
  opt->speculating = false;
  opt->acc_stats_stale = true;
  opt->sender->AccumulateInto(acc, lo);
  return absl::OkStatus();
}

absl::Status NextMicroBatch(OffloadOptimizer* opt) {
  if (!opt->in_step) return absl::FailedPreconditionError("no step is open");
  if (absl::Status sent = opt->sender->Drain(); !sent.ok()) {
    AbortStep(opt);
    return sent;
  }
  opt->sender->TakeStats();  // the sum's statistics replace the first micro-batch's
  if (opt->micro_batch == 0) {
    if (absl::Status s = EnsureAccumulator(opt); !s.ok()) {
      AbortStep(opt);
      return s;
    }
    const int64_t lo = opt->backend->partition_offset();
    float* acc = Accumulator(opt);  // (partition_length,)
    FirstMicroBatchSum(opt, lo, opt->backend->partition_length(), acc);
    std::lock_guard<std::mutex> lock(opt->first_mu);
    opt->first_micro_batch.clear();
    opt->acc_stats_stale = true;
    opt->sender->AccumulateInto(acc, lo);
  }
  ++opt->micro_batch;
  // The shards restore what they updated early once the second micro-batch's gradients come.
  opt->speculating = false;
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

// Everything of a commit but the shards' part: the arguments checked, every gradient sent, the
// step decided by the policy and closed here, its range steps handed to *range_steps. On an
// error the step stays open (the caller aborts it) unless a send failed, which aborts it.
absl::StatusOr<StepDecision> DecideCommit(OffloadOptimizer* opt, const double* global_stats,
                                          const double* group_lr, int32_t num_groups,
                                          float max_grad_norm, uint16_t* params16,
                                          OffloadStepReport* report,
                                          std::vector<RangeStep>* range_steps) {
  if (!opt->in_step) return absl::FailedPreconditionError("offload_commit outside a step");
  if (params16 == nullptr || report == nullptr || group_lr == nullptr) {
    return absl::InvalidArgumentError("null params16, report or group_lr");
  }
  OFFLOAD_RETURN_IF_ERROR(CheckGroupLrs(opt, group_lr, num_groups));
  if (std::isnan(max_grad_norm)) return absl::InvalidArgumentError("max_grad_norm is NaN");
  if (absl::Status sent = TakeStats(opt); !sent.ok()) {
    AbortStep(opt);
    return sent;
  }
  const GradStats stats =
      global_stats != nullptr ? GradStats{global_stats[0], global_stats[1] > 0} : opt->step_stats;
  const StepDecision d = opt->policy->Decide(stats, max_grad_norm < 0 ? -1.0f : max_grad_norm);
  opt->in_step = false;
  opt->step_stats = GradStats{};
  EndMicroBatches(opt);
  *range_steps = std::move(opt->range_steps);
  opt->range_steps.clear();
  return d;
}

// offload_set_range_steps's list checked (sorted, non-empty, inside the flat space, t at most the
// open step) and in the library's form.
absl::StatusOr<std::vector<RangeStep>> ParseRangeSteps(const OffloadOptimizer* opt,
                                                       const OffloadRangeStep* ranges, int32_t n) {
  if (!opt->in_step) return absl::FailedPreconditionError("no step is open");
  if (n < 0 || (n > 0 && ranges == nullptr)) {
    return absl::InvalidArgumentError("n < 0, or ranges missing");
  }
  const uint64_t padded = static_cast<uint64_t>(opt->backend->partition().padded_length());
  std::vector<RangeStep> steps;
  uint64_t next = 0;
  for (int32_t i = 0; i < n; ++i) {
    const OffloadRangeStep& r = ranges[i];
    if (r.length == 0 || r.offset < next || r.offset > padded || r.length > padded - r.offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("range step ", i, " is [", r.offset, ", ", r.offset + r.length,
                       "); ranges must be non-empty, sorted, not overlapping and inside the ",
                       padded, " elements of the flat space"));
    }
    if (r.t > opt->open_step) {
      return absl::InvalidArgumentError(
          absl::StrCat("range step ", i, ": t ", r.t, " is past the open step ", opt->open_step));
    }
    next = r.offset + r.length;
    steps.push_back(RangeStep{static_cast<int64_t>(r.offset), static_cast<int64_t>(r.length), r.t});
  }
  return steps;
}

absl::Status SetRangeSteps(OffloadOptimizer* opt, const OffloadRangeStep* ranges, int32_t n) {
  OFFLOAD_ASSIGN_OR_RETURN(opt->range_steps, ParseRangeSteps(opt, ranges, n));
  return absl::OkStatus();
}

absl::Status Speculate(OffloadOptimizer* opt, const double* group_lr, int32_t num_groups,
                       const OffloadRangeStep* ranges, int32_t n) {
  if (!opt->in_step) return absl::FailedPreconditionError("no step is open");
  if (opt->micro_batch > 0) {
    return absl::FailedPreconditionError(
        "the step has a second micro-batch: its sum is not known before the commit");
  }
  OFFLOAD_RETURN_IF_ERROR(CheckGroupLrs(opt, group_lr, num_groups));
  OFFLOAD_ASSIGN_OR_RETURN(std::vector<RangeStep> steps, ParseRangeSteps(opt, ranges, n));
  // What the policy decides for a step with nothing to skip or clip (a zero norm clips nothing).
  const StepDecision clean = opt->policy->Decide(GradStats{});
  opt->sender->Speculate(std::vector<double>(group_lr, group_lr + num_groups),
                         clean.grad_multiplier);
  opt->speculative_steps = std::move(steps);
  opt->speculating = true;
  return absl::OkStatus();
}

absl::Status UpdateReady(OffloadOptimizer* opt, uint64_t offset, uint64_t n) {
  if (!opt->in_step) return absl::FailedPreconditionError("no step is open");
  const uint64_t padded = static_cast<uint64_t>(opt->backend->partition().padded_length());
  if (n == 0 || offset > padded || n > padded - offset) {
    return absl::OutOfRangeError(absl::StrCat(
        "[", offset, ", ", offset + n, ") is not inside the flat space of ", padded, " elements"));
  }
  if (!opt->speculating) return absl::OkStatus();
  const int64_t lo =
      std::max<int64_t>(static_cast<int64_t>(offset), opt->backend->partition_offset());
  const int64_t hi =
      std::min<int64_t>(static_cast<int64_t>(offset + n),
                        opt->backend->partition_offset() + opt->backend->partition_length());
  // Cut where the speculative range steps begin and end: each piece goes with its own t (0:
  // the range's next step), and a piece a range step skips is not updated at all.
  int64_t at = lo;
  for (const RangeStep& rs : ClipRangeSteps(opt->speculative_steps, lo, hi)) {
    if (rs.offset > at) opt->sender->EnqueueUpdate(at, rs.offset - at, 0);
    if (rs.t > 0) opt->sender->EnqueueUpdate(rs.offset, rs.length, rs.t);
    at = rs.offset + rs.length;
  }
  if (at < hi) opt->sender->EnqueueUpdate(at, hi - at, 0);
  return absl::OkStatus();
}

void FillReport(const OffloadOptimizer* opt, const StepDecision& d, const StepCounters& counters,
                OffloadStepReport* report) {
  report->step = counters.completed_step;
  report->skipped = d.skip ? 1 : 0;
  report->loss_scale = d.loss_scale;
  report->next_loss_scale = opt->policy->loss_scale();
  report->grad_norm = d.grad_norm;
  report->clip_coef = d.clip_coef;
  report->grad_multiplier = d.grad_multiplier;
  report->adam_step = counters.adam_step;
  report->skipped_steps = counters.completed_step - counters.adam_step;
  report->early_updated = counters.early_updated;
  report->early_rolled_back = counters.early_rolled_back;
}

absl::Status Commit(OffloadOptimizer* opt, const double* global_stats, const double* group_lr,
                    int32_t num_groups, float max_grad_norm, uint16_t* params16,
                    OffloadStepReport* report) {
  std::vector<RangeStep> range_steps;
  OFFLOAD_ASSIGN_OR_RETURN(const StepDecision d,
                           DecideCommit(opt, global_stats, group_lr, num_groups, max_grad_norm,
                                        params16, report, &range_steps));
  absl::StatusOr<StepCounters> counters;
  {
    TracePhase phase(opt->trace.get(), "commit", opt->open_step);
    counters = opt->backend->Commit(group_lr[0], d.grad_multiplier, d.skip,
                                    params16 + opt->backend->partition_offset(),
                                    absl::MakeConstSpan(group_lr, num_groups), range_steps);
  }
  if (!counters.ok()) return counters.status();
  opt->policy->Finish(d);
  FillReport(opt, d, *counters, report);
  return absl::OkStatus();
}

absl::Status CommitAsync(OffloadOptimizer* opt, const double* global_stats, const double* group_lr,
                         int32_t num_groups, float max_grad_norm, uint16_t* params16,
                         OffloadStepReport* report) {
  std::vector<RangeStep> range_steps;
  OFFLOAD_ASSIGN_OR_RETURN(const StepDecision d,
                           DecideCommit(opt, global_stats, group_lr, num_groups, max_grad_norm,
                                        params16, report, &range_steps));
  // The loss scale moves now: the next step's backward runs before this commit is done.
  opt->policy->Finish(d);
  const uint64_t step = opt->open_step;
  FillReport(opt, d, StepCounters{step, 0}, report);
  report->adam_step = 0;  // the shards' count is known at offload_wait_commit
  report->skipped_steps = 0;
  opt->pending_decision = d;
  opt->pending_commit = std::async(
      std::launch::async, [opt, d, lrs = std::vector<double>(group_lr, group_lr + num_groups),
                           out = params16 + opt->backend->partition_offset(), step,
                           range_steps = std::move(range_steps)] {
        // In the trace beside the next step's phases: what the delayed update overlaps.
        TracePhase phase(opt->trace.get(), "commit_delayed", step);
        return opt->backend->Commit(lrs[0], d.grad_multiplier, d.skip, out,
                                    absl::MakeConstSpan(lrs), range_steps);
      });
  return absl::OkStatus();
}

absl::Status WaitCommit(OffloadOptimizer* opt, OffloadStepReport* report) {
  if (!opt->pending_commit.valid()) {
    return absl::FailedPreconditionError("no delayed commit is in flight");
  }
  absl::StatusOr<StepCounters> counters = opt->pending_commit.get();
  if (!counters.ok()) return counters.status();
  if (report != nullptr) FillReport(opt, opt->pending_decision, *counters, report);
  return absl::OkStatus();
}

}  // namespace
}  // namespace offload

using offload::Guard;

extern "C" {

const char* offload_last_error(void) { return offload::g_last_error.c_str(); }

int32_t offload_abi_version(void) { return OFFLOAD_C_ABI_VERSION; }

int32_t offload_create(const OffloadConfig* config, OffloadOptimizer** out) {
  return Guard([&] { return offload::Create(config, out); });
}

void offload_destroy(OffloadOptimizer* opt) {
  if (opt == nullptr) return;
  try {
    opt->load.reset();
    if (opt->pending_commit.valid()) opt->pending_commit.wait();
    offload::AbortStep(opt);
    if (opt->trace != nullptr) opt->trace->WriteChromeTrace(opt->trace_file).IgnoreError();
    delete opt;
  } catch (...) {
  }
}

int32_t offload_drop_job(OffloadOptimizer* opt) {
  return Guard([&] {
    if (opt == nullptr) return absl::InvalidArgumentError("null optimizer");
    if (opt->pending_commit.valid()) opt->pending_commit.wait();
    offload::AbortStep(opt);
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

int32_t offload_load_begin(OffloadOptimizer* opt, int32_t with_counters, uint64_t completed_step,
                           uint64_t adam_step) {
  return Guard([&] {
    if (with_counters && adam_step > completed_step) {
      return absl::InvalidArgumentError(
          absl::StrCat("adam_step ", adam_step, " > completed_step ", completed_step));
    }
    const offload::StepCounters counters{completed_step, adam_step};
    return offload::LoadBegin(opt, with_counters ? &counters : nullptr);
  });
}

int32_t offload_load_chunk(OffloadOptimizer* opt, int32_t tensor, uint64_t offset, uint64_t n,
                           const float* values) {
  return Guard([&] { return offload::LoadChunk(opt, tensor, offset, n, values); });
}

int32_t offload_load_finish(OffloadOptimizer* opt) {
  return Guard([&] { return offload::LoadFinish(opt); });
}

void offload_load_abort(OffloadOptimizer* opt) {
  try {
    opt->load.reset();
  } catch (...) {
  }
}

int32_t offload_read_state(OffloadOptimizer* opt, int32_t tensor, uint64_t offset, uint64_t n,
                           float* out) {
  return Guard([&] { return offload::ReadState(opt, tensor, offset, n, out); });
}

int32_t offload_read_weights16(OffloadOptimizer* opt, uint64_t offset, uint64_t n, uint16_t* out) {
  return Guard([&] { return offload::ReadWeights16(opt, offset, n, out); });
}

int32_t offload_save_checkpoint(OffloadOptimizer* opt, const char* root,
                                const OffloadNamedTensor* tensors, int32_t num_tensors,
                                uint64_t completed_step, uint64_t adam_step, const char* front_end,
                                int32_t keep, char* dir_out, uint64_t dir_out_size) {
  return Guard([&] {
    return offload::SaveCheckpoint(opt, root, tensors, num_tensors, completed_step, adam_step,
                                   front_end, keep, dir_out, dir_out_size);
  });
}

int32_t offload_read_checkpoint_gradient_sum(const char* dir, const OffloadNamedTensor* tensors,
                                             int32_t num_tensors, uint64_t num_params, float* out) {
  return Guard([&]() -> absl::Status {
    if (dir == nullptr || *dir == 0) return absl::InvalidArgumentError("no checkpoint directory");
    if (out == nullptr) return absl::InvalidArgumentError("null out");
    OFFLOAD_ASSIGN_OR_RETURN(std::vector<offload::NamedParam> params,
                             offload::NamedParams(tensors, num_tensors));
    return offload::ReadParamGradSum(dir, params, static_cast<int64_t>(num_params), out);
  });
}

int32_t offload_find_checkpoint(const char* path, char* dir_out, uint64_t dir_out_size) {
  return Guard([&]() -> absl::Status {
    if (path == nullptr || *path == 0) return absl::InvalidArgumentError("no checkpoint path");
    OFFLOAD_ASSIGN_OR_RETURN(std::string dir, offload::FindParamState(path));
    return offload::CopyOut(dir, dir_out, dir_out_size);
  });
}

int32_t offload_check_checkpoint(const char* dir, const OffloadNamedTensor* tensors,
                                 int32_t num_tensors) {
  return Guard([&]() -> absl::Status {
    if (dir == nullptr || *dir == 0) return absl::InvalidArgumentError("no checkpoint directory");
    OFFLOAD_ASSIGN_OR_RETURN(std::vector<offload::NamedParam> params,
                             offload::NamedParams(tensors, num_tensors));
    return offload::CheckParamState(dir, params);
  });
}

int32_t offload_load_checkpoint(OffloadOptimizer* opt, const char* dir,
                                const OffloadNamedTensor* tensors, int32_t num_tensors) {
  return Guard([&] { return offload::LoadCheckpoint(opt, dir, tensors, num_tensors); });
}

float offload_loss_scale(const OffloadOptimizer* opt) { return opt->policy->loss_scale(); }

void offload_get_scaler(const OffloadOptimizer* opt, float* scale, uint32_t* clean_steps,
                        uint64_t* skipped_steps) {
  const offload::v1::LossScaleState s = opt->policy->State();
  *scale = s.scale();
  *clean_steps = s.clean_steps();
  *skipped_steps = s.skipped_steps();
}

int32_t offload_set_scaler(OffloadOptimizer* opt, float scale, uint32_t clean_steps,
                           uint64_t skipped_steps) {
  return Guard([&] {
    // The open step's gradients were computed with the current scale.
    if (opt->in_step) return absl::FailedPreconditionError("a step is open");
    OFFLOAD_RETURN_IF_ERROR(offload::NoCommitInFlight(opt));
    offload::v1::LossScaleState s;
    s.set_scale(scale);
    s.set_clean_steps(clean_steps);
    s.set_skipped_steps(skipped_steps);
    return opt->policy->Restore(s);
  });
}

int32_t offload_begin_step(OffloadOptimizer* opt, uint64_t step) {
  return Guard([&] {
    if (opt->in_step) return absl::FailedPreconditionError("a step is already open");
    if (step == 0) return absl::InvalidArgumentError("steps count from 1");
    OFFLOAD_RETURN_IF_ERROR(offload::NoCommitInFlight(opt));
    if (absl::Status s = opt->backend->BeginStep(step); !s.ok()) return s;
    opt->sender->set_step(step);
    offload::EndMicroBatches(opt);
    opt->range_steps.clear();
    opt->open_step = step;
    opt->in_step = true;
    opt->step_stats = offload::GradStats{};
    return absl::OkStatus();
  });
}

int32_t offload_in_step(const OffloadOptimizer* opt) { return opt->in_step ? 1 : 0; }

uint16_t* offload_gradient_buffer(OffloadOptimizer* opt, uint64_t offset, uint64_t n) {
  uint16_t* buffer = nullptr;
  Guard([&] {
    if (absl::Status s = offload::CheckGradientRange(opt, offset, n); !s.ok()) return s;
    buffer = offload::GradientBuffer(opt, offset, n);
    return absl::OkStatus();
  });
  return buffer;
}

int32_t offload_gradients_ready(OffloadOptimizer* opt, uint64_t offset, uint64_t n,
                                const uint16_t* where) {
  return Guard([&] {
    if (absl::Status s = offload::CheckGradientRange(opt, offset, n); !s.ok()) return s;
    const uint16_t* buffer = offload::GradientBuffer(opt, offset, n);
    if (where != nullptr && where != buffer) {
      // Pieces written into different places (two shards' segments, or a segment and the
      // library's buffer) cannot leave as one range.
      return absl::InvalidArgumentError(absl::StrCat(
          "gradients [", offset, ", ", offset + n,
          ") were not written where "
          "offload_gradient_buffer puts that range: hand over each place's pieces separately"));
    }
    offload::EnqueueGradients(opt, offset, n, buffer);
    return absl::OkStatus();
  });
}

int32_t offload_send_gradients_f32(OffloadOptimizer* opt, uint64_t offset, const float* grads,
                                   uint64_t n, float scale) {
  return Guard([&] {
    if (absl::Status s = offload::CheckGradientRange(opt, offset, n); !s.ok()) return s;
    if (grads == nullptr) return absl::InvalidArgumentError("null grads");
    uint16_t* buffer = offload::GradientBuffer(opt, offset, n);
    // The rounding pass measures what it writes: the sender need not read it again.
    const offload::GradStats stats =
        offload::RoundGradients(grads, static_cast<int64_t>(n), opt->dtype, buffer, scale);
    offload::EnqueueGradients(opt, offset, n, buffer, &stats);
    return absl::OkStatus();
  });
}

int32_t offload_set_range_steps(OffloadOptimizer* opt, const OffloadRangeStep* ranges, int32_t n) {
  return Guard([&] { return offload::SetRangeSteps(opt, ranges, n); });
}

int32_t offload_speculate(OffloadOptimizer* opt, const double* group_lr, int32_t num_groups,
                          const OffloadRangeStep* ranges, int32_t n) {
  return Guard([&] { return offload::Speculate(opt, group_lr, num_groups, ranges, n); });
}

int32_t offload_update_ready(OffloadOptimizer* opt, uint64_t offset, uint64_t n) {
  return Guard([&] { return offload::UpdateReady(opt, offset, n); });
}

int32_t offload_read_gradient_sum(OffloadOptimizer* opt, uint64_t offset, uint64_t n, float* out) {
  return Guard([&] { return offload::ReadGradientSum(opt, offset, n, out); });
}

int32_t offload_restore_gradient_sum(OffloadOptimizer* opt, const float* sums) {
  return Guard([&] { return offload::RestoreGradientSum(opt, sums); });
}

int32_t offload_next_micro_batch(OffloadOptimizer* opt) {
  return Guard([&] { return offload::NextMicroBatch(opt); });
}

int32_t offload_local_stats(OffloadOptimizer* opt, double out[2]) {
  return Guard([&] {
    if (!opt->in_step) return absl::FailedPreconditionError("no step is open");
    // A failed send dropped gradients: the step cannot be committed, and Drain reports an error
    // once, so the step ends here rather than fail later with a less telling error.
    if (absl::Status sent = offload::TakeStats(opt); !sent.ok()) {
      offload::AbortStep(opt);
      return sent;
    }
    out[0] = opt->step_stats.sum_squares;
    out[1] = opt->step_stats.nonfinite ? 1.0 : 0.0;
    return absl::OkStatus();
  });
}

int32_t offload_commit(OffloadOptimizer* opt, const double* global_stats, const double* group_lr,
                       int32_t num_groups, float max_grad_norm, uint16_t* params16,
                       OffloadStepReport* report) {
  return Guard([&] {
    return offload::Commit(opt, global_stats, group_lr, num_groups, max_grad_norm, params16,
                           report);
  });
}

int32_t offload_commit_async(OffloadOptimizer* opt, const double* global_stats,
                             const double* group_lr, int32_t num_groups, float max_grad_norm,
                             uint16_t* params16, OffloadStepReport* report) {
  return Guard([&] {
    return offload::CommitAsync(opt, global_stats, group_lr, num_groups, max_grad_norm, params16,
                                report);
  });
}

int32_t offload_wait_commit(OffloadOptimizer* opt, OffloadStepReport* report) {
  return Guard([&] { return offload::WaitCommit(opt, report); });
}

int32_t offload_preview(OffloadOptimizer* opt, const double* global_stats, float max_grad_norm,
                        OffloadStepReport* report) {
  return Guard([&] {
    if (!opt->in_step) return absl::FailedPreconditionError("no step is open");
    if (report == nullptr) return absl::InvalidArgumentError("null report");
    if (absl::Status sent = offload::TakeStats(opt); !sent.ok()) {
      offload::AbortStep(opt);  // as offload_local_stats
      return sent;
    }
    const offload::GradStats stats = global_stats != nullptr
                                         ? offload::GradStats{global_stats[0], global_stats[1] > 0}
                                         : opt->step_stats;
    const offload::StepDecision d =
        opt->policy->Decide(stats, max_grad_norm < 0 ? -1.0f : max_grad_norm);
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

void offload_trace_phase(OffloadOptimizer* opt, const char* name, uint64_t step, double begin,
                         double end) {
  if (opt->trace == nullptr || name == nullptr) return;
  // The trace writes names unescaped (phase_trace.cc): only plain names are taken.
  for (const char* c = name; *c != 0; ++c) {
    if (!std::isalnum(static_cast<unsigned char>(*c)) && *c != '_' && *c != '-' && *c != '.') {
      return;
    }
  }
  try {
    // steady_clock is CLOCK_MONOTONIC on Linux, the clock of Python's time.monotonic().
    using Clock = offload::PhaseTrace::Clock;
    auto at = [](double seconds) {
      return Clock::time_point(
          std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds)));
    };
    opt->trace->Record(name, step, at(begin), at(end));
  } catch (...) {
  }
}

int32_t offload_write_trace(OffloadOptimizer* opt) {
  return Guard([&] {
    if (opt->trace == nullptr) return absl::FailedPreconditionError("no trace_file was given");
    return opt->trace->WriteChromeTrace(opt->trace_file);
  });
}

void offload_abort_step(OffloadOptimizer* opt) {
  try {
    offload::AbortStep(opt);
  } catch (...) {
  }
}

}  // extern "C"
