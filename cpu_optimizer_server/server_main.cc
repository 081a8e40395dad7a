// cpu_optimizer_server: serves offload.v1.OptimizerShard for the jobs assigned to this shard.
#include <csignal>
#include <cstdio>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "cpu_optimizer_server/adam_kernel.h"
#include "cpu_optimizer_server/host_buffer.h"
#include "cpu_optimizer_server/optimizer_service.h"
#include "cpu_optimizer_server/shard_store.h"
#include "cpu_optimizer_server/thread_pool.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "address to serve on (host:port; port 0 picks a free one, printed at start)");
ABSL_FLAG(bool, shm, true,
          "offer the shared-memory data plane to trainers that prove they share this host");
ABSL_FLAG(bool, ucx, true, "offer the UCX data plane (where the build has UCX; UCX_TLS applies)");
ABSL_FLAG(int, threads, 0, "Adam worker threads; 0 = one per core this process may use");
ABSL_FLAG(bool, pin_threads, false, "pin each Adam worker to one core");
ABSL_FLAG(std::string, simd, "auto", "Adam kernel path: auto, scalar, avx2 or avx512");
ABSL_FLAG(int64_t, memory_limit_mib, 16384,
          "optimizer state, accumulators and gradients in flight may hold at most this much");
ABSL_FLAG(int64_t, max_message_mib, 64, "largest gRPC message accepted or sent");
ABSL_FLAG(int64_t, wave_elements, int64_t{2} << 20,
          "parameters per chunk streamed back after a commit (Adam runs wave by wave)");

namespace {

volatile std::sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Serves the fp32 optimizer state of training jobs over gRPC.");
  absl::ParseCommandLine(argc, argv);
  offload::KeepFreedMemoryForReuse();

  absl::StatusOr<offload::SimdPath> path = offload::ParseSimdPath(absl::GetFlag(FLAGS_simd));
  if (!path.ok()) {
    std::fprintf(stderr, "cpu_optimizer_server: --simd: %s\n", path.status().ToString().c_str());
    return 2;
  }
  offload::ThreadPool::Options pool_options;
  pool_options.num_threads = absl::GetFlag(FLAGS_threads);
  pool_options.pin = absl::GetFlag(FLAGS_pin_threads);
  offload::ThreadPool pool(pool_options);
  offload::ShardOptions shard_options;
  shard_options.memory_limit_bytes = absl::GetFlag(FLAGS_memory_limit_mib) << 20;
  shard_options.wave_elements = absl::GetFlag(FLAGS_wave_elements);
  offload::ShardStore store(shard_options, &pool, *path);

  offload::ServerOptions server_options;
  server_options.listen_address = absl::GetFlag(FLAGS_listen);
  server_options.max_message_bytes = absl::GetFlag(FLAGS_max_message_mib) << 20;
  server_options.enable_shm = absl::GetFlag(FLAGS_shm);
  server_options.enable_ucx = absl::GetFlag(FLAGS_ucx);
  absl::StatusOr<std::unique_ptr<offload::OptimizerServer>> server =
      offload::OptimizerServer::Start(server_options, &store);
  if (!server.ok()) {
    std::fprintf(stderr, "cpu_optimizer_server: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::printf("cpu_optimizer_server listening port=%d simd=%s threads=%d memory_limit_mib=%lld\n",
              (*server)->port(), std::string(offload::SimdPathName(*path)).c_str(),
              pool.num_threads(), static_cast<long long>(absl::GetFlag(FLAGS_memory_limit_mib)));
  std::fflush(stdout);

  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::printf("cpu_optimizer_server shutting down\n");
  (*server)->Shutdown();
  return 0;
}
