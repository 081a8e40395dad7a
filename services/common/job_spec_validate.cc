// The rules of a job's settings, in one place: gpu_trainer applies them to its own flags and the
// job controller to every job file.
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "services/common/job_spec.h"
#include "services/common/job_spec_internal.h"

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

}  // namespace

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

absl::Status ValidateJobSpec(const v1::JobSpec& spec) {
  OFFLOAD_RETURN_IF_ERROR(ValidateName(spec.name()));
  return ValidateSettings(spec, PathRule::kAbsolute);
}

}  // namespace offload
