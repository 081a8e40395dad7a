#include "gpu_trainer/cuda/nccl/nccl_collectives.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <numeric>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "gloo/rendezvous/store.h"
#include "gpu_trainer/collectives/gloo_collectives.h"
#include "gpu_trainer/cuda/runtime/cuda_check.h"

namespace offload {
namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point DeadlineAfter(absl::Duration timeout) {
  return Clock::now() + absl::ToChronoNanoseconds(timeout);
}

// An NCCL result as a Status: the caller's misuse is INVALID_ARGUMENT, everything else (a peer
// gone, a network or CUDA error inside NCCL) UNAVAILABLE, with NCCL's own last words.
absl::Status NcclStatus(ncclResult_t result, ncclComm_t comm, absl::string_view what) {
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  const std::string message =
      absl::StrCat(what, ": ", ncclGetErrorString(result),
                   last != nullptr && *last != '\0' ? absl::StrCat(" (", last, ")") : "");
  if (result == ncclInvalidArgument || result == ncclInvalidUsage) {
    return absl::InvalidArgumentError(message);
  }
  return absl::UnavailableError(message);
}

// Polls a non-blocking communicator until it has left ncclInProgress (set-up, a split, a
// finalize), or the deadline passes (DEADLINE_EXCEEDED).
absl::Status AwaitReady(ncclComm_t comm, Clock::time_point deadline, absl::string_view what,
                        absl::Duration timeout) {
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return NcclStatus(r, comm, what);
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return NcclStatus(state, comm, what);
    if (Clock::now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          what, ": the other ranks did not answer within ", absl::FormatDuration(timeout)));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

// A non-blocking communicator's call was taken (ncclInProgress: queued, AwaitReady waits for it).
bool Taken(ncclResult_t r) { return r == ncclSuccess || r == ncclInProgress; }

absl::Status Queued(ncclResult_t r, ncclComm_t comm, absl::string_view what) {
  return Taken(r) ? absl::OkStatus() : NcclStatus(r, comm, what);
}

// A communicator just made (by init or split, call result r) once it is ready, with a stream of
// its own; aborted on any failure.
absl::StatusOr<cudaStream_t> StreamOnceReady(ncclComm_t comm, ncclResult_t r,
                                             const std::string& what, absl::Duration timeout) {
  absl::Status s = Queued(r, comm, what);
  if (s.ok() && comm == nullptr) s = absl::InternalError(absl::StrCat(what, ": no communicator"));
  if (s.ok()) s = AwaitReady(comm, DeadlineAfter(timeout), what, timeout);
  cudaStream_t stream = nullptr;
  if (s.ok()) {
    const cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) s = CudaErrorStatus(e, "cudaStreamCreateWithFlags", __FILE__, __LINE__);
  }
  if (!s.ok()) {
    if (comm != nullptr) ncclCommAbort(comm);
    return s;
  }
  return stream;
}

absl::Status CheckCounts(const std::vector<int64_t>& counts, int world_size,
                         absl::string_view what) {
  if (static_cast<int>(counts.size()) != world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", counts.size(), " counts for ", world_size, " ranks"));
  }
  for (int64_t c : counts) {
    if (c < 0) return absl::InvalidArgumentError(absl::StrCat(what, ": a count is negative"));
  }
  return absl::OkStatus();
}

// The host-memory operations' device staging buffer at most (Broadcast goes in pieces).
constexpr int64_t kMaxStagingBytes = int64_t{64} << 20;

class NcclCollectives final : public Collectives {
 public:
  NcclCollectives(const NcclOptions& options, ncclComm_t comm, cudaStream_t stream,
                  std::string name)
      : options_(options), comm_(comm), stream_(stream), name_(std::move(name)) {}

  ~NcclCollectives() override {
    cudaSetDevice(options_.cuda_device);
    if (comm_ != nullptr) {
      // Flushes what was issued; a peer that is gone makes it hang, so it is bounded too.
      const ncclResult_t r = ncclCommFinalize(comm_);
      const bool finalized =
          Taken(r) &&
          AwaitReady(comm_, DeadlineAfter(options_.timeout), "finalize", options_.timeout).ok();
      if (finalized) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
    if (staging_ != nullptr) cudaFree(staging_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  std::string Describe() const override {
    return absl::StrCat("nccl ", NCCL_MAJOR, ".", NCCL_MINOR, ".", NCCL_PATCH, ", ",
                        options_.world_size, " ranks, GPU ", options_.cuda_device,
                        name_.empty() ? "" : absl::StrCat(", fork ", name_));
  }

  absl::Status ReduceScatter(const float* data, float* out,
                             const std::vector<int64_t>& counts) override {
    std::lock_guard<std::mutex> lock(mu_);
    OFFLOAD_RETURN_IF_ERROR(CheckCounts(counts, world_size(), "nccl reduce_scatter"));
    const bool even =
        std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts[0]; });
    return Run("reduce_scatter", options_.timeout, [&]() -> ncclResult_t {
      if (even) {
        if (counts[0] == 0) return ncclSuccess;
        return ncclReduceScatter(data, out, counts[0], ncclFloat, ncclSum, comm_, stream_);
      }
      // Uneven pieces (a bucket meets the partitions unevenly): one reduce to each owner.
      return PerOwner(counts, [&](int p, int64_t offset) {
        return ncclReduce(data + offset, p == rank() ? out : nullptr, counts[p], ncclFloat, ncclSum,
                          p, comm_, stream_);
      });
    });
  }

  absl::Status AllGather16(const uint16_t* in, uint16_t* out, int64_t n) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (n < 0) return absl::InvalidArgumentError("nccl all_gather: n is negative");
    return Run("all_gather", options_.timeout, [&]() -> ncclResult_t {
      if (n == 0) return ncclSuccess;
      // Bytes: the 16-bit values travel bit for bit, whatever their format.
      return ncclAllGather(in, out, static_cast<size_t>(n) * 2, ncclUint8, comm_, stream_);
    });
  }

  absl::Status AllGatherV16(const uint16_t* in, uint16_t* out,
                            const std::vector<int64_t>& counts) override {
    std::lock_guard<std::mutex> lock(mu_);
    OFFLOAD_RETURN_IF_ERROR(CheckCounts(counts, world_size(), "nccl all_gather_v"));
    return Run("all_gather_v", options_.timeout, [&]() -> ncclResult_t {
      return PerOwner(counts, [&](int p, int64_t offset) {
        return ncclBroadcast(p == rank() ? in : nullptr, out + offset,
                             static_cast<size_t>(counts[p]) * 2, ncclUint8, p, comm_, stream_);
      });
    });
  }

  absl::Status AllReduce(double* values, int n, ReduceOp op) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (n < 0) return absl::InvalidArgumentError("nccl all_reduce: n is negative");
    if (n == 0) return Usable();
    const size_t bytes = static_cast<size_t>(n) * sizeof(double);
    OFFLOAD_ASSIGN_OR_RETURN(void* staging, Staging(bytes));
    // In: on NCCL's stream, ahead of the operation (a plain copy from pageable memory may return
    // before its DMA has landed, and that stream would not wait for it). Out: a plain copy, once
    // Run has waited for the operation; the stream is idle then, so it cannot wait on a stuck one.
    OFFLOAD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(staging, values, bytes, cudaMemcpyHostToDevice, stream_));
    OFFLOAD_RETURN_IF_ERROR(Run("all_reduce", options_.timeout, [&]() -> ncclResult_t {
      return ncclAllReduce(staging, staging, n, ncclDouble,
                           op == ReduceOp::kSum ? ncclSum : ncclMax, comm_, stream_);
    }));
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMemcpy(values, staging, bytes, cudaMemcpyDeviceToHost));
    return absl::OkStatus();
  }

  absl::Status BroadcastWithin(void* data, int64_t bytes, int root,
                               absl::Duration timeout) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (bytes < 0 || root < 0 || root >= world_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("nccl broadcast: ", bytes, " bytes from root ", root, " of ", world_size()));
    }
    if (bytes == 0) return Usable();
    // In pieces of a bounded staging buffer: the starting weights of a model that fills the GPU
    // must not need a second copy of themselves there.
    const int64_t piece = std::min<int64_t>(bytes, kMaxStagingBytes);
    OFFLOAD_ASSIGN_OR_RETURN(void* staging, Staging(static_cast<size_t>(piece)));
    const absl::Duration wait = timeout > absl::ZeroDuration() ? timeout : options_.timeout;
    char* bytes_at = static_cast<char*>(data);
    for (int64_t done = 0; done < bytes; done += piece) {
      const int64_t n = std::min(piece, bytes - done);
      if (rank() == root) {
        OFFLOAD_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(staging, bytes_at + done, n, cudaMemcpyHostToDevice, stream_));
      }
      OFFLOAD_RETURN_IF_ERROR(Run("broadcast", wait, [&]() -> ncclResult_t {
        return ncclBroadcast(staging, staging, static_cast<size_t>(n), ncclUint8, root, comm_,
                             stream_);
      }));
      if (rank() != root) {
        OFFLOAD_CUDA_RETURN_IF_ERROR(
            cudaMemcpy(bytes_at + done, staging, n, cudaMemcpyDeviceToHost));
      }
    }
    return absl::OkStatus();
  }

  absl::Status Barrier() override {
    double one = 1;
    return AllReduce(&one, 1, ReduceOp::kSum);
  }

  absl::StatusOr<std::unique_ptr<Collectives>> Fork(absl::string_view name) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (name.empty() || absl::StrContains(name, '/')) {
      return absl::InvalidArgumentError(
          absl::StrCat("nccl fork: name \"", name, "\" must be non-empty without '/'"));
    }
    OFFLOAD_RETURN_IF_ERROR(Usable());
    if (!forks_.insert(std::string(name)).second) {
      return absl::AlreadyExistsError(absl::StrCat("nccl fork \"", name, "\" exists"));
    }
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.cuda_device));
    const std::string what =
        absl::StrCat("nccl fork (rank ", rank(), " of ", world_size(), ") \"", name, "\"");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t child = nullptr;
    const ncclResult_t r = ncclCommSplit(comm_, 0, rank(), &child, &config);
    // The split is collective on the parent too: it must leave ncclInProgress as well.
    absl::Status parent = Queued(r, comm_, what);
    if (parent.ok()) {
      parent = AwaitReady(comm_, DeadlineAfter(options_.timeout), what, options_.timeout);
    }
    absl::StatusOr<cudaStream_t> stream =
        parent.ok() ? StreamOnceReady(child, r, what, options_.timeout) : parent;
    if (!stream.ok()) {
      if (!parent.ok() && child != nullptr) ncclCommAbort(child);
      Break(stream.status());
      return stream.status();
    }
    return std::unique_ptr<Collectives>(
        new NcclCollectives(options_, child, *stream,
                            name_.empty() ? std::string(name) : absl::StrCat(name_, "/", name)));
  }

 private:
  // One call per rank p with a piece (counts[p] > 0, its first element at `offset`), in one
  // group: the uneven collectives, built from rooted ones.
  ncclResult_t PerOwner(const std::vector<int64_t>& counts,
                        const std::function<ncclResult_t(int p, int64_t offset)>& call) {
    ncclResult_t r = ncclGroupStart();
    int64_t offset = 0;
    for (int p = 0; p < world_size() && Taken(r); ++p) {
      if (counts[p] > 0) r = call(p, offset);
      offset += counts[p];
    }
    const ncclResult_t end = ncclGroupEnd();
    return Taken(r) ? end : r;
  }

  absl::Status Usable() const {
    if (!broken_.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "nccl collectives are unusable after an earlier failure: ", broken_.message()));
    }
    return absl::OkStatus();
  }

  // A device buffer of at least `bytes`, kept for the next call.
  absl::StatusOr<void*> Staging(size_t bytes) {
    OFFLOAD_RETURN_IF_ERROR(Usable());
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.cuda_device));
    if (bytes > staging_bytes_) {
      if (staging_ != nullptr) cudaFree(staging_);
      staging_ = nullptr;
      staging_bytes_ = 0;
      OFFLOAD_CUDA_RETURN_IF_ERROR(cudaMalloc(&staging_, bytes));
      staging_bytes_ = bytes;
    }
    return staging_;
  }

  // Aborts the communicator: NCCL's way out of an operation that cannot finish.
  void Break(const absl::Status& why) {
    if (broken_.ok()) broken_ = why;
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  // Enqueues NCCL calls (enqueue) on stream_ and waits on the host until they ran, an error, or
  // the deadline; any failure breaks this object.
  absl::Status Run(absl::string_view op, absl::Duration timeout,
                   const std::function<ncclResult_t()>& enqueue) {
    OFFLOAD_RETURN_IF_ERROR(Usable());
    OFFLOAD_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.cuda_device));
    const std::string what = absl::StrCat("nccl ", op, " (rank ", rank(), " of ", world_size(),
                                          name_.empty() ? "" : absl::StrCat(", fork ", name_), ")");
    const Clock::time_point deadline = DeadlineAfter(timeout);
    absl::Status s = Queued(enqueue(), comm_, what);
    // Non-blocking: the calls are queued once the communicator leaves ncclInProgress.
    if (s.ok()) s = AwaitReady(comm_, deadline, what, timeout);
    while (s.ok()) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) {
        s = CudaErrorStatus(q, "cudaStreamQuery", __FILE__, __LINE__);
        break;
      }
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess ||
          (state != ncclSuccess && state != ncclInProgress)) {
        s = NcclStatus(state, comm_, what);
        break;
      }
      if (Clock::now() >= deadline) {
        s = absl::DeadlineExceededError(absl::StrCat(
            what, ": the other ranks did not take part within ", absl::FormatDuration(timeout)));
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    if (!s.ok()) Break(s);
    return s;
  }

  const NcclOptions options_;
  std::mutex mu_;  // one operation at a time
  ncclComm_t comm_;
  cudaStream_t stream_;
  const std::string name_;  // "" for the root communicator, else the fork's path
  absl::Status broken_;     // the first failure; OK while usable
  void* staging_ = nullptr;
  size_t staging_bytes_ = 0;
  std::set<std::string> forks_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Collectives>> ConnectNccl(
    const NcclOptions& options, std::shared_ptr<gloo::rendezvous::Store> store) {
  const int W = options.world_size;
  if (W < 1 || options.rank < 0 || options.rank >= W) {
    return absl::InvalidArgumentError(
        absl::StrCat("NcclOptions: rank ", options.rank, " of ", W, " ranks"));
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("NcclOptions.timeout must be positive");
  }
  if (store == nullptr && W > 1) {
    return absl::InvalidArgumentError("ConnectNccl: more than one rank needs a rendezvous store");
  }
  const std::string what = absl::StrCat("nccl rendezvous (rank ", options.rank, " of ", W, ")");
  const cudaError_t device = cudaSetDevice(options.cuda_device);
  if (device != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(
        absl::StrCat(what, ": GPU ", options.cuda_device, ": ", cudaGetErrorString(device)));
  }
  ncclUniqueId id;
  const std::string key = absl::StrCat(options.prefix, "/nccl-id");
  if (options.rank == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) return NcclStatus(r, nullptr, what);
    if (W > 1) {
      OFFLOAD_RETURN_IF_ERROR(
          StorePut(*store, key, std::string(id.internal, NCCL_UNIQUE_ID_BYTES)));
    }
  } else {
    OFFLOAD_ASSIGN_OR_RETURN(std::string bytes, StoreAwait(*store, key, options.timeout));
    if (bytes.size() != NCCL_UNIQUE_ID_BYTES) {
      return absl::DataLossError(
          absl::StrCat(what, ": ", key, " holds ", bytes.size(), " bytes, not an NCCL unique id"));
    }
    std::memcpy(id.internal, bytes.data(), NCCL_UNIQUE_ID_BYTES);
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every wait is the host's, with a deadline
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, W, id, options.rank, &config);
  OFFLOAD_ASSIGN_OR_RETURN(cudaStream_t stream, StreamOnceReady(comm, r, what, options.timeout));
  return std::unique_ptr<Collectives>(new NcclCollectives(options, comm, stream, ""));
}

}  // namespace offload
