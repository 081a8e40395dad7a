// Collectives over Gloo's TCP transport (see gloo_collectives.h).
#include "gpu_trainer/collectives/gloo_collectives.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/status_macros.h"
#include "gloo/allgather.h"
#include "gloo/allgatherv.h"
#include "gloo/allreduce.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/common/logging.h"
#include "gloo/context.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/file_store.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/attr.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"
#include "gloo/types.h"
#include "gpu_trainer/collectives/local_collectives.h"

namespace offload {
namespace {

using Millis = std::chrono::milliseconds;
using SteadyClock = std::chrono::steady_clock;

// Slot prefix of our reduce-scatter ring. Gloo's own collectives use 0x01..0x08 (gloo/types.h),
// and the tag in the middle bits keeps consecutive operations apart.
constexpr uint8_t kReduceScatterSlotPrefix = 0x40;

// The ring moves a segment in pieces of this many fp32 elements (1 MiB), so the addition of one
// piece overlaps the transfer of the next.
constexpr int64_t kPieceElements = 256 * 1024;

// Gloo reports timeouts as IoException (or plain Exception) whose text says so: "Timed out
// waiting 2000ms for recv operation to complete", "Wait timeout for key(s): ...", "Connect
// timeout ...", and, on the other operations of a context one of which timed out, "Application
// timeout caused pair closure".
bool IsTimeoutMessage(absl::string_view what) {
  const std::string lower = absl::AsciiStrToLower(what);
  return absl::StrContains(lower, "timed out") || absl::StrContains(lower, "timeout");
}

// The exception being handled as a Status. Call only from inside a catch block.
absl::Status CurrentExceptionToStatus(absl::string_view where) {
  try {
    throw;
  } catch (const gloo::Exception& e) {  // IoException and InvalidOperationException among them
    const std::string message = absl::StrCat(where, ": ", e.what());
    if (IsTimeoutMessage(e.what())) return absl::DeadlineExceededError(message);
    if (dynamic_cast<const gloo::IoException*>(&e) != nullptr) {
      return absl::UnavailableError(message);
    }
    return absl::InternalError(message);
  } catch (const gloo::EnforceNotMet& e) {  // GLOO_ENFORCE: not a gloo::Exception
    return absl::InternalError(absl::StrCat(where, ": ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(where, ": ", e.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(where, ": unknown exception"));
  }
}

// What is left of `deadline`, at least 1 ms: Gloo reads 0 as "no timeout" in places.
Millis Remaining(SteadyClock::time_point deadline) {
  const auto left = std::chrono::ceil<Millis>(deadline - SteadyClock::now());
  return std::max(left, Millis(1));
}

void SumDoubles(void* c, const void* a, const void* b, size_t n) { gloo::sum<double>(c, a, b, n); }

void MaxDoubles(void* c, const void* a, const void* b, size_t n) { gloo::max<double>(c, a, b, n); }

absl::StatusOr<std::unique_ptr<Collectives>> Rendezvous(
    const GlooOptions& options, std::shared_ptr<gloo::rendezvous::Store> store, std::string fork);

absl::Status CheckOptions(const GlooOptions& options) {
  if (options.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("GlooOptions.world_size must be >= 1, got ", options.world_size));
  }
  if (options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("GlooOptions.rank ", options.rank, " outside [0, ", options.world_size, ")"));
  }
  if (options.timeout <= absl::ZeroDuration() || options.timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("GlooOptions.timeout must be positive and finite, got ",
                     absl::FormatDuration(options.timeout)));
  }
  if (options.hostname.empty()) {
    return absl::InvalidArgumentError("GlooOptions.hostname is empty");
  }
  return absl::OkStatus();
}

class GlooCollectives final : public Collectives {
 public:
  // context: connected by Rendezvous with `options` over `store`, both kept so that Fork can
  // meet the same ranks again. fork: the names of the forks that led here, '/'-separated, empty
  // for the object ConnectGloo returned.
  GlooCollectives(std::shared_ptr<gloo::Context> context,
                  std::shared_ptr<gloo::rendezvous::Store> store, GlooOptions options,
                  std::string fork, Millis timeout)
      : context_(std::move(context)),
        store_(std::move(store)),
        options_(std::move(options)),
        fork_(std::move(fork)),
        rank_(context_->rank),
        world_size_(context_->size),
        timeout_(timeout) {}

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::string Describe() const override {
    return absl::StrCat("gloo tcp ", options_.hostname, ", rank ", rank_, " of ", world_size_,
                        fork_.empty() ? "" : ", fork ", fork_);
  }

  absl::Status ReduceScatter(const float* data, float* out,
                             const std::vector<int64_t>& counts) override {
    absl::MutexLock lock(&mu_);
    OFFLOAD_RETURN_IF_ERROR(CheckUsable("reduce_scatter"));
    OFFLOAD_RETURN_IF_ERROR(CheckReduceScatterArgs(rank_, world_size_, data, out, counts));
    return Run("reduce_scatter",
               [&](uint32_t tag) { return RingReduceScatter(data, out, counts, tag); });
  }

  absl::Status AllGather16(const uint16_t* in, uint16_t* out, int64_t n) override {
    absl::MutexLock lock(&mu_);
    OFFLOAD_RETURN_IF_ERROR(CheckUsable("all_gather16"));
    OFFLOAD_RETURN_IF_ERROR(CheckAllGather16Args(rank_, world_size_, in, out, n));
    return Run("all_gather16", [&](uint32_t tag) {
      if (n == 0) return absl::OkStatus();
      gloo::AllgatherOptions opts(context_);
      // Without an input Gloo gathers in place: the caller's block is already at its offset.
      if (in != out + rank_ * n) opts.setInput(const_cast<uint16_t*>(in), n);
      opts.setOutput(out, static_cast<size_t>(world_size_ * n));
      opts.setTag(tag);
      opts.setTimeout(timeout_);
      gloo::allgather(opts);
      return absl::OkStatus();
    });
  }

  absl::Status AllGatherV16(const uint16_t* in, uint16_t* out,
                            const std::vector<int64_t>& counts) override {
    absl::MutexLock lock(&mu_);
    OFFLOAD_RETURN_IF_ERROR(CheckUsable("all_gather_v16"));
    OFFLOAD_RETURN_IF_ERROR(CheckAllGatherV16Args(rank_, world_size_, in, out, counts));
    return Run("all_gather_v16", [&](uint32_t tag) {
      int64_t total = 0;
      int64_t offset = 0;  // of segment rank_ in out
      for (int r = 0; r < world_size_; ++r) {
        if (r == rank_) offset = total;
        total += counts[r];
      }
      // Every rank has the same counts, so all of them skip together.
      if (total == 0) return absl::OkStatus();
      gloo::AllgathervOptions opts(context_);
      // Gloo's ring sends and receives zero-length segments as empty messages, so a rank
      // without a piece of this range still forwards the others'. Without an input it gathers
      // in place: the caller's piece is already at its offset (or there is none).
      const int64_t mine = counts[rank_];
      if (mine > 0 && in != out + offset) {
        opts.setInput(const_cast<uint16_t*>(in), static_cast<size_t>(mine));
      }
      opts.setOutput(out, std::vector<size_t>(counts.begin(), counts.end()));
      opts.setTag(tag);
      opts.setTimeout(timeout_);
      gloo::allgatherv(opts);
      return absl::OkStatus();
    });
  }

  absl::Status AllReduce(double* values, int n, ReduceOp op) override {
    absl::MutexLock lock(&mu_);
    OFFLOAD_RETURN_IF_ERROR(CheckUsable("all_reduce"));
    OFFLOAD_RETURN_IF_ERROR(CheckAllReduceArgs(values, n, op));
    return Run("all_reduce", [&](uint32_t tag) {
      if (n == 0) return absl::OkStatus();
      gloo::AllreduceOptions opts(context_);
      // The ring reduces each element on one rank and passes the result on, so every rank
      // ends with the same bits.
      opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
      opts.setOutput(values, static_cast<size_t>(n));
      opts.setReduceFunction(op == ReduceOp::kSum ? &SumDoubles : &MaxDoubles);
      opts.setTag(tag);
      opts.setTimeout(timeout_);
      gloo::allreduce(opts);
      return absl::OkStatus();
    });
  }

  absl::Status BroadcastWithin(void* data, int64_t bytes, int root,
                               absl::Duration timeout) override {
    absl::MutexLock lock(&mu_);
    OFFLOAD_RETURN_IF_ERROR(CheckUsable("broadcast"));
    OFFLOAD_RETURN_IF_ERROR(CheckBroadcastArgs(world_size_, data, bytes, root));
    return Run("broadcast", [&](uint32_t tag) {
      if (bytes == 0) return absl::OkStatus();
      gloo::BroadcastOptions opts(context_);
      opts.setOutput(static_cast<uint8_t*>(data), static_cast<size_t>(bytes));
      opts.setRoot(root);
      opts.setTag(tag);
      opts.setTimeout(timeout > absl::ZeroDuration() ? absl::ToChronoMilliseconds(timeout)
                                                     : timeout_);
      gloo::broadcast(opts);
      return absl::OkStatus();
    });
  }

  absl::Status Barrier() override {
    absl::MutexLock lock(&mu_);
    OFFLOAD_RETURN_IF_ERROR(CheckUsable("barrier"));
    return Run("barrier", [&](uint32_t tag) {
      gloo::BarrierOptions opts(context_);
      opts.setTag(tag);
      opts.setTimeout(timeout_);
      gloo::barrier(opts);
      return absl::OkStatus();
    });
  }

  // A fresh rendezvous in the same store under prefix + "/fork/" + name, which gives the fork
  // its own TCP connections and tags. The prefix must differ per fork: a FileStore refuses a
  // key that already exists, and in any store a reused key could hand out an earlier fork's
  // addresses. Hence one fork per name here, and no '/' in names (a fork's forks extend its
  // prefix, and must not meet a sibling's keys). Does not hold mu_ while it waits for the peers,
  // so this object's operations on other threads go on meanwhile.
  absl::StatusOr<std::unique_ptr<Collectives>> Fork(absl::string_view name) override {
    {
      absl::MutexLock lock(&mu_);
      OFFLOAD_RETURN_IF_ERROR(CheckUsable("fork"));
      OFFLOAD_RETURN_IF_ERROR(CheckForkName(name));
      if (!forked_.insert(std::string(name)).second) {
        return absl::AlreadyExistsError(
            absl::StrCat(Where("fork"), ": name \"", name, "\" already forked"));
      }
    }
    GlooOptions options = options_;
    options.prefix = absl::StrCat(options_.prefix, "/fork/", name);
    absl::StatusOr<std::unique_ptr<Collectives>> fork = Rendezvous(
        options, store_, fork_.empty() ? std::string(name) : absl::StrCat(fork_, "/", name));
    if (!fork.ok()) {
      // The ranks may now disagree on whether the fork exists; as after any failed call, this
      // object gives up too, so that its peers fail at once rather than at their timeouts.
      const absl::Status status(
          fork.status().code(),
          absl::StrCat(Where("fork"), " \"", name, "\": ", fork.status().message()));
      absl::MutexLock lock(&mu_);
      Break(status);
      return status;
    }
    return fork;
  }

 private:
  std::string Where(absl::string_view op) const {
    return absl::StrCat("gloo ", op, " (rank ", rank_, " of ", world_size_,
                        fork_.empty() ? "" : ", fork ", fork_, ")");
  }

  absl::Status CheckUsable(absl::string_view op) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (broken_.ok()) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat(Where(op), ": unusable after an earlier failure: ", broken_.ToString()));
  }

  // Runs one communicating operation under the next tag. All ranks make the same calls in the
  // same order, so their tags agree; refused calls return before this and take no tag. The
  // first failure breaks the object and closes its connections, so that the peers fail at once
  // instead of waiting out their timeouts, and no late message can land in a caller's buffer.
  template <typename Fn>
  absl::Status Run(absl::string_view op, Fn&& fn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const uint32_t tag = next_tag_++;
    absl::Status status;
    try {
      status = fn(tag);
      if (!status.ok()) {
        status = absl::Status(status.code(), absl::StrCat(Where(op), ": ", status.message()));
      }
    } catch (...) {
      status = CurrentExceptionToStatus(Where(op));
    }
    if (!status.ok()) Break(status);
    return status;
  }

  // Makes the object unusable for good, with `status` as the reason, and closes its connections.
  void Break(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (broken_.ok()) broken_ = status;
    try {
      context_->closeConnections();
    } catch (...) {
      // The connections are being given up anyway; the status says why.
    }
  }

  // Ring reduce-scatter over uneven segments. Segment s starts at rank s + 1, which sends its
  // own block; each rank on the way adds its block to what it received and passes the partial
  // sum on, and after W - 1 steps it arrives complete at rank s. So segment s is summed as
  // ((x[s+1] + x[s+2]) + ...) + x[s] (ranks mod W), an order fixed by W alone, and every rank
  // sends and receives (W - 1) / W of the data, the least a reduce-scatter can. Zero-length
  // segments are skipped on both ends, which agree since counts are the same on every rank.
  // Throws what Gloo throws.
  absl::Status RingReduceScatter(const float* data, float* out, const std::vector<int64_t>& counts,
                                 uint32_t tag) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int w = world_size_;
    const int next = (rank_ + 1) % w;
    const int prev = (rank_ + w - 1) % w;
    const auto deadline = SteadyClock::now() + timeout_;
    const uint64_t slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag);

    offsets_.resize(w);  // (W,) element offset of each segment in data
    int64_t total = 0;
    int64_t largest = 0;
    for (int s = 0; s < w; ++s) {
      offsets_[s] = total;
      total += counts[s];
      largest = std::max(largest, counts[s]);
    }
    if (total == 0) return absl::OkStatus();

    // Two partial-sum buffers: step k receives into one while the other, filled at step k - 1,
    // is sent. With two ranks there is one step and one buffer.
    const int64_t needed = (w == 2 ? 1 : 2) * largest;
    if (scratch_size_ < needed) {
      scratch_.reset();
      scratch_.reset(new float[needed]);
      scratch_size_ = needed;
    }
    float* const partial[2] = {scratch_.get(), scratch_.get() + (w == 2 ? 0 : largest)};

    auto pieces = [](int64_t n) { return (n + kPieceElements - 1) / kPieceElements; };
    auto piece_length = [](int64_t n, int64_t p) {
      return std::min(kPieceElements, n - p * kPieceElements);
    };

    for (int k = 0; k + 1 < w; ++k) {
      const bool last = k + 2 == w;
      const int send_segment = ((rank_ - 1 - k) % w + w) % w;
      const int recv_segment = ((rank_ - 2 - k) % w + w) % w;  // rank_ itself at the last step
      const int64_t send_n = counts[send_segment];
      const int64_t recv_n = counts[recv_segment];
      const float* send_from = k == 0 ? data + offsets_[send_segment] : partial[(k - 1) % 2];
      float* const recv_into = partial[k % 2];

      // Receives first, one buffer per piece so that its wait means that piece has landed
      // (Gloo matches receives on one slot and pair in the order they are posted).
      recv_buffers_.clear();
      for (int64_t p = 0; p < pieces(recv_n); ++p) {
        recv_buffers_.push_back(context_->createUnboundBuffer(
            recv_into + p * kPieceElements, piece_length(recv_n, p) * sizeof(float)));
        recv_buffers_.back()->recv(prev, slot);
      }
      std::unique_ptr<gloo::transport::UnboundBuffer> send_buffer;
      if (send_n > 0) {
        // Gloo only reads a buffer it sends from; its API takes void*.
        send_buffer =
            context_->createUnboundBuffer(const_cast<float*>(send_from), send_n * sizeof(float));
        for (int64_t p = 0; p < pieces(send_n); ++p) {
          send_buffer->send(next, slot, p * kPieceElements * sizeof(float),
                            piece_length(send_n, p) * sizeof(float));
        }
      }

      const float* mine = data + offsets_[recv_segment];  // (recv_n,) this rank's block
      for (int64_t p = 0; p < pieces(recv_n); ++p) {
        if (!recv_buffers_[p]->waitRecv(Remaining(deadline))) {
          return absl::AbortedError("receive aborted");
        }
        const int64_t at = p * kPieceElements;
        float* const dst = last ? out + at : recv_into + at;
        // dst (piece,) := received + mine; dst may be the received piece itself.
        gloo::sum<float>(dst, recv_into + at, mine + at, piece_length(recv_n, p));
      }
      for (int64_t p = 0; p < pieces(send_n); ++p) {
        if (!send_buffer->waitSend(Remaining(deadline))) {
          return absl::AbortedError("send aborted");
        }
      }
    }
    recv_buffers_.clear();
    return absl::OkStatus();
  }

  absl::Mutex mu_;
  const std::shared_ptr<gloo::Context> context_;
  // What Fork needs to meet the same ranks again: the store and the options this object's
  // rendezvous used.
  const std::shared_ptr<gloo::rendezvous::Store> store_;
  const GlooOptions options_;
  const std::string fork_;
  const int rank_;
  const int world_size_;
  const Millis timeout_;
  uint32_t next_tag_ ABSL_GUARDED_BY(mu_) = 0;
  // The first failure; OK while usable.
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> forked_ ABSL_GUARDED_BY(mu_);  // names given to Fork
  // Reduce-scatter state kept between calls, so a warm call allocates no element buffers.
  std::unique_ptr<float[]> scratch_ ABSL_GUARDED_BY(mu_);  // (scratch_size_,) partial sums
  int64_t scratch_size_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int64_t> offsets_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> recv_buffers_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<std::unique_ptr<Collectives>> Rendezvous(
    const GlooOptions& options, std::shared_ptr<gloo::rendezvous::Store> store, std::string fork) {
  const Millis timeout = std::max(Millis(1), absl::ToChronoMilliseconds(options.timeout));
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.world_size);
    // Bounds the wait for the peers' addresses in the store and for each connection.
    context->setTimeout(timeout);
    gloo::rendezvous::PrefixStore prefixed(options.prefix, *store);
    context->connectFullMesh(prefixed, device);
    return std::unique_ptr<Collectives>(std::make_unique<GlooCollectives>(
        std::move(context), std::move(store), options, std::move(fork), timeout));
  } catch (...) {
    return CurrentExceptionToStatus(
        absl::StrCat("gloo rendezvous (rank ", options.rank, " of ", options.world_size, ")"));
  }
}

}  // namespace

absl::Status StorePut(gloo::rendezvous::Store& store, const std::string& key,
                      const std::string& value) {
  try {
    store.set(key, std::vector<char>(value.begin(), value.end()));
    return absl::OkStatus();
  } catch (...) {
    return CurrentExceptionToStatus(absl::StrCat("rendezvous store: putting ", key));
  }
}

absl::StatusOr<std::string> StoreAwait(gloo::rendezvous::Store& store, const std::string& key,
                                       absl::Duration timeout) {
  try {
    store.wait({key}, std::max(Millis(1), absl::ToChronoMilliseconds(timeout)));
    const std::vector<char> value = store.get(key);
    return std::string(value.begin(), value.end());
  } catch (...) {
    return CurrentExceptionToStatus(absl::StrCat("rendezvous store: waiting for ", key));
  }
}

absl::StatusOr<std::unique_ptr<Collectives>> ConnectGloo(const GlooOptions& options) {
  OFFLOAD_RETURN_IF_ERROR(CheckOptions(options));
  if (options.rendezvous.empty()) {
    return absl::InvalidArgumentError("GlooOptions.rendezvous (a directory) is empty");
  }
  std::error_code error;
  if (!std::filesystem::is_directory(options.rendezvous, error)) {
    return absl::InvalidArgumentError(absl::StrCat("GlooOptions.rendezvous ", options.rendezvous,
                                                   " is not a directory",
                                                   error ? ": " + error.message() : ""));
  }
  if (options.world_size == 1) return SingleRankCollectives();
  std::shared_ptr<gloo::rendezvous::Store> store;
  try {
    store = std::make_shared<gloo::rendezvous::FileStore>(options.rendezvous);
  } catch (...) {
    return CurrentExceptionToStatus(absl::StrCat("gloo file store ", options.rendezvous));
  }
  return ConnectGloo(options, std::move(store));
}

absl::StatusOr<std::unique_ptr<Collectives>> ConnectGloo(
    const GlooOptions& options, std::shared_ptr<gloo::rendezvous::Store> store) {
  OFFLOAD_RETURN_IF_ERROR(CheckOptions(options));
  if (options.world_size == 1) return SingleRankCollectives();
  if (store == nullptr) return absl::InvalidArgumentError("ConnectGloo: store is null");
  // Gloo writes to its sockets without MSG_NOSIGNAL: a write to a peer that has closed raises
  // SIGPIPE, whose default action would end this process instead of failing the call with
  // UNAVAILABLE. Ignored once for the process, as gRPC's own sockets expect.
  static const bool sigpipe_ignored = [] { return std::signal(SIGPIPE, SIG_IGN) != SIG_ERR; }();
  (void)sigpipe_ignored;
  return Rendezvous(options, std::move(store), /*fork=*/"");
}

}  // namespace offload
