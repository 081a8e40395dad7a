// bench_scaling: training throughput of W data-parallel trainer ranks against one, each run a
// real job on loopback started by offload_local (S optimizer servers, W gpu_trainer processes
// meeting over Gloo). Each rank gets the same share of the cores and the same per-rank batch in
// every row, so efficiency = tokens_per_s(W) / (W * tokens_per_s(1)) is what the collectives and
// the shared shards cost, not the cores the ranks would have to share on a small machine.
//
// With --zero_stages=2,3 every world size runs under both ZeRO stages, and each stage-3 row says
// its step time against the stage-2 row of the same W, measured in the same run: what gathering
// each layer before use costs once the prefetch has hidden what it can.
//
// Steps are timed between two progress lines the trainer prints (after a warm-up), as the
// launcher forwards them, so start-up, evaluation and the checkpoint are not counted.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "services/spawn/child_process.h"

ABSL_FLAG(std::string, launcher, "", "offload_local; empty: the one in this build tree");
ABSL_FLAG(std::string, data, std::string(OFFLOAD_SOURCE_DIR) + "/data/tinyshakespeare.txt",
          "training text");
ABSL_FLAG(std::string, ranks, "1,2", "world sizes to run, comma separated");
ABSL_FLAG(int, shards, 2, "optimizer servers of every run");
ABSL_FLAG(int, rank_batch, 8, "sequences per rank per step (the global batch grows with W)");
ABSL_FLAG(int, seq_len, 128, "tokens per sequence");
ABSL_FLAG(std::string, model_args, "--model=demo", "model flags for gpu_trainer");
ABSL_FLAG(int, warmup, 5, "untimed steps first");
ABSL_FLAG(int, steps, 30, "timed steps");
ABSL_FLAG(int, threads_per_rank, 0,
          "OpenMP/BLAS threads of each rank; 0: the cores divided by the largest W");
ABSL_FLAG(std::string, trainer_args, "--transport=auto", "more flags for every rank");
ABSL_FLAG(std::string, zero_stages, "2", "ZeRO stages to run at every world size, comma separated");

namespace {

struct Run {
  bool ok = false;
  double tokens_per_s = 0;
  double step_s = 0;
  std::string error;
};

// Runs one job and times steps warmup..warmup+steps from rank 0's progress lines.
Run RunJob(int ranks, int zero_stage, int threads) {
  const int warmup = absl::GetFlag(FLAGS_warmup);
  const int total = warmup + absl::GetFlag(FLAGS_steps);
  const int batch = ranks * absl::GetFlag(FLAGS_rank_batch);
  const int seq_len = absl::GetFlag(FLAGS_seq_len);
  std::string launcher = absl::GetFlag(FLAGS_launcher);
  if (launcher.empty()) launcher = offload::BesideThisExecutable("offload_local");
  const std::string command = absl::StrCat(
      "OMP_NUM_THREADS=", threads, " OPENBLAS_NUM_THREADS=", threads, " ", launcher,
      " --controller=none --shards=", absl::GetFlag(FLAGS_shards), " --ranks=", ranks,
      " --server_args='--threads=", threads, "' -- --data=", absl::GetFlag(FLAGS_data), " ",
      absl::GetFlag(FLAGS_model_args), " --batch=", batch, " --seq_len=", seq_len,
      " --steps=", total, " --progress=log --log_every=1 --eval_every=0 --eval_batches=1",
      " --sample_tokens=0 --warmup_steps=2 --zero_stage=", zero_stage, " ",
      absl::GetFlag(FLAGS_trainer_args), " 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  Run run;
  if (pipe == nullptr) {
    run.error = "popen failed";
    return run;
  }
  absl::Time first, last;
  char line[4096];
  std::string tail;
  while (std::fgets(line, sizeof(line), pipe) != nullptr) {
    const absl::Time now = absl::Now();
    tail = line;
    int step = 0;
    if (std::sscanf(line, "step %d/", &step) != 1) continue;
    if (step == warmup) first = now;
    if (step == total) last = now;
  }
  const int status = pclose(pipe);
  if (status != 0 || last <= first) {
    run.error = absl::StrCat("the job failed (status ", status, "): ", tail);
    return run;
  }
  run.ok = true;
  run.step_s = absl::ToDoubleSeconds(last - first) / (total - warmup);
  run.tokens_per_s = static_cast<double>(batch) * seq_len / run.step_s;
  return run;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::vector<int> world_sizes;
  for (absl::string_view w : absl::StrSplit(absl::GetFlag(FLAGS_ranks), ',')) {
    int v = 0;
    if (!absl::SimpleAtoi(w, &v) || v < 1) {
      std::fprintf(stderr, "bench_scaling: bad --ranks entry '%s'\n", std::string(w).c_str());
      return 2;
    }
    world_sizes.push_back(v);
  }
  std::vector<int> stages;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_zero_stages), ',')) {
    int v = 0;
    if (!absl::SimpleAtoi(s, &v) || (v != 2 && v != 3)) {
      std::fprintf(stderr, "bench_scaling: bad --zero_stages entry '%s' (2 or 3)\n",
                   std::string(s).c_str());
      return 2;
    }
    stages.push_back(v);
  }
  const int max_w = *std::max_element(world_sizes.begin(), world_sizes.end());
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int threads = absl::GetFlag(FLAGS_threads_per_rank);
  if (threads <= 0) threads = std::max(1, cores / max_w);
  std::printf(
      "# bench_scaling: %d cores, %d thread(s) per rank and per server, %d shard(s), "
      "%d sequences x %d tokens per rank per step, %s, %d timed steps\n",
      cores, threads, absl::GetFlag(FLAGS_shards), absl::GetFlag(FLAGS_rank_batch),
      absl::GetFlag(FLAGS_seq_len), absl::GetFlag(FLAGS_model_args).c_str(),
      absl::GetFlag(FLAGS_steps));
  double base[4] = {};  // tokens_per_s at W=1, by stage
  int failures = 0;
  for (int w : world_sizes) {
    double stage2_step_s = 0;
    for (int stage : stages) {
      const Run run = RunJob(w, stage, threads);
      if (!run.ok) {
        std::printf("scaling ranks=%d zero_stage=%d shards=%d failed: %s", w, stage,
                    absl::GetFlag(FLAGS_shards), run.error.c_str());
        ++failures;
        continue;
      }
      if (w == 1) base[stage] = run.tokens_per_s;
      if (stage == 2) stage2_step_s = run.step_s;
      const std::string efficiency =
          base[stage] > 0 ? absl::StrFormat("%.3f", run.tokens_per_s / (w * base[stage])) : "n/a";
      const std::string vs_stage2 =
          stage == 3 && stage2_step_s > 0
              ? absl::StrFormat(" step_vs_stage2=%.3f", run.step_s / stage2_step_s)
              : "";
      std::printf(
          "scaling ranks=%d zero_stage=%d shards=%d step_s=%.4f tokens_per_s=%.0f "
          "efficiency=%s%s\n",
          w, stage, absl::GetFlag(FLAGS_shards), run.step_s, run.tokens_per_s, efficiency.c_str(),
          vs_stage2.c_str());
      std::fflush(stdout);
    }
  }
  return failures == 0 ? 0 : 1;
}
