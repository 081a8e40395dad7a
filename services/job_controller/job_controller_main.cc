// job_controller: the job API (gRPC JobService and its REST mapping), the worker pool
// (WorkerService) and the durable job store, in one process (ARCHITECTURE.md section 7).
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/logging.h"
#include "base/metrics/metrics.h"
#include "base/metrics/metrics_flags.h"
#include "base/security/security.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "services/job_controller/controller_metrics.h"
#include "services/job_controller/grpc_services.h"
#include "services/job_controller/job_controller.h"
#include "services/job_controller/job_store.h"
#include "services/job_controller/rest_gateway.h"

ABSL_FLAG(std::string, grpc_address, "0.0.0.0:7070",
          "host:port of the gRPC JobService and WorkerService (port 0 picks a free one)");
ABSL_FLAG(std::string, http_address, "0.0.0.0:8080",
          "host:port of the REST API (port 0 picks a free one); empty: no REST");
ABSL_FLAG(std::string, store, "job_controller.db",
          "the SQLite job store (created if missing; WAL mode, so keep its -wal file beside it)");
ABSL_FLAG(absl::Duration, heartbeat_interval, absl::Seconds(1),
          "how often workers heartbeat and the controller checks them");
ABSL_FLAG(std::string, tenants_file, "",
          "the tenants, their tokens, weights and quotas (JSON; ARCHITECTURE.md section 7), read "
          "again whenever it changes; empty: every token of --token_file is the operator's");
ABSL_FLAG(absl::Duration, heartbeat_timeout, absl::Seconds(10),
          "a worker without a heartbeat for this long is dead and its job attempt fails");

namespace {

// Requests are job specs and small control messages; rendezvous values are a few addresses.
constexpr int kMaxReceiveMessageBytes = 4 << 20;

volatile std::sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }

// "host:port" or "[v6]:port".
bool SplitHostPort(const std::string& address, std::string* host, int* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), port) ||
      *port < 0 || *port > 65535) {
    return false;
  }
  *host = address.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  return !host->empty();
}

int Fail(const std::string& what) {
  LOG(ERROR) << absl::StrFormat("job_controller: %s", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  offload::InitLogging(argv[0]);
  absl::SetProgramUsageMessage(
      "Serves the job API (gRPC and REST), the worker pool and the durable job store.");
  absl::ParseCommandLine(argc, argv);

  absl::StatusOr<offload::SecurityOptions> security = offload::SecurityFromFlags();
  if (!security.ok()) return Fail(std::string(security.status().message()));
  const std::string tenants_file = absl::GetFlag(FLAGS_tenants_file);
  if (tenants_file.empty()) {
    if (absl::Status s = offload::RequireTokens(*security); !s.ok()) {
      return Fail(std::string(s.message()));
    }
  } else if (security->accepted.empty() && !security->allow_unauthenticated) {
    // Tenants without an operator token: no worker could register with the pool.
    return Fail(
        "--tenants_file needs the operator's --token_file (or $OFFLOAD_TOKEN) too: pool "
        "workers present it");
  }
  absl::StatusOr<std::unique_ptr<offload::Identities>> identities =
      offload::Identities::Create(security->accepted, tenants_file);
  if (!identities.ok()) return Fail(identities.status().ToString());

  const std::string store_path = absl::GetFlag(FLAGS_store);
  absl::StatusOr<std::unique_ptr<offload::JobStore>> store = offload::JobStore::Open(store_path);
  if (!store.ok()) return Fail(store.status().ToString());

  offload::JobControllerOptions options;
  options.store = store->get();
  options.heartbeat_interval = absl::GetFlag(FLAGS_heartbeat_interval);
  options.heartbeat_timeout = absl::GetFlag(FLAGS_heartbeat_timeout);
  options.identities = identities->get();
  absl::StatusOr<std::unique_ptr<offload::JobController>> controller =
      offload::JobController::Create(options);
  if (!controller.ok()) return Fail(controller.status().ToString());
  absl::StatusOr<std::unique_ptr<offload::MetricsServer>> metrics =
      offload::StartMetricsServerIfAsked(absl::GetFlag(FLAGS_metrics_address), "job_controller");
  if (!metrics.ok()) return Fail(metrics.status().ToString());
  if (*metrics != nullptr) {
    (*metrics)->Add(offload::MakeControllerCollector(controller->get(), identities->get()));
  }

  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      offload::MakeServerCredentials(security->tls);
  if (!credentials.ok()) return Fail(credentials.status().ToString());
  offload::JobServiceImpl job_service(controller->get(), identities->get());
  offload::WorkerServiceImpl worker_service(controller->get(), &security->accepted);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const std::string grpc_address = absl::GetFlag(FLAGS_grpc_address);
  int grpc_port = 0;
  builder.AddListeningPort(grpc_address, *credentials, &grpc_port);
  builder.SetMaxReceiveMessageSize(kMaxReceiveMessageBytes);
  builder.RegisterService(&job_service);
  builder.RegisterService(&worker_service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || grpc_port == 0) {
    return Fail(absl::StrCat("cannot listen on --grpc_address=", grpc_address,
                             " (address in use, or not an address of this host)"));
  }

  std::unique_ptr<offload::RestGateway> rest;
  std::string http_shown = "off";
  const std::string http_address = absl::GetFlag(FLAGS_http_address);
  if (!http_address.empty()) {
    offload::RestOptions rest_options;
    if (!SplitHostPort(http_address, &rest_options.host, &rest_options.port)) {
      return Fail(absl::StrCat("--http_address=", http_address, ": expected host:port"));
    }
    rest_options.tls = security->tls;
    absl::StatusOr<std::unique_ptr<offload::RestGateway>> gateway =
        offload::RestGateway::Start(controller->get(), identities->get(), rest_options);
    if (!gateway.ok()) return Fail(gateway.status().ToString());
    rest = *std::move(gateway);
    http_shown = absl::StrCat(http_address.substr(0, http_address.rfind(':')), ":", rest->port());
  }

  std::printf("job_controller: grpc %s:%d http %s store %s\n",
              grpc_address.substr(0, grpc_address.rfind(':')).c_str(), grpc_port,
              http_shown.c_str(), store_path.c_str());
  std::fflush(stdout);

  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  absl::Time next_tick = absl::Now();
  while (!g_stop) {
    if (absl::Now() >= next_tick) {
      // Before the tick: a revoked token is refused, and new quotas apply, from this tick on.
      if (absl::StatusOr<bool> reloaded = (*identities)->Reload(); !reloaded.ok()) {
        LOG(ERROR) << absl::StrFormat("job_controller: %s (the last good tenants stay in use)",
                                      reloaded.status().ToString().c_str());
      } else if (*reloaded) {
        LOG(INFO) << absl::StrFormat("job_controller: tenants file %s reloaded",
                                     tenants_file.c_str());
      }
      if (absl::Status s = (*controller)->Tick(); !s.ok()) {
        LOG(ERROR) << absl::StrFormat("job_controller: %s", s.ToString().c_str());
      }
      next_tick = absl::Now() + options.heartbeat_interval;
    }
    absl::SleepFor(std::min(absl::Milliseconds(100), options.heartbeat_interval));
  }
  std::printf("job_controller: shutting down\n");
  std::fflush(stdout);
  rest.reset();
  (*controller)->Shutdown();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  server->Wait();
  return 0;
}
