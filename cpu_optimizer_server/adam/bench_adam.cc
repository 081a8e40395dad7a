// Adam kernel throughput vs its memory roofline, in one process (ARCHITECTURE.md section 9); with
// --state_dir, the disk tier's Adam pass vs the disk's bound for the same I/O (section 2).
//
// For every requested SIMD path x gradient dtype {fp16, bf16} x thread count, the fused pass
// (16-bit grad in -> fp32 p, m, v updated -> 16-bit param copy out, same family as the grad) runs
// over n elements split into ThreadPool tiles by ForEachOwnedTile, on buffers first touched by
// the same tile owners. The roofline kernel (same loads and stores, one add per stream) runs
// alternately with it on the same buffers, so drift of the shared machine hits both alike. Each
// reports the BEST of --iters timed passes after one warm-up pass.
//
// With --state_dir=DIR only the disk comparison runs, on one pool of one thread per core: a full
// step (StepSession::Commit) of one fp16 job of n params whose state lives in a state file under
// DIR (the disk tier: O_DIRECT, io_uring, a ring of --state_memory_mib), the bound (the same
// bytes read and written back by a bare io_uring loop through a ring of the same slots, no
// compute), and the same step on a store in memory, interleaved per iteration so drift hits all
// three alike; each reports the best and the median of --iters timed passes after one warm-up,
// which also turns the preallocated files' unwritten extents (read as zeros without any I/O) into
// written ones. A dd-like O_DIRECT sequential write and read of the same bytes is the reference.
// --state_dtypes=fp32,bf16 there runs it all for each storage of the moments in turn (bf16: the
// job's moments and the bound's file in bf16).
//
//   bench_adam [--n=67108864] [--iters=10] [--scalar_iters=2] [--paths=scalar,avx2,avx512]
//              [--threads=1,2] [--state_dtypes=fp32,bf16]
//   bench_adam --state_dir=DIR [--n=67108864] [--iters=3] [--state_memory_mib=192]
//              [--wave_elements=2097152] [--state_dtypes=fp32,bf16]
#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "base/dtype.h"
#include "base/host_buffer.h"
#include "base/splitmix64.h"
#include "base/status_macros.h"
#include "base/thread_pool.h"
#include "cpu_optimizer_server/adam/adam_kernel.h"
#include "cpu_optimizer_server/adam/adam_roofline.h"
#include "cpu_optimizer_server/disk/disk_tier.h"
#include "cpu_optimizer_server/disk/io_ring.h"
#include "cpu_optimizer_server/disk/state_file.h"
#include "cpu_optimizer_server/shard/shard_store.h"
#include "cpu_optimizer_server/shard/state_loader.h"
#include "cpu_optimizer_server/shard/step_session.h"

namespace offload {
namespace {

struct Flags {
  int64_t n = int64_t{1} << 26;
  int iters = 10;
  int scalar_iters = 2;  // the scalar path is a correctness reference and slow
  std::vector<std::string> paths;
  std::vector<int> threads;
  std::vector<DType> state_dtypes = {DType::kFp32};  // the moments' storage
  bool iters_given = false;  // the disk mode's passes are seconds each: it defaults to fewer
  // Disk mode (the disk tier vs its bound) when state_dir is not empty.
  std::string state_dir;
  int64_t state_memory_mib = 192;
  int64_t wave_elements = int64_t{2} << 20;
};

void Usage() {
  std::fprintf(stderr,
               "usage: bench_adam [--n=N] [--iters=K] [--scalar_iters=K] "
               "[--paths=scalar,avx2,avx512] [--threads=1,2] [--state_dtypes=fp32,bf16]\n"
               "       bench_adam --state_dir=DIR [--n=N] [--iters=K (default 3)] "
               "[--state_memory_mib=192] [--wave_elements=2097152] [--state_dtypes=fp32,bf16]\n");
  std::exit(2);
}

bool ParseFlag(absl::string_view arg, absl::string_view name, absl::string_view* value) {
  if (!absl::ConsumePrefix(&arg, "--") || !absl::ConsumePrefix(&arg, name) ||
      !absl::ConsumePrefix(&arg, "=")) {
    return false;
  }
  *value = arg;
  return true;
}

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  const int cores = ThreadPool(ThreadPool::Options{}).num_threads();
  flags.threads = {1};
  if (cores > 1) flags.threads.push_back(cores);
  flags.paths = {"scalar", "avx2", "avx512"};
  for (int a = 1; a < argc; ++a) {
    absl::string_view v;
    if (ParseFlag(argv[a], "n", &v)) {
      if (!absl::SimpleAtoi(v, &flags.n) || flags.n <= 0) Usage();
    } else if (ParseFlag(argv[a], "iters", &v)) {
      if (!absl::SimpleAtoi(v, &flags.iters) || flags.iters <= 0) Usage();
      flags.iters_given = true;
    } else if (ParseFlag(argv[a], "scalar_iters", &v)) {
      if (!absl::SimpleAtoi(v, &flags.scalar_iters) || flags.scalar_iters <= 0) Usage();
    } else if (ParseFlag(argv[a], "paths", &v)) {
      flags.paths = absl::StrSplit(v, ',', absl::SkipEmpty());
    } else if (ParseFlag(argv[a], "threads", &v)) {
      flags.threads.clear();
      for (absl::string_view t : absl::StrSplit(v, ',', absl::SkipEmpty())) {
        int k;
        if (!absl::SimpleAtoi(t, &k) || k <= 0) Usage();
        flags.threads.push_back(k);
      }
    } else if (ParseFlag(argv[a], "state_dtypes", &v)) {
      flags.state_dtypes.clear();
      for (absl::string_view d : absl::StrSplit(v, ',', absl::SkipEmpty())) {
        if (d != "fp32" && d != "bf16") Usage();
        flags.state_dtypes.push_back(d == "bf16" ? DType::kBf16 : DType::kFp32);
      }
      if (flags.state_dtypes.empty()) Usage();
    } else if (ParseFlag(argv[a], "state_dir", &v)) {
      if (v.empty()) Usage();
      flags.state_dir = std::string(v);
    } else if (ParseFlag(argv[a], "state_memory_mib", &v)) {
      if (!absl::SimpleAtoi(v, &flags.state_memory_mib) || flags.state_memory_mib <= 0) Usage();
    } else if (ParseFlag(argv[a], "wave_elements", &v)) {
      if (!absl::SimpleAtoi(v, &flags.wave_elements) || flags.wave_elements <= 0) Usage();
    } else {
      Usage();
    }
  }
  if (!flags.state_dir.empty() && !flags.iters_given) flags.iters = 3;
  return flags;
}

double Best(std::vector<double> v) { return *std::min_element(v.begin(), v.end()); }
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t k = v.size() / 2;
  return v.size() % 2 == 1 ? v[k] : (v[k - 1] + v[k]) / 2;
}
double Worst(std::vector<double> v) { return *std::max_element(v.begin(), v.end()); }

void RunCases(const Flags& flags, int threads) {
  ThreadPool pool(ThreadPool::Options{threads, /*pin=*/true});
  const int nt = pool.num_threads();
  absl::StatusOr<std::unique_ptr<AdamRooflineBuffers>> buffers =
      AdamRooflineBuffers::Allocate(flags.n);
  if (!buffers.ok()) {
    std::fprintf(stderr, "bench_adam: %s\n", buffers.status().ToString().c_str());
    std::exit(1);
  }
  for (const DType state_dtype : flags.state_dtypes) {
    for (const DType grad_dtype : {DType::kFp16, DType::kBf16}) {
      // (Re)initialise with the tile-ownership rule: the first pass is also the first touch.
      (*buffers)->Fill(grad_dtype, pool, state_dtype);
      for (const std::string& name : flags.paths) {
        absl::StatusOr<SimdPath> path = ParseSimdPath(name);
        if (!path.ok()) {
          std::printf("# skip path=%s: %s\n", name.c_str(), path.status().ToString().c_str());
          continue;
        }
        const int iters = *path == SimdPath::kScalar ? flags.scalar_iters : flags.iters;
        const AdamVsRoofline best =
            MeasureAdamVsRoofline(**buffers, grad_dtype, *path, pool, iters, state_dtype);
        const double adam_rate = flags.n / best.adam_s * 1e-9;
        const double roofline_rate = flags.n / best.roofline_s * 1e-9;
        // The rates of the median pass and of the slowest and the fastest (the best-of rate).
        struct Spread {
          double median, min, max;
        };
        auto spread = [&](const std::vector<double>& passes) {
          return Spread{flags.n * 1e-9 / Median(passes), flags.n * 1e-9 / Worst(passes),
                        flags.n * 1e-9 / Best(passes)};
        };
        const Spread a = spread(best.adam_passes_s), r = spread(best.roofline_passes_s);
        std::printf(
            "adam path=%s grad=%s out=%s state=%s threads=%d n=%lld gparams_per_s=%.2f "
            "roofline_gparams_per_s=%.2f ratio=%.2f median_gparams_per_s=%.3f "
            "min_gparams_per_s=%.3f max_gparams_per_s=%.3f roofline_median_gparams_per_s=%.3f "
            "roofline_min_gparams_per_s=%.3f roofline_max_gparams_per_s=%.3f\n",
            std::string(SimdPathName(*path)).c_str(), std::string(DTypeName(grad_dtype)).c_str(),
            std::string(DTypeName(grad_dtype)).c_str(), std::string(DTypeName(state_dtype)).c_str(),
            nt, static_cast<long long>(flags.n), adam_rate, roofline_rate,
            adam_rate / roofline_rate, a.median, a.min, a.max, r.median, r.min, r.max);
        std::fflush(stdout);
      }
    }
  }
}

// ---- --state_dir: the disk tier's pass vs the disk's bound for the same I/O. ----

constexpr char kJob[] = "bench";

double SecondsSince(std::chrono::steady_clock::time_point begin) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
}

// Values in [-1, 1): cheap beside the disk, and never all zeros, so no layer below can shortcut
// a transfer of zero blocks. `state` carries on from call to call.
void FillUniform(uint64_t* state, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = SplitMix64Uniform(state);
}

// The commit's 16-bit parameters go nowhere: two wave buffers, handed out again and again.
class DiscardSink : public ParamSink {
 public:
  explicit DiscardSink(int64_t wave)
      : out_{std::vector<uint16_t>(wave), std::vector<uint16_t>(wave)} {}
  void* Buffer(int slot, int64_t, int64_t) override { return out_[slot].data(); }
  bool Send(int) override { return true; }

 private:
  std::vector<uint16_t> out_[2];
};

absl::Status Errno(const std::string& what, int err) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  return err == ENOSPC ? absl::ResourceExhaustedError(message)
                       : absl::FailedPreconditionError(message);
}

// A file the tier opened "O_DIRECT" silently falls back to the page cache where the file system
// refuses O_DIRECT: every figure would then measure memory, not the disk.
absl::Status CheckDirect(int fd, const std::string& path) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || (flags & O_DIRECT) == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(path,
                     " is not open with O_DIRECT (its file system refuses it): "
                     "--state_dir must be on a disk"));
  }
  return absl::OkStatus();
}

// Sequential O_DIRECT transfers of `bytes` (a multiple of kStateBlockBytes) at `fd` in blocks of
// `block` from/to `buf`, as dd with oflag=direct / iflag=direct.
absl::Status SequentialDirect(bool write, int fd, const std::string& path, void* buf, int64_t block,
                              int64_t bytes) {
  for (int64_t at = 0; at < bytes;) {
    const size_t want = static_cast<size_t>(std::min(block, bytes - at));
    const ssize_t got = write ? ::pwrite(fd, buf, want, at) : ::pread(fd, buf, want, at);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      return Errno(absl::StrCat(write ? "writing " : "reading ", path, " at ", at),
                   got == 0 ? EIO : errno);
    }
    // A short O_DIRECT transfer still ends on a block boundary (or fails).
    at += got;
  }
  return absl::OkStatus();
}

struct DdResult {
  double write_s = 0, read_s = 0;
};

// The reference: `bytes` written sequentially with O_DIRECT in 8 MiB blocks then fdatasync, then
// read back the same way. It runs first, so it is also what finds a directory without O_DIRECT
// or without room.
absl::StatusOr<DdResult> DdReference(const std::string& path, int64_t bytes) {
  constexpr int64_t kBlock = int64_t{8} << 20;
  OFFLOAD_ASSIGN_OR_RETURN(HostBuffer buf, HostBuffer::Allocate(kBlock));
  uint64_t seed = 7;
  FillUniform(&seed, static_cast<float*>(buf.data()), kBlock / 4);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int err = errno;
    if (err == EINVAL) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot open ", path,
                       " with O_DIRECT: its file system refuses it (tmpfs?); "
                       "--state_dir must be on a disk"));
    }
    return Errno(absl::StrCat("cannot create ", path), err);
  }
  DdResult r;
  absl::Status s;
  auto begin = std::chrono::steady_clock::now();
  s = SequentialDirect(/*write=*/true, fd, path, buf.data(), kBlock, bytes);
  if (s.ok() && ::fdatasync(fd) != 0) s = Errno(absl::StrCat("fdatasync ", path), errno);
  r.write_s = SecondsSince(begin);
  if (s.ok()) {
    begin = std::chrono::steady_clock::now();
    s = SequentialDirect(/*write=*/false, fd, path, buf.data(), kBlock, bytes);
    r.read_s = SecondsSince(begin);
  }
  ::close(fd);
  ::unlink(path.c_str());
  if (!s.ok()) return s;
  return r;
}

struct IoFigures {
  double seconds = 0;
  int64_t bytes_read = 0, bytes_written = 0;
  double wait_s = 0;  // the commit's thread blocked on the disk (disk tier only)
};

// The bound: the pass's I/O and nothing else. Waves of `wave` elements of the file's three
// tensors, each tensor's part one transfer of the size StatePass moves, go through `slots` slots
// of the same layout: read a wave into a free slot, write it back when its three reads land,
// reuse the slot for the next wave when its three writes land. All slots stay in flight.
absl::StatusOr<IoFigures> BoundPass(IoRing* io, const StateFile& file, int64_t wave, int slots,
                                    float* ring) {
  const int64_t length = file.length();
  const int64_t num_waves = (length + wave - 1) / wave;
  std::vector<int64_t> slot_wave(slots, -1);
  std::vector<int> slot_transfers(slots, 0);
  int64_t next = 0;
  IoFigures f;
  absl::Status error;
  // Queues slot s's three transfers of its wave (tag: slot, tensor, write).
  auto queue = [&](int s, bool write) -> absl::Status {
    const int64_t w = slot_wave[s];
    const int64_t elements = std::min(wave, length - w * wave);
    for (int t = 0; t < kStateTensors; ++t) {
      const int64_t bytes = StateRegionBytes(elements, file.ElementBytes(t));
      float* buf = ring + (int64_t{s} * kStateTensors + t) * wave;
      const int64_t offset = file.TensorOffset(t) + w * wave * file.ElementBytes(t);
      const uint64_t tag = static_cast<uint64_t>(s * kStateTensors + t) << 1 | (write ? 1 : 0);
      OFFLOAD_RETURN_IF_ERROR(write ? io->QueueWrite(file.direct_fd(), buf, bytes, offset, tag)
                                    : io->QueueRead(file.direct_fd(), buf, bytes, offset, tag));
      ++slot_transfers[s];
    }
    return absl::OkStatus();
  };
  const auto begin = std::chrono::steady_clock::now();
  for (int s = 0; s < slots && next < num_waves && error.ok(); ++s) {
    slot_wave[s] = next++;
    error = queue(s, /*write=*/false);
  }
  // Submitted even after an error: what was queued must reach the kernel to be reaped.
  absl::Status submitted = io->Submit();
  if (error.ok()) error = submitted;
  while (io->in_flight() > 0) {
    absl::StatusOr<IoRing::Completion> c = io->Wait();
    if (!c.ok()) return c.status();  // nothing more can be reaped
    if (!error.ok()) continue;       // drain what is in flight, then report
    const bool write = (c->tag & 1) != 0;
    const int s = static_cast<int>(c->tag >> 1) / kStateTensors;
    if (c->result != c->wanted) {
      error = c->result < 0 ? Errno(absl::StrCat(write ? "writing " : "reading ", file.path()),
                                    static_cast<int>(-c->result))
                            : absl::DataLossError(absl::StrCat("short transfer on ", file.path()));
      continue;
    }
    (write ? f.bytes_written : f.bytes_read) += c->result;
    if (--slot_transfers[s] > 0) continue;
    if (!write) {
      error = queue(s, /*write=*/true);
    } else if (next < num_waves) {
      slot_wave[s] = next++;
      error = queue(s, /*write=*/false);
    } else {
      continue;
    }
    submitted = io->Submit();
    if (error.ok()) error = submitted;
  }
  f.seconds = SecondsSince(begin);
  if (!error.ok()) return error;
  return f;
}

// The initial master weights, the same random values for every store, in 64 MiB chunks.
absl::Status LoadMaster(ShardStore* store, int64_t n) {
  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<StateLoader> loader, StateLoader::Start(store, kJob));
  constexpr int64_t kChunk = int64_t{1} << 24;
  uint64_t seed = 42;
  for (int64_t at = 0; at < n; at += kChunk) {
    const int64_t m = std::min(kChunk, n - at);
    std::string data(static_cast<size_t>(m) * 4, '\0');
    FillUniform(&seed, reinterpret_cast<float*>(data.data()), m);
    OFFLOAD_RETURN_IF_ERROR(
        loader->AddChunk(StateTensor::kMasterWeights, at, DType::kFp32, std::move(data)));
  }
  return loader->Apply().status();
}

// One full step of the job, gradients given in place as one chunk; times the Commit only.
absl::StatusOr<double> TimedStep(ShardStore* store, uint64_t step, const uint16_t* grads, int64_t n,
                                 ParamSink* sink) {
  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<StepSession> session,
                           StepSession::Open(store, kJob, 0, step));
  OFFLOAD_RETURN_IF_ERROR(session->AddGradientsView(0, DType::kFp16, grads, n));
  StepCommitArgs args;
  args.step = step;
  args.lr = 1e-4f;
  const auto begin = std::chrono::steady_clock::now();
  OFFLOAD_ASSIGN_OR_RETURN(StepOutcome outcome, session->Commit(args, sink));
  const double seconds = SecondsSince(begin);
  if (!outcome.applied) {
    return absl::InternalError(absl::StrCat("step ", step, " was not applied"));
  }
  return seconds;
}

absl::Status RunDisk(const Flags& flags, DType moments) {
  const int64_t n = flags.n;
  const int64_t pass_bytes = StateFileBytes(n, moments);  // read, then written back, by a pass
  const std::string& dir = flags.state_dir;

  // DIR is made if missing, and then removed again at the end if the bench left it empty.
  std::error_code ec;
  const bool made_dir = !std::filesystem::exists(dir, ec);
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot make --state_dir ", dir, ": ", ec.message()));
  }
  struct RemoveIfMade {
    const std::string& dir;
    bool made;
    ~RemoveIfMade() {
      std::error_code ignored;
      if (made) std::filesystem::remove(dir, ignored);  // only if empty
    }
  } remove_if_made{dir, made_dir};
  // At once on disk: the job's state file, the bound's file and the load's staging file (the
  // master weights); the dd file comes and goes before them.
  const int64_t need = 2 * pass_bytes + StateRegionBytes(n) + (int64_t{256} << 20);
  struct statvfs st;
  if (::statvfs(dir.c_str(), &st) != 0) return Errno(absl::StrCat("statvfs ", dir), errno);
  const int64_t free_bytes = static_cast<int64_t>(st.f_bavail) * static_cast<int64_t>(st.f_frsize);
  if (free_bytes < need) {
    return absl::ResourceExhaustedError(
        absl::StrCat(dir, " has ", free_bytes, " bytes free; --n=", n, " needs ", need,
                     " (a state file and the bound's file of ", pass_bytes,
                     " bytes each, and the load's staging file)"));
  }

  ThreadPool pool(ThreadPool::Options{});  // the server's default: one thread per core, unpinned
  DiskTierOptions tier_options;
  tier_options.state_dir = dir;
  tier_options.memory_bytes = flags.state_memory_mib << 20;
  tier_options.wave_elements = flags.wave_elements;
  // Sizes checked (too few slots fails here) before the seconds of the dd reference.
  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<DiskTier> tier, DiskTier::Open(tier_options));
  const int64_t wave = tier->wave_elements();
  const int slots = tier->slots();

  std::printf(
      "# bench_adam --state_dir: one fp16 job of n=%lld params, %s moments (%lld bytes of state "
      "per pass, read then written back), %d threads, %s, ring of %d slots x %lld elements x 3 "
      "tensors (%lld MiB). Per iteration, in turn: disk = StepSession::Commit of a full step "
      "with the state in a state file (O_DIRECT, io_uring); bound = the same bytes in the same "
      "per-tensor transfers through the same slots by a bare io_uring loop, no compute; memory = "
      "the same step on a store in memory. Best and median of %d timed iterations after 1 "
      "warm-up; dd = sequential O_DIRECT 8 MiB blocks (write + fdatasync, then read), once.\n",
      static_cast<long long>(n), std::string(DTypeName(moments)).c_str(),
      static_cast<long long>(pass_bytes), pool.num_threads(),
      std::string(SimdPathName(BestSimdPath())).c_str(), slots, static_cast<long long>(wave),
      static_cast<long long>(tier->ring_bytes() >> 20), flags.iters);
  std::fflush(stdout);

  OFFLOAD_ASSIGN_OR_RETURN(
      const DdResult dd,
      DdReference(absl::StrCat(dir, "/bench_adam-", ::getpid(), ".dd"), pass_bytes));

  ShardOptions disk_options;
  // Room for the in-memory job and its load's chunks; the disk job holds no state in memory.
  disk_options.memory_limit_bytes = 2 * pass_bytes + (int64_t{1} << 30);
  disk_options.wave_elements = wave;
  disk_options.state_on_disk = true;
  ShardStore disk_store(disk_options, &pool, BestSimdPath(), tier.get());
  ShardOptions memory_options = disk_options;
  memory_options.state_on_disk = false;
  ShardStore memory_store(memory_options, &pool, BestSimdPath());
  JobConfig config;
  config.job_id = kJob;
  config.ranges = {{0, n}};
  config.param_dtype = DType::kFp16;
  config.state_dtype = moments;
  for (ShardStore* store : {&disk_store, &memory_store}) {
    OFFLOAD_RETURN_IF_ERROR(store->CreateJob(config).status());
    OFFLOAD_RETURN_IF_ERROR(LoadMaster(store, n));
  }
  OFFLOAD_ASSIGN_OR_RETURN(ShardStore::JobRange disk_range, disk_store.FindJobRange(kJob, 0));
  OFFLOAD_ASSIGN_OR_RETURN(ShardStore::JobRange memory_range, memory_store.FindJobRange(kJob, 0));
  if (disk_range.range->file == nullptr || memory_range.range->file != nullptr) {
    return absl::InternalError("the jobs did not land on the disk and in memory as asked");
  }
  OFFLOAD_RETURN_IF_ERROR(
      CheckDirect(disk_range.range->file->direct_fd(), disk_range.range->file->path()));

  // The bound's own file, ring and io_uring, of the tier's shapes, beside the job's state file;
  // filled with random values so it moves the same kind of bytes.
  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<StateFile> bound_file,
                           StateFile::Create(absl::StrCat(tier->dir(), "/bound.state"), n,
                                             /*sparse=*/false, moments));
  OFFLOAD_RETURN_IF_ERROR(CheckDirect(bound_file->direct_fd(), bound_file->path()));
  OFFLOAD_ASSIGN_OR_RETURN(HostBuffer bound_ring, HostBuffer::Allocate(tier->ring_bytes()));
  auto* ring = static_cast<float*>(bound_ring.data());
  uint64_t ring_seed = 3;
  FillUniform(&ring_seed, ring, tier->ring_bytes() / 4);
  OFFLOAD_RETURN_IF_ERROR(SequentialDirect(/*write=*/true, bound_file->direct_fd(),
                                           bound_file->path(), ring, tier->ring_bytes(),
                                           pass_bytes));
  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<IoRing> io, IoRing::Create(slots * kStateTensors));

  // (n,) fp16 gradients, allocated and filled once, small enough that Adam stays finite.
  OFFLOAD_ASSIGN_OR_RETURN(HostBuffer grad_buffer, HostBuffer::Allocate(n * 2));
  auto* grads = static_cast<uint16_t*>(grad_buffer.data());
  uint64_t grad_seed = 5;
  for (int64_t i = 0; i < n; ++i) grads[i] = FloatToFp16(0.01f * SplitMix64Uniform(&grad_seed));
  DiscardSink sink(wave);

  std::vector<double> disk_s, bound_s, memory_s;
  IoFigures disk_best, bound_best;  // the figures of each one's fastest pass
  DiskTierCounters& counters = tier->counters();
  for (int it = 0; it <= flags.iters; ++it) {
    const bool timed = it > 0;  // iteration 0 is the warm-up
    const uint64_t step = static_cast<uint64_t>(it) + 1;
    IoFigures d;
    const int64_t read0 = counters.bytes_read.load(), written0 = counters.bytes_written.load();
    const int64_t wait0 = counters.wait_nanos.load();
    OFFLOAD_ASSIGN_OR_RETURN(d.seconds, TimedStep(&disk_store, step, grads, n, &sink));
    d.bytes_read = counters.bytes_read.load() - read0;
    d.bytes_written = counters.bytes_written.load() - written0;
    d.wait_s = (counters.wait_nanos.load() - wait0) * 1e-9;
    OFFLOAD_ASSIGN_OR_RETURN(const IoFigures b,
                             BoundPass(io.get(), *bound_file, wave, slots, ring));
    OFFLOAD_ASSIGN_OR_RETURN(const double m, TimedStep(&memory_store, step, grads, n, &sink));
    std::printf("# %s %d: disk %.3f s (waited on the disk %.3f s), bound %.3f s, memory %.3f s\n",
                timed ? "iteration" : "warm-up", it, d.seconds, d.wait_s, b.seconds, m);
    std::fflush(stdout);
    if (!timed) continue;
    if (disk_s.empty() || d.seconds < Best(disk_s)) disk_best = d;
    if (bound_s.empty() || b.seconds < Best(bound_s)) bound_best = b;
    disk_s.push_back(d.seconds);
    bound_s.push_back(b.seconds);
    memory_s.push_back(m);
  }

  const double dd_write_gbps = pass_bytes / dd.write_s * 1e-9;
  const double dd_read_gbps = pass_bytes / dd.read_s * 1e-9;
  auto gbps = [](const IoFigures& f) {
    return (f.bytes_read + f.bytes_written) / f.seconds * 1e-9;
  };
  std::printf("%-16s %9s %9s %9s %13s %13s %9s\n", "measurement", "best_s", "median_s", "GB/s",
              "bytes_read", "bytes_written", "wait_s");
  std::printf("%-16s %9.3f %9.3f %9.3f %13lld %13lld %9.3f\n", "disk-tier pass", Best(disk_s),
              Median(disk_s), gbps(disk_best), static_cast<long long>(disk_best.bytes_read),
              static_cast<long long>(disk_best.bytes_written), disk_best.wait_s);
  std::printf("%-16s %9.3f %9.3f %9.3f %13lld %13lld %9s\n", "bound (io_uring)", Best(bound_s),
              Median(bound_s), gbps(bound_best), static_cast<long long>(bound_best.bytes_read),
              static_cast<long long>(bound_best.bytes_written), "-");
  std::printf("%-16s %9.3f %9.3f %9s %13s %13s %9s\n", "in-memory pass", Best(memory_s),
              Median(memory_s), "-", "-", "-", "-");
  std::printf("%-16s %9.3f %9s %9.3f %13s %13lld %9s\n", "dd write+sync", dd.write_s, "-",
              dd_write_gbps, "-", static_cast<long long>(pass_bytes), "-");
  std::printf("%-16s %9.3f %9s %9.3f %13lld %13s %9s\n", "dd read", dd.read_s, "-", dd_read_gbps,
              static_cast<long long>(pass_bytes), "-", "-");
  std::printf(
      "adam_disk n=%lld state_dtype=%s state_gb=%.3f slots=%d wave=%lld pass_s=%.3f "
      "pass_s_median=%.3f pass_gbps=%.3f bound_s=%.3f bound_gbps=%.3f ratio_to_bound=%.3f "
      "memory_pass_s=%.3f ratio_to_memory=%.3f dd_write_gbps=%.3f dd_read_gbps=%.3f\n",
      static_cast<long long>(n), std::string(DTypeName(moments)).c_str(),
      StateBytesPerElement(moments) * n * 1e-9, slots, static_cast<long long>(wave), Best(disk_s),
      Median(disk_s), gbps(disk_best), Best(bound_s), gbps(bound_best),
      Best(bound_s) / Best(disk_s), Best(memory_s), Best(memory_s) / Best(disk_s), dd_write_gbps,
      dd_read_gbps);
  std::fflush(stdout);
  return absl::OkStatus();
}

}  // namespace
}  // namespace offload

int main(int argc, char** argv) {
  const offload::Flags flags = offload::ParseFlags(argc, argv);
  if (!flags.state_dir.empty()) {
    for (const offload::DType moments : flags.state_dtypes) {
      const absl::Status s = offload::RunDisk(flags, moments);
      if (!s.ok()) {
        std::fprintf(stderr, "bench_adam: --state_dir=%s: %s\n", flags.state_dir.c_str(),
                     s.ToString().c_str());
        return 1;
      }
    }
    return 0;
  }
  std::printf(
      "# bench_adam: best of --iters=%d passes (scalar: %d) after 1 warm-up; adam and "
      "roofline alternate in the same process; best path on this CPU: %s\n",
      flags.iters, flags.scalar_iters,
      std::string(offload::SimdPathName(offload::BestSimdPath())).c_str());
  for (const int threads : flags.threads) offload::RunCases(flags, threads);
  return 0;
}
