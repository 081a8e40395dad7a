// cpu_optimizer_server: serves offload.v1.OptimizerShard for the jobs assigned to this shard.
// Standalone it takes any job from a caller with one of its tokens; with --controller it joins the
// controller's pool and takes only the attempts assigned to it, each from the callers that
// present that attempt's secret.
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <map>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "base/host_buffer.h"
#include "base/logging.h"
#include "base/metrics/metrics.h"
#include "base/metrics/metrics_flags.h"
#include "base/placement/cpu_list.h"
#include "base/security/security.h"
#include "base/thread_pool.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"
#include "cpu_optimizer_server/grpc/optimizer_service.h"
#include "cpu_optimizer_server/shard/server_metrics.h"
#include "cpu_optimizer_server/shard/shard_store.h"
#include "grpcpp/health_check_service_interface.h"
#include "jobs/spec/job_spec.h"
#include "jobs/worker/worker_agent.h"

// base/security/security_flags.cc
ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "address to serve on (host:port; port 0 picks a free one, printed at start)");
ABSL_FLAG(bool, shm, true,
          "offer the shared-memory data plane to trainers that prove they share this host");
ABSL_FLAG(bool, ucx, true, "offer the UCX data plane (where the build has UCX; UCX_TLS applies)");
ABSL_FLAG(std::string, ucx_net_devices, "auto",
          "network devices the UCX plane offers a trainer: auto (the interface that routes to that "
          "trainer, plus RDMA ports; UCX_NET_DEVICES, when set, instead), all, or a list as for "
          "UCX_NET_DEVICES (eth0,mlx5_0:1)");
ABSL_FLAG(int, threads, 0, "Adam worker threads; 0 = one per core this process may use");
ABSL_FLAG(bool, pin_threads, false, "pin each Adam worker to one core");
ABSL_FLAG(std::string, optimizer_cores, "",
          "a CPU list (e.g. 2-7,10): pin the Adam workers to these cores, one each (--threads 0: "
          "one worker per listed core), for a server sharing its host with a trainer that keeps "
          "to the other cores");
ABSL_FLAG(std::string, simd, "auto", "Adam kernel path: auto, scalar, avx2 or avx512");
ABSL_FLAG(int64_t, memory_limit_mib, 16384,
          "optimizer state, accumulators and gradients in flight may hold at most this much");
ABSL_FLAG(int64_t, max_message_mib, 64, "largest gRPC message accepted or sent");
ABSL_FLAG(std::string, controller, "",
          "job controller (host:port) whose pool this server joins; empty: standalone, taking "
          "any job");
ABSL_FLAG(std::string, advertise, "",
          "host:port trainers reach this server at, as told to the controller; default: the "
          "--listen host (this machine's name for a wildcard host) with the bound port");
ABSL_FLAG(int64_t, wave_elements, int64_t{2} << 20,
          "parameters per chunk streamed back after a commit (Adam runs wave by wave)");
ABSL_FLAG(std::string, state_dir, "",
          "a directory on a fast disk for jobs' optimizer state (fp32 master weights and Adam "
          "moments, 12 bytes per parameter), streamed through --state_memory_mib of host "
          "buffers with io_uring; empty: state only in memory");
ABSL_FLAG(int64_t, state_memory_mib, 192,
          "with --state_dir: the ring of host buffers the disk tier streams state through "
          "(counted in --memory_limit_mib); at least three waves of state (72 MiB at the default "
          "--wave_elements)");
ABSL_FLAG(std::string, state_tier, "auto",
          "with --state_dir: auto puts a job on disk when its state does not fit "
          "--memory_limit_mib; disk puts every job there (a job's CreateJob may still ask)");

namespace {

volatile std::sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }

// The address trainers reach this server at: --advertise, else the --listen host with the bound
// port, where a wildcard host (which no one can dial) becomes this machine's name.
std::string AdvertiseAddress(const std::string& listen, int port) {
  if (std::string advertise = absl::GetFlag(FLAGS_advertise); !advertise.empty()) {
    return advertise;
  }
  const size_t colon = listen.rfind(':');
  std::string host = colon == std::string::npos ? listen : listen.substr(0, colon);
  if (host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::" || host == "*") {
    host = offload::ThisHostName();
  }
  return absl::StrCat(host, ":", port);
}

// The attempts the controller assigned to this server: each one's shard job id is granted to the
// callers that present its secret (shard_access.h), and to nobody else. A withdrawn attempt loses
// its grant first and its state second, so a CreateJob racing the withdrawal cannot leave state
// behind (CreateJob asks again after allocating).
class Admissions {
 public:
  Admissions(offload::ShardStore* store, offload::ShardAccess* access)
      : store_(store), access_(access) {}

  void Start(const offload::v1::Assignment& assignment) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    by_attempt_[{assignment.job_id(), assignment.attempt()}] = assignment.shard_job_id();
    access_->Grant(assignment.shard_job_id(), assignment.shard_secret());
    LOG(INFO) << absl::StrFormat(
        "cpu_optimizer_server: assigned job %s attempt %u as shard %u (shard job %s)",
        assignment.job_id().c_str(), assignment.attempt(), assignment.shard_index(),
        assignment.shard_job_id().c_str());
  }

  void Stop(const offload::v1::AttemptRef& ref) ABSL_LOCKS_EXCLUDED(mu_) {
    std::string shard_job_id;
    {
      absl::MutexLock lock(&mu_);
      auto it = by_attempt_.find({ref.job_id(), ref.attempt()});
      // An attempt this process never saw start (it restarted) still has the conventional id.
      shard_job_id =
          it != by_attempt_.end() ? it->second : offload::ShardJobId(ref.job_id(), ref.attempt());
      if (it != by_attempt_.end()) by_attempt_.erase(it);
    }
    access_->Revoke(shard_job_id);
    // The DropJob RPC's path; NOT_FOUND only means the trainers never created it here.
    absl::Status dropped = store_->DropJob(shard_job_id);
    if (!dropped.ok() && !absl::IsNotFound(dropped)) {
      LOG(WARNING) << absl::StrFormat("cpu_optimizer_server: dropping shard job %s: %s",
                                      shard_job_id.c_str(), dropped.ToString().c_str());
    }
    LOG(INFO) << absl::StrFormat(
        "cpu_optimizer_server: withdrawn job %s attempt %u (shard job %s%s)", ref.job_id().c_str(),
        ref.attempt(), shard_job_id.c_str(), dropped.ok() ? ", state dropped" : "");
  }

 private:
  offload::ShardStore* const store_;
  offload::ShardAccess* const access_;
  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, uint32_t>, std::string> by_attempt_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

int main(int argc, char** argv) {
  offload::InitLogging(argv[0]);
  absl::SetProgramUsageMessage("Serves the fp32 optimizer state of training jobs over gRPC.");
  absl::ParseCommandLine(argc, argv);
  offload::KeepFreedMemoryForReuse();

  absl::StatusOr<offload::SimdPath> path = offload::ParseSimdPath(absl::GetFlag(FLAGS_simd));
  if (!path.ok()) {
    LOG(ERROR) << absl::StrFormat("cpu_optimizer_server: --simd: %s",
                                  path.status().ToString().c_str());
    return 2;
  }
  offload::ThreadPool::Options pool_options;
  pool_options.num_threads = absl::GetFlag(FLAGS_threads);
  pool_options.pin = absl::GetFlag(FLAGS_pin_threads);
  pool_options.name = "adam";
  if (const std::string cores = absl::GetFlag(FLAGS_optimizer_cores); !cores.empty()) {
    absl::StatusOr<std::vector<int>> cpus = offload::ParseCpuList(cores);
    if (!cpus.ok()) {
      LOG(ERROR) << absl::StrFormat("cpu_optimizer_server: --optimizer_cores: %s",
                                    cpus.status().message());
      return 2;
    }
    pool_options.cpus = *std::move(cpus);
  }
  offload::ThreadPool pool(pool_options);
  offload::ShardOptions shard_options;
  shard_options.memory_limit_bytes = absl::GetFlag(FLAGS_memory_limit_mib) << 20;
  shard_options.wave_elements = absl::GetFlag(FLAGS_wave_elements);
  const std::string state_tier = absl::GetFlag(FLAGS_state_tier);
  if (state_tier != "auto" && state_tier != "disk") {
    LOG(ERROR) << "cpu_optimizer_server: --state_tier is " << state_tier << "; auto or disk";
    return 2;
  }
  shard_options.state_on_disk = state_tier == "disk";
  std::unique_ptr<offload::DiskTier> disk;
  if (!absl::GetFlag(FLAGS_state_dir).empty()) {
    offload::DiskTierOptions disk_options;
    disk_options.state_dir = absl::GetFlag(FLAGS_state_dir);
    disk_options.memory_bytes = absl::GetFlag(FLAGS_state_memory_mib) << 20;
    disk_options.wave_elements = shard_options.wave_elements;
    absl::StatusOr<std::unique_ptr<offload::DiskTier>> opened =
        offload::DiskTier::Open(disk_options);
    if (!opened.ok()) {
      LOG(ERROR) << "cpu_optimizer_server: --state_dir: " << opened.status();
      return 2;
    }
    disk = *std::move(opened);
  } else if (shard_options.state_on_disk) {
    LOG(ERROR) << "cpu_optimizer_server: --state_tier=disk needs --state_dir";
    return 2;
  }
  offload::ShardStore store(shard_options, &pool, *path, disk.get());
  // The ring is host memory like any other state: it comes out of the same limit.
  offload::Reservation ring_reservation;
  if (disk != nullptr) {
    absl::StatusOr<offload::Reservation> ring =
        store.budget()->Take(disk->ring_bytes(), "the disk tier's ring (--state_memory_mib)");
    if (!ring.ok()) {
      LOG(ERROR) << "cpu_optimizer_server: " << ring.status();
      return 2;
    }
    ring_reservation = *std::move(ring);
  }
  absl::StatusOr<std::unique_ptr<offload::MetricsServer>> metrics =
      offload::StartMetricsServerIfAsked(absl::GetFlag(FLAGS_metrics_address),
                                         "cpu_optimizer_server");
  if (!metrics.ok()) {
    LOG(ERROR) << absl::StrFormat("cpu_optimizer_server: %s", metrics.status().ToString().c_str());
    return 2;
  }
  if (*metrics != nullptr) {
    offload::ServerMetrics::Get().Enable();
    for (auto& c : offload::MakeShardStoreCollectors(&store)) (*metrics)->Add(std::move(c));
  }

  const std::string controller = absl::GetFlag(FLAGS_controller);
  // Secure by default, standalone too: anyone who reaches the port could otherwise read a job's
  // weights or drop its state.
  absl::StatusOr<offload::SecurityOptions> security = offload::SecurityFromFlags();
  if (security.ok()) {
    if (absl::Status s = offload::RequireTokens(*security); !s.ok()) security = s;
  }
  if (!security.ok()) {
    LOG(ERROR) << absl::StrFormat("cpu_optimizer_server: %s", security.status().ToString().c_str());
    return 2;
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> server_credentials =
      offload::MakeServerCredentials(security->tls);
  if (!server_credentials.ok()) {
    LOG(ERROR) << absl::StrFormat("cpu_optimizer_server: %s",
                                  server_credentials.status().ToString().c_str());
    return 2;
  }
  // The --token_file tokens: on a standalone server they admit any job; on a pool server they
  // only describe the shard, and each job takes its attempt's secret.
  offload::ShardAccess access(controller.empty() ? offload::ShardAccess::Mode::kStandalone
                                                 : offload::ShardAccess::Mode::kPool,
                              security->accepted);
  Admissions admissions(&store, &access);

  offload::ServerOptions server_options;
  server_options.listen_address = absl::GetFlag(FLAGS_listen);
  server_options.max_message_bytes = absl::GetFlag(FLAGS_max_message_mib) << 20;
  server_options.enable_shm = absl::GetFlag(FLAGS_shm);
  server_options.enable_ucx = absl::GetFlag(FLAGS_ucx);
  server_options.ucx_net_devices = absl::GetFlag(FLAGS_ucx_net_devices);
  server_options.credentials = *server_credentials;
  server_options.access = &access;
  // grpc.health.v1 on the shard port, for Kubernetes' gRPC probes and load balancers.
  grpc::EnableDefaultHealthCheckService(true);
  absl::StatusOr<std::unique_ptr<offload::OptimizerServer>> server =
      offload::OptimizerServer::Start(server_options, &store);
  if (!server.ok()) {
    LOG(ERROR) << absl::StrFormat("cpu_optimizer_server: %s", server.status().ToString().c_str());
    return 1;
  }
  std::printf("cpu_optimizer_server listening port=%d simd=%s threads=%d memory_limit_mib=%lld%s\n",
              (*server)->port(), std::string(offload::SimdPathName(*path)).c_str(),
              pool.num_threads(), static_cast<long long>(absl::GetFlag(FLAGS_memory_limit_mib)),
              disk == nullptr
                  ? ""
                  : absl::StrFormat(" state_dir=%s state_memory_mib=%lld slots=%d state_tier=%s",
                                    disk->dir(), static_cast<long long>(disk->ring_bytes() >> 20),
                                    disk->slots(), state_tier)
                        .c_str());
  std::fflush(stdout);

  std::unique_ptr<offload::WorkerAgent> agent;
  if (!controller.empty()) {
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
        offload::MakeChannel(controller, security->tls);
    if (!channel.ok()) {
      LOG(ERROR) << "cpu_optimizer_server: " << channel.status();
      return 2;
    }
    offload::WorkerAgentOptions agent_options;
    agent_options.controller = controller;
    agent_options.channel = *channel;
    agent_options.token = security->client_token;
    const std::string hostname = offload::ThisHostName();
    const std::string address = AdvertiseAddress(server_options.listen_address, (*server)->port());
    agent_options.info.set_kind(offload::v1::WORKER_KIND_OPTIMIZER_SERVER);
    agent_options.info.set_name(absl::StrCat(hostname, ":", getpid()));
    agent_options.info.set_address(address);
    agent_options.info.set_hostname(hostname);
    offload::WorkerHooks hooks;
    hooks.start = [&admissions](const offload::v1::Assignment& a) { admissions.Start(a); };
    hooks.stop = [&admissions](const offload::v1::AttemptRef& ref) { admissions.Stop(ref); };
    absl::StatusOr<std::unique_ptr<offload::WorkerAgent>> started =
        offload::WorkerAgent::Start(std::move(agent_options), std::move(hooks));
    if (!started.ok()) {
      LOG(ERROR) << absl::StrFormat("cpu_optimizer_server: joining the pool of controller %s: %s",
                                    controller.c_str(), started.status().ToString().c_str());
      (*server)->Shutdown();
      return 1;
    }
    agent = *std::move(started);
    LOG(INFO) << absl::StrFormat(
        "cpu_optimizer_server joined controller %s as worker %s (address %s)", controller.c_str(),
        agent->worker_id().c_str(), address.c_str());
  }

  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::printf("cpu_optimizer_server shutting down\n");
  // The agent first: its hooks use the admissions and the store, which outlive it.
  agent.reset();
  (*server)->Shutdown();
  return 0;
}
