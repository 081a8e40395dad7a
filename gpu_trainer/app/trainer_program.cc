// gpu_trainer: trains a GPT-2 family model with its optimizer offloaded to CPU optimizer shards
// (--shards), or with the same optimizer code in process when no shards are given.
#include "gpu_trainer/app/trainer_program.h"

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "base/host_buffer.h"
#include "base/logging.h"
#include "base/metrics/metrics.h"
#include "base/metrics/metrics_flags.h"
#include "base/security/security.h"
#include "base/status_macros.h"
#include "gpu_trainer/app/run_training.h"
#include "gpu_trainer/app/trainer_config.h"
#include "gpu_trainer/collectives/controller_store.h"
#include "gpu_trainer/collectives/gloo_collectives.h"
#ifdef OFFLOAD_HAVE_NCCL
#include "gloo/rendezvous/file_store.h"
#include "gpu_trainer/cuda/nccl/nccl_collectives.h"
#endif
#include "gpu_trainer/model/cpu_runtime.h"
#include "gpu_trainer/train/trainer.h"
#include "gpu_trainer/train/trainer_metrics.h"
#include "jobs/worker/progress_client.h"
#include "model_spec/param_layout.h"
#include "model_spec/partition.h"
#include "optimizer_client/backends/inprocess_optimizer.h"
#include "optimizer_client/backends/remote_optimizer.h"
#include "optimizer_client/sender/phase_trace.h"

// trainer_config.cc's, for the metrics' info labels.
ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(std::string, model);

ABSL_FLAG(std::string, shards, "",
          "optimizer shard addresses, comma separated (host:port); empty: optimize in process");
ABSL_FLAG(std::string, trace_file, "",
          "write per-phase timestamps of every step here as a Chrome trace (chrome://tracing, "
          "Perfetto) when the run ends");
ABSL_FLAG(std::string, transport, "auto",
          "data plane to the shards: auto (shared memory on this host, else UCX, else gRPC), grpc, "
          "shm or ucx");
ABSL_FLAG(int, num_shards, 1, "shards of the in-process optimizer (when --shards is empty)");
ABSL_FLAG(std::string, optimizer_state, "auto",
          "where the optimizer servers keep the fp32 master weights and Adam moments: auto (in "
          "memory when they fit the server's --memory_limit_mib, else on its disk tier), memory, "
          "or disk (the server needs --state_dir)");
ABSL_FLAG(std::string, state_dtype, "fp32",
          "the Adam moments on the optimizer: fp32 (12 bytes of state a parameter with the fp32 "
          "master) or bf16 (8 bytes, in memory or on the disk tier)");
ABSL_FLAG(std::string, state_rounding, "stochastic",
          "how bf16 moments are stored: stochastic (unbiased; the same bits every run) or nearest");
ABSL_FLAG(int, optimizer_threads, 0,
          "Adam threads of the in-process optimizer; 0: one per core this process may use");
ABSL_FLAG(bool, optimizer_pin_threads, false,
          "pin each Adam thread of the in-process optimizer to one core (as the server's "
          "--pin_threads)");
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
ABSL_FLAG(absl::Duration, shard_step_timeout_floor, absl::Seconds(60),
          "inside a step, a shard that has not answered within 10x its median step, and at "
          "least this long, is hung: the step fails naming it (at most --shard_timeout)");
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
ABSL_FLAG(std::string, controller, "",
          "run as a pool worker of the job controller at this host:port: register, wait for an "
          "assigned rank of a job, train it (as a child process), report, and wait for the next");
ABSL_FLAG(std::string, report_to, "",
          "the job controller to report this rank's progress to (set by the pool worker)");
ABSL_FLAG(std::string, report_job, "", "with --report_to: the job id");
ABSL_FLAG(uint32_t, report_attempt, 0, "with --report_to: the attempt");
ABSL_FLAG(std::string, error_file, "",
          "write the error that ends the run here (the pool worker passes it to the controller)");
ABSL_FLAG(std::string, rank_metrics_address, "",
          "with --controller: HOST:PORT where each rank this worker runs serves its training "
          "metrics (the worker's own are on --metrics_address)");
ABSL_FLAG(std::string, script_user, "",
          "with --controller: run torch jobs' scripts as uid N + k (gid the same) for worker k "
          "of this process instead of as the worker, so a script cannot read the worker's token "
          "or TLS key or reach another worker's script; needs root with CAP_SETUID, CAP_SETGID "
          "and CAP_KILL, and credential files the scripts' users cannot read (checked at start)");
ABSL_FLAG(std::string, script_groups, "",
          "with --script_user: supplementary gids of every script (a data or checkpoint "
          "volume's group), comma-separated");
ABSL_FLAG(int, workers, 1,
          "with --controller: pool workers this process runs, one rank each (a node or pod of "
          "that many GPUs): worker k has index worker_index * workers + k and its rank serves "
          "metrics on --rank_metrics_address's port + k");
ABSL_FLAG(int, worker_index, -1,
          "with --controller: this worker's place in its set (a Kubernetes completion index); "
          "the controller gives rank i to the worker with index i where it can. -1: none");
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
  if (isatty(STDERR_FILENO)) std::fputc('\n', stderr);  // off the progress bar's line
  LOG(ERROR) << absl::StrFormat("%s: %s", g_who.c_str(), s.ToString().c_str());
  if (const std::string path = absl::GetFlag(FLAGS_error_file); !path.empty()) {
    if (std::FILE* f = std::fopen(path.c_str(), "w")) {
      std::fputs(s.ToString().c_str(), f);
      std::fclose(f);
    }
  }
  return 1;
}

// Rank 0 of a job the controller runs reports its progress and hears the controller's requests.
absl::StatusOr<std::shared_ptr<grpc::Channel>> ControllerChannel(std::string* token) {
  OFFLOAD_ASSIGN_OR_RETURN(offload::SecurityOptions security, offload::SecurityFromFlags());
  *token = security.client_token;
  return offload::MakeChannel(absl::GetFlag(FLAGS_report_to), security.tls);
}

offload::v1::AttemptRef ReportedAttempt() {
  offload::v1::AttemptRef ref;
  ref.set_job_id(absl::GetFlag(FLAGS_report_job));
  ref.set_attempt(absl::GetFlag(FLAGS_report_attempt));
  return ref;
}

absl::StatusOr<std::shared_ptr<gloo::rendezvous::Store>> ControllerRendezvous() {
  if (absl::GetFlag(FLAGS_report_to).empty()) {
    return absl::InvalidArgumentError("--rendezvous=controller needs --report_to");
  }
  std::string token;
  OFFLOAD_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, ControllerChannel(&token));
  return std::make_shared<offload::ControllerStore>(
      channel, token, ReportedAttempt(),
      absl::ToChronoMilliseconds(absl::GetFlag(FLAGS_collective_timeout)));
}

// NCCL between the W ranks of this job, one GPU each: the unique id goes through the rendezvous the
// ranks met in over gloo (the controller's store, or the directory's).
absl::StatusOr<std::unique_ptr<offload::Collectives>> ConnectNcclRanks(
    int rank, int world_size, int cuda_device, const std::string& rendezvous,
    const std::string& job_id) {
#ifdef OFFLOAD_HAVE_NCCL
  offload::NcclOptions nccl;
  nccl.rank = rank;
  nccl.world_size = world_size;
  nccl.cuda_device = cuda_device;
  nccl.prefix = absl::StrCat("trainer-nccl-", job_id);
  nccl.timeout = absl::GetFlag(FLAGS_collective_timeout);
  std::shared_ptr<gloo::rendezvous::Store> store;
  if (rendezvous == "controller") {
    OFFLOAD_ASSIGN_OR_RETURN(store, ControllerRendezvous());
  } else {
    try {
      store = std::make_shared<gloo::rendezvous::FileStore>(rendezvous);
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("NCCL's rendezvous in ", rendezvous, ": ", e.what()));
    }
  }
  return offload::ConnectNccl(nccl, std::move(store));
#else
  return absl::UnimplementedError(
      "--collectives=nccl with more than one rank: this build has no NCCL (it was not found "
      "beside the CUDA toolkit when the build was configured); use --collectives=gloo");
#endif
}

// The controller link of a rank over its progress reports.
class ProgressClientLink : public offload::ControllerLink {
 public:
  explicit ProgressClientLink(std::unique_ptr<offload::ProgressClient> client)
      : client_(std::move(client)) {}

  offload::v1::ProgressReply reply() const override { return client_->reply(); }
  void Update(const offload::v1::ProgressReport& progress) override { client_->Update(progress); }
  absl::Status Flush(absl::Duration timeout) override { return client_->Flush(timeout); }

 private:
  std::unique_ptr<offload::ProgressClient> client_;
};

// Under a job controller rank 0 reports every step and carries out the controller's requests.
std::unique_ptr<offload::ControllerLink> ConnectProgress(int rank) {
  if (absl::GetFlag(FLAGS_report_to).empty() || rank != 0) return nullptr;
  std::string token;
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = ControllerChannel(&token);
  if (!channel.ok()) {
    LOG(WARNING) << absl::StrFormat("%s: no progress reports: %s", g_who.c_str(),
                                    channel.status().ToString().c_str());
    return nullptr;
  }
  offload::v1::ProgressReport report;
  *report.mutable_attempt() = ReportedAttempt();
  report.set_rank(rank);
  return std::make_unique<ProgressClientLink>(
      std::make_unique<offload::ProgressClient>(*channel, token, report));
}

}  // namespace

namespace offload {

int TrainerProgramMain(int argc, char** argv, PoolWorkersFn pool_workers) {
  offload::InitLogging(argv[0]);
  absl::SetProgramUsageMessage(
      "Trains a GPT-2 family model on text or GPT-2 token shards, offloading the optimizer.");
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  offload::KeepFreedMemoryForReuse();
  // Every phase a rank times goes into its offload_trainer_phase_seconds histogram.
  offload::SetPhaseObserver(&offload::ObserveTrainerPhaseSeconds);
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);

  if (absl::GetFlag(FLAGS_controller).empty() && positional.size() > 1) {
    return Fail(
        absl::InvalidArgumentError(absl::StrCat("unexpected argument '", positional[1], "'")));
  }
  // The pool worker serves its own metrics; each rank it runs serves the training metrics on
  // --rank_metrics_address.
  absl::StatusOr<std::unique_ptr<offload::MetricsServer>> metrics =
      offload::StartMetricsServerIfAsked(absl::GetFlag(FLAGS_metrics_address), g_who);
  if (!metrics.ok()) {
    // A rank of a controller's job trains without its metrics rather than fail the attempt
    // (its port may have been taken since its worker was started); anything else refuses.
    if (absl::GetFlag(FLAGS_report_to).empty()) return Fail(metrics.status());
    LOG(WARNING) << absl::StrFormat("%s: no metrics: %s", g_who.c_str(),
                                    metrics.status().ToString().c_str());
  }

  if (!absl::GetFlag(FLAGS_controller).empty()) {
    // Arguments after "--" are this worker's own additions to every rank it runs (display,
    // timeouts, traces): settings of the machine, not of the job.
    std::vector<std::string> rank_args(positional.begin() + 1, positional.end());
    const int workers = absl::GetFlag(FLAGS_workers);
    if (workers < 1 || workers > 1024) {
      return Fail(
          absl::InvalidArgumentError(absl::StrCat("--workers=", workers, " must be in [1, 1024]")));
    }
    PoolWorkerArgs args;
    args.workers = workers;
    args.trainer_binary = argv[0];
    args.controller = absl::GetFlag(FLAGS_controller);
    args.rank_address = absl::GetFlag(FLAGS_rank_address);
    args.worker_index = absl::GetFlag(FLAGS_worker_index);
    args.rank_metrics_address = absl::GetFlag(FLAGS_rank_metrics_address);
    args.script_user = absl::GetFlag(FLAGS_script_user);
    args.script_groups = absl::GetFlag(FLAGS_script_groups);
    args.rank_args = std::move(rank_args);
    args.stop = &g_stop;
    return pool_workers(args);
  }

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
  // From here on every error of one of several ranks says which.
  if (world_size > 1) g_who = absl::StrCat("gpu_trainer rank ", rank);
  if (world_size > 1 && addresses.empty()) {
    return Fail(absl::InvalidArgumentError(
        "more than one rank needs optimizer servers (--shards): an in-process optimizer would "
        "give each rank its own copy of the state"));
  }
  // Before the ranks meet: each refuses alone, at once, rather than after the rendezvous.
  if (absl::Status s =
          offload::CheckCollectiveLibrary(options->device, options->collective_library);
      !s.ok()) {
    return Fail(s);
  }
#ifndef OFFLOAD_HAVE_NCCL
  if (world_size > 1 && options->collective_library == offload::CollectiveLibrary::kNccl) {
    return Fail(ConnectNcclRanks(rank, world_size, 0, "", "").status());  // says why
  }
#endif
  std::unique_ptr<offload::Collectives> collectives;
  std::unique_ptr<offload::Collectives> nccl_collectives;  // --collectives=nccl: the step's
  if (world_size > 1) {
    offload::GlooOptions gloo;
    gloo.rank = rank;
    gloo.world_size = world_size;
    gloo.rendezvous = absl::GetFlag(FLAGS_rendezvous);
    gloo.prefix = "trainer";
    gloo.hostname = absl::GetFlag(FLAGS_rank_address);
    gloo.timeout = absl::GetFlag(FLAGS_collective_timeout);
    absl::StatusOr<std::unique_ptr<offload::Collectives>> connected;
    if (gloo.rendezvous == "controller") {
      // The ranks of a controller's job meet in its rendezvous store, reachable from any node.
      absl::StatusOr<std::shared_ptr<gloo::rendezvous::Store>> store = ControllerRendezvous();
      if (!store.ok()) return Fail(store.status());
      connected = offload::ConnectGloo(gloo, *store);
    } else {
      connected = offload::ConnectGloo(gloo);
    }
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
    if (options->collective_library == offload::CollectiveLibrary::kNccl) {
      // The ranks met over gloo to agree on the job; the step's collectives are NCCL's, on the
      // GPUs, meeting in the same rendezvous.
      absl::StatusOr<std::unique_ptr<offload::Collectives>> nccl = ConnectNcclRanks(
          rank, world_size, options->cuda_device, gloo.rendezvous, options->job_id);
      if (!nccl.ok()) return Fail(nccl.status());
      nccl_collectives = std::move(*nccl);
      options->collectives = nccl_collectives.get();
    }
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
        *map, absl::GetFlag(FLAGS_optimizer_threads), *path,
        absl::GetFlag(FLAGS_optimizer_pin_threads));
  } else {
    offload::ClientOptions client_options;
    client_options.call_timeout = absl::GetFlag(FLAGS_shard_timeout);
    client_options.step_timeout_floor = absl::GetFlag(FLAGS_shard_step_timeout_floor);
    // The shards see the same TLS flags as the controller, and the credential shard_token says.
    absl::StatusOr<offload::SecurityOptions> security = offload::SecurityFromFlags();
    if (!security.ok()) return Fail(security.status());
    client_options.token = security->shard_token;
    client_options.tls = security->tls;
    absl::StatusOr<offload::TransportChoice> transport =
        offload::ParseTransportChoice(absl::GetFlag(FLAGS_transport));
    if (!transport.ok()) return Fail(transport.status());
    auto remote = offload::RemoteOptimizer::Connect(*map, addresses, client_options, *transport);
    if (!remote.ok()) return Fail(remote.status());
    if (absl::Status s = (*remote)->SetRank(rank); !s.ok()) return Fail(s);
    const std::string state = absl::GetFlag(FLAGS_optimizer_state);
    if (state != "auto" && state != "memory" && state != "disk") {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("--optimizer_state is ", state, "; it must be auto, memory or disk")));
    }
    (*remote)->SetStateTier(state == "memory" ? offload::v1::STATE_TIER_MEMORY
                            : state == "disk" ? offload::v1::STATE_TIER_DISK
                                              : offload::v1::STATE_TIER_AUTO);
    data_plane = (*remote)->TransportNames();
    backend = std::move(*remote);
  }
  const std::string state_dtype = absl::GetFlag(FLAGS_state_dtype);
  const std::string state_rounding = absl::GetFlag(FLAGS_state_rounding);
  if ((state_dtype != "fp32" && state_dtype != "bf16") ||
      (state_rounding != "stochastic" && state_rounding != "nearest")) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--state_dtype is ", state_dtype, " and --state_rounding ", state_rounding,
                     "; they must be fp32 or bf16, and stochastic or nearest")));
  }
  backend->SetStateStorage(
      state_dtype == "bf16" ? offload::v1::DTYPE_BF16 : offload::v1::DTYPE_FP32,
      state_rounding == "nearest" ? offload::v1::STATE_ROUNDING_NEAREST
                                  : offload::v1::STATE_ROUNDING_STOCHASTIC);

  // Declared before the trainer, so it outlives the trainer's background commit; written when
  // main returns, whichever way.
  struct TraceOnExit {
    std::unique_ptr<offload::PhaseTrace> trace;
    std::string path;
    ~TraceOnExit() {
      if (trace == nullptr) return;
      if (absl::Status s = trace->WriteChromeTrace(path); !s.ok()) {
        LOG(WARNING) << absl::StrFormat("gpu_trainer: trace: %s", s.ToString().c_str());
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
  {
    offload::TrainerInfo info;
    info.job_id =
        absl::GetFlag(FLAGS_report_job).empty() ? options->job_id : absl::GetFlag(FLAGS_report_job);
    info.rank = rank;
    info.world_size = world_size;
    info.device = absl::GetFlag(FLAGS_device);
    info.model = absl::GetFlag(FLAGS_model);
    offload::SetTrainerInfo(info);
    offload::RecordDeviceMemory(t.DeviceMemory());
  }
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
    std::printf("gpu_trainer: %s\n", t.DescribeZero().c_str());
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
  if (lead && t.step() >= t.total_steps()) {
    std::printf(
        "gpu_trainer: already at step %llu of --steps=%llu: nothing to train (a larger "
        "--steps trains on)\n",
        static_cast<unsigned long long>(t.step()),
        static_cast<unsigned long long>(t.total_steps()));
  }
  std::fflush(stdout);

  const std::string progress = absl::GetFlag(FLAGS_progress);
  offload::TrainingLoopOptions loop;
  loop.out = stdout;
  loop.progress_bar = progress == "bar" || (progress == "auto" && isatty(STDOUT_FILENO));
  loop.log_every = absl::GetFlag(FLAGS_log_every);
  loop.eval_every = absl::GetFlag(FLAGS_eval_every);
  loop.eval_batches = absl::GetFlag(FLAGS_eval_batches);
  loop.checkpoint_dir = options->checkpoint_dir;
  loop.checkpoint_every = absl::GetFlag(FLAGS_checkpoint_every);
  loop.flops_per_token = offload::Gpt2FlopsPerToken(c, options->seq_len);
  loop.stop_requested = [] { return g_stop != 0; };
  std::unique_ptr<offload::ControllerLink> controller = ConnectProgress(rank);
  absl::StatusOr<offload::TrainingOutcome> outcome =
      offload::RunTraining(t, loop, controller.get());
  if (!outcome.ok()) return Fail(outcome.status());
  if (outcome->interrupted) return 130;
  const int sample_tokens = absl::GetFlag(FLAGS_sample_tokens);
  // Under ZeRO-3 sampling is collective (every forward gathers the layers): all ranks sample.
  if (sample_tokens > 0 && (lead || t.zero_stage() == 3)) {
    absl::StatusOr<std::string> text =
        t.Sample(absl::GetFlag(FLAGS_sample_prompt), sample_tokens,
                 absl::GetFlag(FLAGS_sample_temperature), options->seed);
    if (!text.ok()) return Fail(text.status());
    if (lead)
      std::printf("gpu_trainer: sample:\n---\n%s%s\n---\n",
                  absl::GetFlag(FLAGS_sample_prompt).c_str(), text->c_str());
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace offload
