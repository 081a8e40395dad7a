// gpu_trainer: trains a GPT-2 family model with its optimizer offloaded to CPU optimizer shards
// (--shards), or with the same optimizer code in process when no shards are given.
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "cpu_optimizer_server/host_buffer.h"
#include "gpu_trainer/collectives/gloo_collectives.h"
#include "gpu_trainer/model/cpu_runtime.h"
#include "gpu_trainer/model/param_layout.h"
#include "gpu_trainer/train/inprocess_optimizer.h"
#include "gpu_trainer/train/partition.h"
#include "gpu_trainer/train/phase_trace.h"
#include "gpu_trainer/train/progress.h"
#include "gpu_trainer/train/remote_optimizer.h"
#include "gpu_trainer/train/trainer.h"
#include "gpu_trainer/train/trainer_config.h"

ABSL_FLAG(std::string, shards, "",
          "optimizer shard addresses, comma separated (host:port); empty: optimize in process");
ABSL_FLAG(std::string, trace_file, "",
          "write per-phase timestamps of every step here as a Chrome trace (chrome://tracing, "
          "Perfetto) when the run ends");
ABSL_FLAG(std::string, transport, "auto",
          "data plane to the shards: auto (shared memory on this host, else UCX, else gRPC), grpc, "
          "shm or ucx");
ABSL_FLAG(int, num_shards, 1, "shards of the in-process optimizer (when --shards is empty)");
ABSL_FLAG(int, optimizer_threads, 0, "Adam threads of the in-process optimizer; 0: all cores");
ABSL_FLAG(std::string, progress, "auto", "auto (a bar on a terminal), bar, or log");
ABSL_FLAG(int, log_every, 10, "steps between log lines when not drawing a bar");
ABSL_FLAG(int, eval_every, 100, "steps between validation evaluations; 0: only at the end");
ABSL_FLAG(int, eval_batches, 20, "validation batches per evaluation");
ABSL_FLAG(int, checkpoint_every, 0, "steps between checkpoints; 0: only at the end");
ABSL_FLAG(int, sample_tokens, 300, "tokens of text sampled at the end; 0: none");
ABSL_FLAG(std::string, sample_prompt, "\n", "text the sample starts from");
ABSL_FLAG(float, sample_temperature, 0.8f, "softmax temperature of the sample");
ABSL_FLAG(absl::Duration, shard_timeout, absl::Minutes(10),
          "deadline of each call to an optimizer shard, a whole step included");
ABSL_FLAG(int, world_size, 1, "trainer ranks of the job (data parallel, ZeRO-2)");
ABSL_FLAG(int, rank, 0, "this trainer's rank, in [0, world_size)");
ABSL_FLAG(std::string, rendezvous, "",
          "with world_size > 1: a directory every rank can reach, where they meet (the launcher "
          "makes one per job)");
ABSL_FLAG(std::string, rank_address, "127.0.0.1",
          "with world_size > 1: the address this rank listens on for the other ranks");
ABSL_FLAG(absl::Duration, collective_timeout, absl::Seconds(60),
          "with world_size > 1: how long the ranks wait for each other to meet, and in each "
          "collective; a rank that died or hangs fails the others after this long at most");
ABSL_FLAG(absl::Duration, lead_timeout, absl::Minutes(30),
          "with world_size > 1: how long the other ranks wait for rank 0 to load the job's state "
          "onto the shards or to write a checkpoint");

namespace {

volatile std::sig_atomic_t g_stop = 0;
std::string g_who = "gpu_trainer";  // "gpu_trainer rank R" when there are several
// The first signal stops the run at the next step boundary (with a checkpoint); a second one
// ends the process at once, in case a step is stuck.
void OnSignal(int sig) {
  if (g_stop) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
  g_stop = 1;
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "\n%s: %s\n", g_who.c_str(), s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Trains a GPT-2 family model on text or GPT-2 token shards, offloading the optimizer.");
  absl::ParseCommandLine(argc, argv);
  offload::KeepFreedMemoryForReuse();
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);

  absl::StatusOr<offload::TrainerOptions> options = offload::TrainerOptionsFromFlags();
  if (!options.ok()) return Fail(options.status());
  const int64_t num_params = offload::Gpt2NumParams(options->model);

  std::vector<std::string> addresses =
      absl::StrSplit(absl::GetFlag(FLAGS_shards), ',', absl::SkipWhitespace());
  const int num_shards =
      addresses.empty() ? absl::GetFlag(FLAGS_num_shards) : static_cast<int>(addresses.size());
  const int world_size = absl::GetFlag(FLAGS_world_size);
  const int rank = absl::GetFlag(FLAGS_rank);
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "--rank=", rank, " must be in [0, --world_size=", world_size, ") and world_size >= 1")));
  }
  if (world_size > 1 && addresses.empty()) {
    return Fail(absl::InvalidArgumentError(
        "more than one rank needs optimizer servers (--shards): an in-process optimizer would "
        "give each rank its own copy of the state"));
  }
  std::unique_ptr<offload::Collectives> collectives;
  if (world_size > 1) {
    g_who = absl::StrCat("gpu_trainer rank ", rank);
    offload::GlooOptions gloo;
    gloo.rank = rank;
    gloo.world_size = world_size;
    gloo.rendezvous = absl::GetFlag(FLAGS_rendezvous);
    gloo.prefix = "trainer";
    gloo.hostname = absl::GetFlag(FLAGS_rank_address);
    gloo.timeout = absl::GetFlag(FLAGS_collective_timeout);
    absl::StatusOr<std::unique_ptr<offload::Collectives>> connected = offload::ConnectGloo(gloo);
    if (!connected.ok()) return Fail(connected.status());
    collectives = std::move(*connected);
    // Every rank steps rank 0's job on the shards.
    char job_id[256] = {};
    options->job_id.copy(job_id, sizeof(job_id) - 1);
    if (absl::Status s = collectives->Broadcast(job_id, sizeof(job_id), 0); !s.ok()) {
      return Fail(s);
    }
    options->job_id = job_id;
    options->collectives = collectives.get();
    options->lead_timeout = absl::GetFlag(FLAGS_lead_timeout);
  }
  const bool lead = rank == 0;
  absl::StatusOr<offload::v1::PartitionMap> map =
      offload::MakePartitionMap(num_params, world_size, num_shards);
  if (!map.ok()) return Fail(map.status());
  std::unique_ptr<offload::OptimizerBackend> backend;
  std::string data_plane = "in process";
  if (addresses.empty()) {
    absl::StatusOr<offload::SimdPath> path = offload::ParseSimdPath("auto");
    backend = std::make_unique<offload::InProcessOptimizer>(
        *map, absl::GetFlag(FLAGS_optimizer_threads), *path);
  } else {
    offload::ClientOptions client_options;
    client_options.call_timeout = absl::GetFlag(FLAGS_shard_timeout);
    absl::StatusOr<offload::TransportChoice> transport =
        offload::ParseTransportChoice(absl::GetFlag(FLAGS_transport));
    if (!transport.ok()) return Fail(transport.status());
    auto remote = offload::RemoteOptimizer::Connect(*map, addresses, client_options, *transport);
    if (!remote.ok()) return Fail(remote.status());
    if (absl::Status s = (*remote)->SetRank(rank); !s.ok()) return Fail(s);
    data_plane = (*remote)->TransportNames();
    backend = std::move(*remote);
  }

  // Declared before the trainer, so it outlives the trainer's background commit; written when
  // main returns, whichever way.
  struct TraceOnExit {
    std::unique_ptr<offload::PhaseTrace> trace;
    std::string path;
    ~TraceOnExit() {
      if (trace == nullptr) return;
      if (absl::Status s = trace->WriteChromeTrace(path); !s.ok()) {
        std::fprintf(stderr, "gpu_trainer: trace: %s\n", s.ToString().c_str());
      } else {
        std::printf("gpu_trainer: trace %s\n", path.c_str());
      }
    }
  } trace_on_exit{nullptr, absl::GetFlag(FLAGS_trace_file)};
  if (!trace_on_exit.path.empty() && rank > 0) absl::StrAppend(&trace_on_exit.path, ".rank", rank);
  if (!trace_on_exit.path.empty()) {
    trace_on_exit.trace = std::make_unique<offload::PhaseTrace>();
    options->trace = trace_on_exit.trace.get();
  }
  absl::StatusOr<std::unique_ptr<offload::Trainer>> trainer =
      offload::Trainer::Create(*options, backend.get());
  if (!trainer.ok()) return Fail(trainer.status());
  offload::Trainer& t = **trainer;
  const offload::Gpt2Config& c = options->model;
  // Rank 0 speaks for the job; the others say only what concerns them (errors, the end).
  if (lead) {
    std::printf(
        "gpu_trainer: GPT-2 layers=%d heads=%d channels=%d context=%d vocab=%d params=%lld "
        "dtype=%s\ngpu_trainer: %s\n",
        c.num_layers, c.num_heads, c.channels, c.context_length, c.vocab_size,
        static_cast<long long>(num_params),
        std::string(offload::DTypeName(options->param_dtype)).c_str(), t.DescribeBackend().c_str());
    std::printf(
        "gpu_trainer: optimizer %s, %d shard(s), data plane %s; batch %d x %d tokens; %llu steps\n",
        addresses.empty() ? "in process" : absl::StrCat("at ", absl::GetFlag(FLAGS_shards)).c_str(),
        num_shards, data_plane.c_str(), options->batch, options->seq_len,
        static_cast<unsigned long long>(options->steps));
    if (world_size > 1) {
      std::printf(
          "gpu_trainer: %d ranks (%s), %d sequence(s) per rank per micro-batch, %d "
          "micro-batch(es)\n",
          world_size, collectives->Describe().c_str(),
          options->batch / (world_size * options->micro_batches), options->micro_batches);
    }
  }
  absl::StatusOr<std::string> started = t.Start();
  // From here on the shards hold the job's state. Whatever ends the run frees it: the state
  // worth keeping is in the checkpoints, and a resume loads it from there.
  // Rank 0 created the job, so it drops it; a normal end flushes every rank's commit first.
  struct DropOnExit {
    std::unique_ptr<offload::Trainer>* trainer;
    offload::OptimizerBackend* backend;
    bool lead;
    ~DropOnExit() {
      trainer->reset();  // waits for this rank's DPU commit, if one still runs on the shards
      if (lead) backend->DropJob().IgnoreError();
    }
  } drop_on_exit{&*trainer, backend.get(), lead};
  if (!started.ok()) return Fail(started.status());
  if (lead) std::printf("gpu_trainer: %s\n", started->c_str());
  std::fflush(stdout);

  const std::string progress = absl::GetFlag(FLAGS_progress);
  const bool bar = progress == "bar" || (progress == "auto" && isatty(STDOUT_FILENO));
  offload::ProgressReporter reporter(stdout, bar, t.total_steps(), absl::GetFlag(FLAGS_log_every));
  const int eval_every = absl::GetFlag(FLAGS_eval_every);
  const int eval_batches = absl::GetFlag(FLAGS_eval_batches);
  const int checkpoint_every = absl::GetFlag(FLAGS_checkpoint_every);
  const bool checkpoints = !options->checkpoint_dir.empty();
  float val_loss = 0;
  const absl::Time start = absl::Now();
  const uint64_t first_step = t.step();
  bool interrupted = false;

  // A signal stops the run at a step boundary every rank agrees on (the step's report says so),
  // so their collectives stay in step.
  while (t.step() < t.total_steps()) {
    if (g_stop) t.RequestStop();
    absl::StatusOr<offload::StepReport> r = t.Step();
    if (!r.ok()) return Fail(r.status());
    if (lead) {
      reporter.Step(r->step, r->loss, r->lr, r->loss_scale, r->skipped, t.tokens_per_step());
    }
    if (r->stop) {
      interrupted = true;
      break;
    }
    if (eval_every > 0 && r->step % eval_every == 0 && r->step < t.total_steps()) {
      absl::StatusOr<float> v = t.Evaluate(eval_batches);
      if (!v.ok()) return Fail(v.status());
      val_loss = *v;
      if (lead) reporter.Message(absl::StrFormat("step %d: val_loss %.4f", r->step, val_loss));
    }
    if (checkpoints && checkpoint_every > 0 && r->step % checkpoint_every == 0 &&
        r->step < t.total_steps()) {
      absl::StatusOr<std::string> dir = t.SaveCheckpoint(val_loss);
      if (!dir.ok()) return Fail(dir.status());
      if (lead) reporter.Message(absl::StrCat("checkpoint ", *dir));
    }
  }
  if (lead) reporter.Finish();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);

  // An interrupted run keeps the last validation loss: the user asked it to stop now.
  if (!interrupted) {
    absl::StatusOr<float> v = t.Evaluate(eval_batches);
    if (!v.ok()) return Fail(v.status());
    val_loss = *v;
  }
  if (lead) {
    std::printf(
        "gpu_trainer: step %llu val_loss %.4f (%llu steps in %s, %.0f tokens/s, %llu "
        "skipped)\n",
        static_cast<unsigned long long>(t.step()), val_loss,
        static_cast<unsigned long long>(t.step() - first_step),
        offload::FormatDuration(seconds).c_str(),
        (t.step() - first_step) * t.tokens_per_step() / std::max(seconds, 1e-9),
        static_cast<unsigned long long>(t.loss_scaler().skipped_steps()));
  }
  if (checkpoints) {
    absl::StatusOr<std::string> dir = t.SaveCheckpoint(val_loss);
    if (!dir.ok()) return Fail(dir.status());
    if (lead) {
      std::printf("gpu_trainer: checkpoint %s (continue with --resume --checkpoint_dir=%s)\n",
                  dir->c_str(), options->checkpoint_dir.c_str());
    }
  }
  // Every rank's last commit is done before rank 0 drops the job.
  if (absl::Status s = t.Flush(); !s.ok()) return Fail(s);
  if (interrupted) {
    std::printf("gpu_trainer: %sinterrupted at step %llu%s\n",
                lead ? "" : absl::StrCat("rank ", rank, " ").c_str(),
                static_cast<unsigned long long>(t.step()),
                checkpoints && lead ? "; rerun with --resume to continue" : "");
    return 130;
  }
  const int sample_tokens = absl::GetFlag(FLAGS_sample_tokens);
  if (sample_tokens > 0 && lead) {
    absl::StatusOr<std::string> text =
        t.Sample(absl::GetFlag(FLAGS_sample_prompt), sample_tokens,
                 absl::GetFlag(FLAGS_sample_temperature), options->seed);
    if (!text.ok()) return Fail(text.status());
    std::printf("gpu_trainer: sample:\n---\n%s%s\n---\n",
                absl::GetFlag(FLAGS_sample_prompt).c_str(), text->c_str());
  }
  std::fflush(stdout);
  return 0;
}
