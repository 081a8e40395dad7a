// The rules of a job's settings, in one place: gpu_trainer applies them to its own flags and the
// job controller to every job file.
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "jobs/spec/job_spec.h"
#include "jobs/spec/job_spec_internal.h"

namespace offload {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;
using job_spec_internal::Invalid;
using job_spec_internal::JoinPath;
using job_spec_internal::Quote;

// Every set float or double anywhere in the message must be finite.
absl::Status CheckFinite(const Message& message, const std::string& path) {
  const Descriptor* d = message.GetDescriptor();
  const Reflection* r = message.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    if (f->is_repeated()) continue;  // JobSpec has none; keep the walk simple
    if (!r->HasField(message, f)) continue;
    const std::string field_path = JoinPath(path, f->name());
    double v = 0;
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_MESSAGE:
        OFFLOAD_RETURN_IF_ERROR(CheckFinite(r->GetMessage(message, f), field_path));
        continue;
      case FieldDescriptor::CPPTYPE_FLOAT:
        v = r->GetFloat(message, f);
        break;
      case FieldDescriptor::CPPTYPE_DOUBLE:
        v = r->GetDouble(message, f);
        break;
      default:
        continue;
    }
    if (!std::isfinite(v)) {
      return Invalid(field_path, absl::StrCat("must be a finite number, got ", v));
    }
  }
  return absl::OkStatus();
}

absl::Status OneOf(absl::string_view path, const std::string& value,
                   std::initializer_list<absl::string_view> allowed) {
  for (absl::string_view a : allowed) {
    if (value == a) return absl::OkStatus();
  }
  return Invalid(
      path, absl::StrCat("must be one of ", absl::StrJoin(allowed, ", "), ", got ", Quote(value)));
}

template <typename T>
absl::Status AtLeast(absl::string_view path, T value, T min) {
  if (value >= min) return absl::OkStatus();
  return Invalid(path, absl::StrCat("must be >= ", min, ", got ", value));
}

template <typename T>
absl::Status Positive(absl::string_view path, T value) {
  if (value > 0) return absl::OkStatus();
  return Invalid(path, absl::StrCat("must be > 0, got ", value));
}

template <typename T>
absl::Status InRange(absl::string_view path, T value, T lo, T hi, absl::string_view range) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return Invalid(path, absl::StrCat("must be in ", range, ", got ", value));
}

absl::Status CheckPath(absl::string_view path, const std::string& value, PathRule rule) {
  if (rule == PathRule::kAsGiven || value.empty() || value[0] == '/') return absl::OkStatus();
  return Invalid(path, absl::StrCat("must be an absolute path (the workers run elsewhere), got ",
                                    Quote(value)));
}

absl::Status ValidateName(const std::string& name) {
  constexpr size_t kMaxName = 128;
  if (name.size() > kMaxName) {
    return Invalid("name", absl::StrCat("at most ", kMaxName, " characters, got ", name.size()));
  }
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    if (absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-' || c == ' ') continue;
    return Invalid(
        "name", absl::StrCat("character ", Quote(absl::string_view(&name[i], 1)), " at position ",
                             i, " is not allowed (use A-Z a-z 0-9 . _ - and space)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateModel(const v1::ModelSpec& m, PathRule paths) {
  absl::Status s;
  if (m.has_preset()) {
    s.Update(OneOf("model.preset", m.preset(),
                   {"demo", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"}));
  }
  if (s.ok() && m.has_layers()) s.Update(Positive("model.layers", m.layers()));
  if (s.ok() && m.has_heads()) s.Update(Positive("model.heads", m.heads()));
  if (s.ok() && m.has_channels()) s.Update(Positive("model.channels", m.channels()));
  if (s.ok() && m.has_context()) s.Update(Positive("model.context", m.context()));
  if (s.ok() && m.has_vocab()) s.Update(Positive("model.vocab", m.vocab()));
  if (s.ok() && m.has_channels() && m.has_heads() && m.channels() % m.heads() != 0) {
    return Invalid("model.channels",
                   absl::StrCat(m.channels(), " is not divisible by model.heads ", m.heads()));
  }
  if (s.ok() && m.has_init_from()) s.Update(CheckPath("model.init_from", m.init_from(), paths));
  return s;
}

absl::Status ValidateData(const v1::DataSpec& d, PathRule paths) {
  // A job names its data; a trainer's flags may leave the default.
  if ((!d.has_path() && paths == PathRule::kAbsolute) || (d.has_path() && d.path().empty())) {
    return Invalid("data.path", paths == PathRule::kAbsolute
                                    ? "required: an absolute path the trainer workers can read"
                                    : "required: the text or token shards to train on");
  }
  OFFLOAD_RETURN_IF_ERROR(CheckPath("data.path", d.path(), paths));
  if (d.has_val_fraction() && !(d.val_fraction() > 0 && d.val_fraction() < 1)) {
    return Invalid("data.val_fraction", absl::StrCat("must be in (0, 1), got ", d.val_fraction()));
  }
  return absl::OkStatus();
}

absl::Status ValidateOptimizer(const v1::OptimizerSpec& o) {
  absl::Status s;
  if (o.has_algorithm()) s.Update(OneOf("optimizer.algorithm", o.algorithm(), {"adamw", "adam"}));
  if (s.ok() && o.has_lr()) s.Update(Positive("optimizer.lr", o.lr()));
  if (s.ok() && o.has_min_lr()) s.Update(AtLeast("optimizer.min_lr", o.min_lr(), 0.0f));
  if (s.ok() && o.has_lr() && o.has_min_lr() && o.min_lr() > o.lr()) {
    return Invalid("optimizer.min_lr",
                   absl::StrCat("must be <= optimizer.lr ", o.lr(), ", got ", o.min_lr()));
  }
  if (s.ok() && o.has_warmup_steps()) {
    s.Update(AtLeast("optimizer.warmup_steps", o.warmup_steps(), 0));
  }
  if (s.ok() && o.has_beta1() && !(o.beta1() >= 0 && o.beta1() < 1)) {
    return Invalid("optimizer.beta1", absl::StrCat("must be in [0, 1), got ", o.beta1()));
  }
  if (s.ok() && o.has_beta2() && !(o.beta2() >= 0 && o.beta2() < 1)) {
    return Invalid("optimizer.beta2", absl::StrCat("must be in [0, 1), got ", o.beta2()));
  }
  if (s.ok() && o.has_eps()) s.Update(Positive("optimizer.eps", o.eps()));
  if (s.ok() && o.has_weight_decay()) {
    s.Update(AtLeast("optimizer.weight_decay", o.weight_decay(), 0.0f));
  }
  if (s.ok() && o.has_grad_clip()) s.Update(AtLeast("optimizer.grad_clip", o.grad_clip(), 0.0f));
  return s;
}

absl::Status ValidateTraining(const v1::TrainingSpec& t, const v1::ParallelSpec& p) {
  absl::Status s;
  if (t.has_steps()) s.Update(AtLeast("training.steps", t.steps(), int64_t{1}));
  if (s.ok() && t.has_batch()) s.Update(AtLeast("training.batch", t.batch(), 1));
  if (s.ok() && t.has_micro_batches()) {
    s.Update(AtLeast("training.micro_batches", t.micro_batches(), 1));
  }
  if (!s.ok()) return s;
  if (t.has_batch()) {
    // gpu_trainer's defaults: one rank, one micro-batch.
    const int64_t ranks = p.has_ranks() ? p.ranks() : 1;
    const int64_t micro = t.has_micro_batches() ? t.micro_batches() : 1;
    if (ranks >= 1 && t.batch() % (ranks * micro) != 0) {
      return Invalid("training.batch", absl::StrCat(t.batch(),
                                                    " is not divisible by parallel.ranks x "
                                                    "training.micro_batches = ",
                                                    ranks, " x ", micro));
    }
  }
  if (t.has_seq_len()) s.Update(AtLeast("training.seq_len", t.seq_len(), 1));
  if (s.ok() && t.has_dtype()) s.Update(OneOf("training.dtype", t.dtype(), {"fp16", "bf16"}));
  if (s.ok() && t.has_loss_scale()) {
    s.Update(AtLeast("training.loss_scale", t.loss_scale(), 1.0f));
  }
  if (s.ok() && t.has_loss_scale_window()) {
    s.Update(AtLeast("training.loss_scale_window", t.loss_scale_window(), 1));
  }
  if (s.ok() && t.has_device()) s.Update(OneOf("training.device", t.device(), {"cpu", "cuda"}));
  if (s.ok() && p.collectives() == "nccl" && t.device() != "cuda") {
    return Invalid("parallel.collectives",
                   "nccl needs training.device cuda: NCCL reduces GPU buffers; the CPU backend's "
                   "ranks meet over gloo");
  }
  if (s.ok() && t.has_kernels()) {
    s.Update(OneOf("training.kernels", t.kernels(), {"fast", "naive"}));
  }
  if (s.ok() && t.has_pinned_staging_mb()) {
    // Two chunks, one per direction: gpu_trainer's own lower bound.
    s.Update(AtLeast("training.pinned_staging_mb", t.pinned_staging_mb(), int64_t{2}));
  }
  return s;
}

absl::Status ValidateParallel(const v1::ParallelSpec& p) {
  absl::Status s;
  if (p.has_ranks()) s.Update(InRange("parallel.ranks", p.ranks(), 1u, 1024u, "[1, 1024]"));
  if (s.ok() && p.has_optimizer_servers()) {
    s.Update(InRange("parallel.optimizer_servers", p.optimizer_servers(), 1u, 1024u, "[1, 1024]"));
  }
  if (s.ok() && p.has_transport()) {
    s.Update(OneOf("parallel.transport", p.transport(), {"auto", "grpc", "shm", "ucx"}));
  }
  if (s.ok() && p.has_optimizer_state()) {
    s.Update(OneOf("parallel.optimizer_state", p.optimizer_state(), {"auto", "memory", "disk"}));
  }
  if (s.ok() && p.has_collectives()) {
    s.Update(OneOf("parallel.collectives", p.collectives(), {"gloo", "nccl"}));
  }
  if (s.ok() && p.has_shard_step_timeout_floor()) {
    s.Update(ShardStepTimeoutFloor(p).status());
  }
  if (s.ok() && p.has_dpu_warmup_steps()) {
    s.Update(AtLeast("parallel.dpu_warmup_steps", p.dpu_warmup_steps(), int64_t{0}));
  }
  if (s.ok() && p.has_bucket_mb() && !(p.bucket_mb() > 0 && p.bucket_mb() <= 4096)) {
    return Invalid("parallel.bucket_mb", absl::StrCat("must be in (0, 4096], got ", p.bucket_mb()));
  }
  if (s.ok() && p.has_zero_stage())
    s.Update(InRange("parallel.zero_stage", p.zero_stage(), 2, 3, "{2, 3}"));
  if (s.ok() && p.has_param_window_layers()) {
    s.Update(AtLeast("parallel.param_window_layers", p.param_window_layers(), 1));
  }
  if (s.ok() && p.zero_stage() == 3 && p.dpu()) {
    return Invalid("parallel.dpu",
                   "does not work with parallel.zero_stage 3 yet (see the README); use stage 2");
  }
  if (s.ok() && p.has_param_window_layers() && p.zero_stage() != 3) {
    return Invalid("parallel.param_window_layers", "needs parallel.zero_stage 3");
  }
  return s;
}

absl::Status ValidateCheckpoint(const v1::CheckpointSpec& c, PathRule paths) {
  absl::Status s;
  if (c.has_dir()) s.Update(CheckPath("checkpoint.dir", c.dir(), paths));
  if (s.ok() && c.has_every()) s.Update(AtLeast("checkpoint.every", c.every(), 0));
  // At least one checkpoint stays: 0 would otherwise be refused only at the first checkpoint.
  if (s.ok() && c.has_keep()) s.Update(AtLeast("checkpoint.keep", c.keep(), 1));
  if (s.ok() && c.resume() && c.dir().empty()) {
    return Invalid("checkpoint.resume", "needs checkpoint.dir (where to resume from)");
  }
  return s;
}

absl::Status ValidateEval(const v1::EvalSpec& e) {
  absl::Status s;
  if (e.has_every()) s.Update(AtLeast("eval.every", e.every(), 0));
  if (s.ok() && e.has_batches()) s.Update(AtLeast("eval.batches", e.batches(), 0));
  if (s.ok() && e.has_sample_tokens()) {
    s.Update(AtLeast("eval.sample_tokens", e.sample_tokens(), 0));
  }
  return s;
}

// The first set field anywhere under `message` ("model.layers"), or "" when none is set: what a
// torch job must leave to its script.
std::string FirstSetField(const Message& message, const std::string& path) {
  const Descriptor* d = message.GetDescriptor();
  const Reflection* r = message.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    const std::string field_path = JoinPath(path, f->name());
    if (f->is_repeated()) {
      if (r->FieldSize(message, f) > 0) return field_path;
      continue;
    }
    if (!r->HasField(message, f)) continue;
    if (f->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE) return field_path;
    std::string inner = FirstSetField(r->GetMessage(message, f), field_path);
    if (!inner.empty()) return inner;
  }
  return "";
}

absl::Status NoNul(absl::string_view path, absl::string_view value) {
  if (value.find('\0') == absl::string_view::npos) return absl::OkStatus();
  return Invalid(path, "holds a NUL character, which no command line or environment can carry");
}

absl::Status ValidateTorch(const v1::JobSpec& spec) {
  const v1::TorchSpec& t = spec.torch();
  constexpr int kMaxItems = 1024;
  constexpr size_t kMaxItemBytes = 64 << 10;
  if (t.command().empty() || t.command(0).empty()) {
    return Invalid("torch.command",
                   "required: the program and its arguments, e.g. [\"python3\", "
                   "\"/data/train.py\"]");
  }
  if (t.command_size() > kMaxItems || t.env_size() > kMaxItems) {
    return Invalid(t.command_size() > kMaxItems ? "torch.command" : "torch.env",
                   absl::StrCat("at most ", kMaxItems, " entries"));
  }
  for (int i = 0; i < t.command_size(); ++i) {
    const std::string path = absl::StrCat("torch.command[", i, "]");
    OFFLOAD_RETURN_IF_ERROR(NoNul(path, t.command(i)));
    if (t.command(i).size() > kMaxItemBytes) {
      return Invalid(path, absl::StrCat("at most ", kMaxItemBytes, " bytes"));
    }
  }
  OFFLOAD_RETURN_IF_ERROR(NoNul("torch.working_dir", t.working_dir()));
  OFFLOAD_RETURN_IF_ERROR(CheckPath("torch.working_dir", t.working_dir(), PathRule::kAbsolute));
  for (int i = 0; i < t.env_size(); ++i) {
    const std::string path = absl::StrCat("torch.env[", i, "]");
    const std::string& entry = t.env(i);
    OFFLOAD_RETURN_IF_ERROR(NoNul(path, entry));
    if (entry.size() > kMaxItemBytes) {
      return Invalid(path, absl::StrCat("at most ", kMaxItemBytes, " bytes"));
    }
    const size_t eq = entry.find('=');
    const absl::string_view name = absl::string_view(entry).substr(0, eq);
    bool valid = eq != std::string::npos && !name.empty() && !absl::ascii_isdigit(name[0]);
    for (char c : name) valid = valid && (absl::ascii_isalnum(c) || c == '_');
    if (!valid) {
      return Invalid(path, absl::StrCat("must be NAME=value with a NAME of A-Z a-z 0-9 _ (not "
                                        "starting with a digit), got ",
                                        Quote(entry)));
    }
    for (absl::string_view reserved : TorchJobVariables()) {
      if (name == reserved) {
        return Invalid(path, absl::StrCat(name, " is the job's own (its worker sets it)"));
      }
    }
  }
  // What the script decides for itself, and what only gpu_trainer reads.
  const std::pair<const Message*, const char*> scripts_own[] = {{&spec.model(), "model"},
                                                                {&spec.data(), "data"},
                                                                {&spec.optimizer(), "optimizer"},
                                                                {&spec.training(), "training"},
                                                                {&spec.eval(), "eval"}};
  for (const auto& [section, name] : scripts_own) {
    const std::string set = FirstSetField(*section, name);
    if (!set.empty()) {
      return Invalid(set,
                     "a torch job's script sets its own model, data, optimizer, training and "
                     "eval: leave this out of the job and give it to the script "
                     "(torch.command, torch.env)");
    }
  }
  v1::ParallelSpec parallel = spec.parallel();
  parallel.clear_ranks();
  parallel.clear_optimizer_servers();
  parallel.clear_transport();
  parallel.clear_shard_step_timeout_floor();
  if (const std::string set = FirstSetField(parallel, "parallel"); !set.empty()) {
    return Invalid(set,
                   "a torch job takes parallel.ranks, optimizer_servers, transport and "
                   "shard_step_timeout_floor only; "
                   "the script chooses the rest (offload.torch.AdamW's arguments)");
  }
  v1::CheckpointSpec checkpoint = spec.checkpoint();
  checkpoint.clear_dir();
  if (const std::string set = FirstSetField(checkpoint, "checkpoint"); !set.empty()) {
    return Invalid(set,
                   "a torch job takes checkpoint.dir only; the script decides when to save "
                   "(opt.save_checkpoint()) and whether to resume (opt.load_checkpoint())");
  }
  OFFLOAD_RETURN_IF_ERROR(ValidateParallel(spec.parallel()));
  return ValidateCheckpoint(spec.checkpoint(), PathRule::kAbsolute);
}

}  // namespace

absl::StatusOr<absl::Duration> ShardStepTimeoutFloor(const v1::ParallelSpec& parallel) {
  if (!parallel.has_shard_step_timeout_floor()) return absl::Seconds(60);
  absl::Duration floor;
  if (!absl::ParseDuration(parallel.shard_step_timeout_floor(), &floor) ||
      floor <= absl::ZeroDuration() || floor > absl::Hours(1)) {
    return Invalid("parallel.shard_step_timeout_floor",
                   absl::StrCat("must be a duration in (0, 1h] such as 30s or 2m, got \"",
                                parallel.shard_step_timeout_floor(), "\""));
  }
  return floor;
}

absl::Span<const absl::string_view> TorchJobVariables() {
  static constexpr absl::string_view kNames[] = {"OFFLOAD_SERVERS",
                                                 "OFFLOAD_TOKEN",
                                                 "OFFLOAD_SHARD_TOKEN",
                                                 "OFFLOAD_JOB_ID",
                                                 "OFFLOAD_CHECKPOINT_DIR",
                                                 "OFFLOAD_TRANSPORT",
                                                 "OFFLOAD_STEP_TIMEOUT_FLOOR",
                                                 "OFFLOAD_CONTROL_DIR",
                                                 "OFFLOAD_TLS_CA",
                                                 "OFFLOAD_TLS_CERT",
                                                 "OFFLOAD_TLS_KEY",
                                                 "OFFLOAD_TLS_SERVER_NAME",
                                                 "MASTER_ADDR",
                                                 "MASTER_PORT",
                                                 "RANK",
                                                 "WORLD_SIZE",
                                                 "LOCAL_RANK",
                                                 "LOCAL_WORLD_SIZE"};
  return kNames;
}

absl::Status ValidateSettings(const v1::JobSpec& spec, PathRule paths) {
  OFFLOAD_RETURN_IF_ERROR(CheckFinite(spec, ""));
  OFFLOAD_RETURN_IF_ERROR(ValidateModel(spec.model(), paths));
  OFFLOAD_RETURN_IF_ERROR(ValidateData(spec.data(), paths));
  OFFLOAD_RETURN_IF_ERROR(ValidateOptimizer(spec.optimizer()));
  OFFLOAD_RETURN_IF_ERROR(ValidateParallel(spec.parallel()));
  OFFLOAD_RETURN_IF_ERROR(ValidateTraining(spec.training(), spec.parallel()));
  OFFLOAD_RETURN_IF_ERROR(ValidateCheckpoint(spec.checkpoint(), paths));
  return ValidateEval(spec.eval());
}

absl::Status ValidateTenantName(absl::string_view field, absl::string_view name) {
  constexpr size_t kMaxTenant = 63;
  if (name.empty() || name.size() > kMaxTenant) {
    return Invalid(field, absl::StrCat("1 to ", kMaxTenant, " characters, got ", name.size()));
  }
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    if (absl::ascii_islower(c) || absl::ascii_isdigit(c) || c == '-') continue;
    return Invalid(field, absl::StrCat("character ", Quote(name.substr(i, 1)), " at position ", i,
                                       " is not allowed (use a-z 0-9 and -)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateJobSpec(const v1::JobSpec& spec) {
  OFFLOAD_RETURN_IF_ERROR(ValidateName(spec.name()));
  if (!spec.tenant().empty()) OFFLOAD_RETURN_IF_ERROR(ValidateTenantName("tenant", spec.tenant()));
  if (spec.priority() < 0 || spec.priority() > kMaxJobPriority) {
    return Invalid("priority",
                   absl::StrCat("must be in [0, ", kMaxJobPriority, "], got ", spec.priority()));
  }
  if (spec.has_torch()) {
    OFFLOAD_RETURN_IF_ERROR(CheckFinite(spec, ""));
    return ValidateTorch(spec);
  }
  return ValidateSettings(spec, PathRule::kAbsolute);
}

}  // namespace offload
