// offload_transport_peer: a minimal trainer rank for the cross-process data-plane tests
// (tests/transport_kill_test.sh). It steps one range of one job on a real cpu_optimizer_server
// through the chosen data plane, and can stop half-way through a step's gradients so that the
// test can kill either side at a known point of the exchange.
//
//   offload_transport_peer --address=127.0.0.1:PORT --transport=shm --steps=3
//
// Each run continues the job where the shard left it: the job is created and loaded on first use,
// and the first step is the range's completed_step + 1 (DescribeShard). Output, one line each:
//   peer transport=shm
//   peer mid-exchange step=K        (with --pause_mid_step_ms, before the pause)
//   peer step=K applied=1 adam_step=A
// An error ends the run with exit status 1 and `offload_transport_peer: ...: <status>` on stderr;
// exit status 77 means the plane is not in this build.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/security/security.h"
#include "base/status_macros.h"
#include "cpu_optimizer_server/grpc/shard_client.h"
#include "cpu_optimizer_server/shm/shm_transport.h"
#include "cpu_optimizer_server/tools/range_driver.h"
#include "cpu_optimizer_server/transport/step_transport.h"
#ifdef OFFLOAD_HAVE_UCX
#include "cpu_optimizer_server/ucx/ucx_transport.h"
#endif

ABSL_FLAG(std::string, address, "127.0.0.1:50051", "the shard (host:port)");
ABSL_FLAG(std::string, transport, "grpc", "data plane: grpc, shm or ucx (UCX_TLS applies)");
ABSL_FLAG(std::string, job, "peer", "job id");
ABSL_FLAG(int64_t, n, int64_t{1} << 20, "parameters in the job's one range");
ABSL_FLAG(int, steps, 1, "steps to run");
ABSL_FLAG(absl::Duration, step_timeout_floor, absl::Seconds(60),
          "the least a wait inside a step may take before the shard is hung (ClientOptions)");
ABSL_FLAG(int, pause_mid_step_ms, 0,
          "in the first step, after half of the gradients: print 'peer mid-exchange' and sleep "
          "this long before sending the rest and committing");
ABSL_FLAG(int, lease_wait_s, 15,
          "how long to retry a step whose range is still leased (ABORTED) to a stream the shard "
          "has not yet seen end, e.g. that of a killed peer");

namespace offload {
namespace {

int Fail(const char* what, const absl::Status& status) {
  std::fprintf(stderr, "offload_transport_peer: %s: %s\n", what, status.ToString().c_str());
  return 1;
}

absl::StatusOr<std::unique_ptr<StepTransport>> MakeTransport(const std::string& kind,
                                                             ShardClient* client) {
  if (kind == "shm") {
    OFFLOAD_RETURN_IF_ERROR(ProbeShm(client));
    return CreateShmTransport(client);
  }
  if (kind == "ucx") {
#ifdef OFFLOAD_HAVE_UCX
    OFFLOAD_RETURN_IF_ERROR(ProbeUcx(client));
    return CreateUcxTransport(client);
#else
    return absl::UnimplementedError("this build has no UCX");
#endif
  }
  return absl::InvalidArgumentError("--transport must be grpc, shm or ucx, not " + kind);
}

// One step: half the gradients, the optional pause, the other half, the commit.
absl::StatusOr<v1::StepResult> Step(StepTransport* transport, const std::string& job, int64_t n,
                                    uint64_t step, const std::vector<uint16_t>& grads,
                                    std::vector<uint16_t>* params, int pause_ms) {
  auto stream = transport->OpenStep(job, 0, 0, n, step);
  if (!stream.ok()) return stream.status();
  const int64_t half = n / 2;
  OFFLOAD_RETURN_IF_ERROR((*stream)->SendGradients(0, grads.data(), DType::kFp16, half));
  if (pause_ms > 0) {
    std::printf("peer mid-exchange step=%llu\n", static_cast<unsigned long long>(step));
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
  }
  OFFLOAD_RETURN_IF_ERROR(
      (*stream)->SendGradients(half, grads.data() + half, DType::kFp16, n - half));
  return (*stream)->Commit(1e-4f, 1.0f, false, params->data());
}

int Run() {
  const std::string job = absl::GetFlag(FLAGS_job);
  const int64_t n = absl::GetFlag(FLAGS_n);
  const std::string kind = absl::GetFlag(FLAGS_transport);
#ifndef OFFLOAD_HAVE_UCX
  if (kind == "ucx") {
    std::printf("peer transport=ucx not in this build\n");
    return 77;
  }
#endif
  ClientOptions options;
  options.address = absl::GetFlag(FLAGS_address);
  // A standalone server's token, as the process tests hand it to their clients (shard_access.h).
  if (const char* token = std::getenv(kShardTokenEnv); token != nullptr) options.token = token;
  // A dead shard must end the run within the test's bound, whatever the plane.
  options.connect_timeout = absl::Seconds(5);
  options.call_timeout = absl::Seconds(60);
  options.step_timeout_floor = absl::GetFlag(FLAGS_step_timeout_floor);
  auto client = ShardClient::Connect(options);
  if (!client.ok()) return Fail("connect", client.status());

  // The job: created and loaded by the first peer, found by later ones.
  AdamHyperParams adam;
  adam.lr = 1e-4f;
  auto created = (*client)->CreateJob(MakeCreateJobRequest(job, {{0, n}}, adam, DType::kFp16));
  if (created.ok()) {
    std::vector<float> weights(n);
    for (int64_t i = 0; i < n; ++i) weights[i] = static_cast<float>(i % 1000) * 1e-3f - 0.5f;
    if (absl::Status s =
            (*client)->LoadState(job, v1::STATE_TENSOR_MASTER_WEIGHTS, 0, weights.data(), n);
        !s.ok()) {
      return Fail("load", s);
    }
  } else if (created.status().code() != absl::StatusCode::kAlreadyExists) {
    return Fail("create job", created.status());
  }
  auto describe = (*client)->DescribeShard();
  if (!describe.ok()) return Fail("describe", describe.status());
  uint64_t next = 0;
  for (const v1::JobStatus& j : describe->jobs()) {
    if (j.job_id() == job && j.ranges_size() == 1) next = j.ranges(0).completed_step() + 1;
  }
  if (next == 0) return Fail("describe", absl::NotFoundError("job " + job + " not on the shard"));

  std::unique_ptr<StepTransport> owned;
  StepTransport* transport = client->get();
  if (kind != "grpc") {
    auto t = MakeTransport(kind, client->get());
    if (!t.ok()) return Fail("attach", t.status());
    owned = *std::move(t);
    transport = owned.get();
  }
  std::printf("peer transport=%s\n", std::string(transport->name()).c_str());
  std::fflush(stdout);

  std::vector<uint16_t> grads(n), params(n);
  for (int64_t i = 0; i < n; ++i) grads[i] = FloatToFp16(static_cast<float>(i % 7) * 1e-3f);
  int pause_ms = absl::GetFlag(FLAGS_pause_mid_step_ms);
  for (int k = 0; k < absl::GetFlag(FLAGS_steps); ++k, ++next) {
    const absl::Time give_up = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_lease_wait_s));
    absl::StatusOr<v1::StepResult> result;
    while (true) {
      result = Step(transport, job, n, next, grads, &params, pause_ms);
      if (result.status().code() != absl::StatusCode::kAborted || absl::Now() > give_up) break;
      absl::SleepFor(absl::Milliseconds(50));
    }
    pause_ms = 0;
    if (!result.ok()) {
      return Fail(("step " + std::to_string(next)).c_str(), result.status());
    }
    std::printf("peer step=%llu applied=%d adam_step=%llu\n",
                static_cast<unsigned long long>(result->step()), result->applied() ? 1 : 0,
                static_cast<unsigned long long>(result->adam_step()));
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace offload

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return offload::Run();
}
