// A world of one rank, and the argument checks shared with the Gloo implementation.
#include "gpu_trainer/collectives/local_collectives.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "base/status_macros.h"

namespace offload {
namespace {

// Element counts above this would overflow byte offsets (int64 and size_t on every target).
constexpr int64_t kMaxBytes = std::numeric_limits<int64_t>::max() / 2;

bool Overlap(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  if (a_bytes <= 0 || b_bytes <= 0) return false;
  const auto pa = reinterpret_cast<uintptr_t>(a);
  const auto pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + static_cast<uintptr_t>(b_bytes) && pb < pa + static_cast<uintptr_t>(a_bytes);
}

class LocalCollectives final : public Collectives {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string Describe() const override { return "local, 1 rank"; }

  absl::Status ReduceScatter(const float* data, float* out,
                             const std::vector<int64_t>& counts) override {
    OFFLOAD_RETURN_IF_ERROR(CheckReduceScatterArgs(0, 1, data, out, counts));
    if (counts[0] > 0 && out != data) std::memcpy(out, data, counts[0] * sizeof(float));
    return absl::OkStatus();
  }

  absl::Status AllGather16(const uint16_t* in, uint16_t* out, int64_t n) override {
    OFFLOAD_RETURN_IF_ERROR(CheckAllGather16Args(0, 1, in, out, n));
    if (n > 0 && in != out) std::memcpy(out, in, n * sizeof(uint16_t));
    return absl::OkStatus();
  }

  absl::Status AllGatherV16(const uint16_t* in, uint16_t* out,
                            const std::vector<int64_t>& counts) override {
    OFFLOAD_RETURN_IF_ERROR(CheckAllGatherV16Args(0, 1, in, out, counts));
    // in aliases out exactly or not at all (checked), so memcpy is safe once they differ.
    if (counts[0] > 0 && in != out) std::memcpy(out, in, counts[0] * sizeof(uint16_t));
    return absl::OkStatus();
  }

  absl::Status AllReduce(double* values, int n, ReduceOp op) override {
    return CheckAllReduceArgs(values, n, op);
  }

  absl::Status BroadcastWithin(void* data, int64_t bytes, int root,
                               absl::Duration timeout) override {
    return CheckBroadcastArgs(1, data, bytes, root);
  }

  absl::Status Barrier() override { return absl::OkStatus(); }

  // Nothing to keep apart with no peers, but names are refused as with them, so that a program
  // run on one rank fails where it would on many.
  absl::StatusOr<std::unique_ptr<Collectives>> Fork(absl::string_view name) override {
    OFFLOAD_RETURN_IF_ERROR(CheckForkName(name));
    absl::MutexLock lock(&mu_);
    if (!forked_.insert(std::string(name)).second) {
      return absl::AlreadyExistsError(absl::StrCat("fork: name \"", name, "\" already forked"));
    }
    return std::unique_ptr<Collectives>(std::make_unique<LocalCollectives>());
  }

 private:
  absl::Mutex mu_;
  std::set<std::string> forked_ ABSL_GUARDED_BY(mu_);  // names given to Fork
};

}  // namespace

std::unique_ptr<Collectives> SingleRankCollectives() {
  return std::make_unique<LocalCollectives>();
}

absl::Status CheckReduceScatterArgs(int rank, int world_size, const float* data, const float* out,
                                    const std::vector<int64_t>& counts) {
  if (static_cast<int64_t>(counts.size()) != world_size) {
    return absl::InvalidArgumentError(absl::StrCat("reduce_scatter: counts has ", counts.size(),
                                                   " entries, the world ", world_size, " ranks"));
  }
  int64_t total = 0;
  int64_t offset = 0;  // of segment `rank`
  for (int r = 0; r < world_size; ++r) {
    const int64_t c = counts[r];
    if (c < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("reduce_scatter: counts[", r, "] = ", c, " is negative"));
    }
    if (c > kMaxBytes / static_cast<int64_t>(sizeof(float)) - total) {
      return absl::InvalidArgumentError(
          absl::StrCat("reduce_scatter: counts sum past ", total, " + ", c, " elements"));
    }
    if (r == rank) offset = total;
    total += c;
  }
  if (total > 0 && data == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("reduce_scatter: data is null for ", total, " elements"));
  }
  const int64_t mine = counts[rank];
  if (mine > 0 && out == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("reduce_scatter: out is null for ", mine, " elements"));
  }
  if (mine > 0 && out != data + offset &&
      Overlap(out, mine * sizeof(float), data, total * sizeof(float))) {
    return absl::InvalidArgumentError(
        absl::StrCat("reduce_scatter: out overlaps data other than at segment ", rank,
                     " (element offset ", offset, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckAllGather16Args(int rank, int world_size, const uint16_t* in, const uint16_t* out,
                                  int64_t n) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("all_gather16: n = ", n, " < 0"));
  if (n > kMaxBytes / static_cast<int64_t>(sizeof(uint16_t)) / world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("all_gather16: n = ", n, " times ", world_size, " ranks is too large"));
  }
  if (n == 0) return absl::OkStatus();
  if (in == nullptr || out == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("all_gather16: ", in == nullptr ? "in" : "out", " is null for n = ", n));
  }
  if (in != out + rank * n &&
      Overlap(in, n * sizeof(uint16_t), out, world_size * n * sizeof(uint16_t))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "all_gather16: in overlaps out other than at out + rank * n = out + ", rank * n));
  }
  return absl::OkStatus();
}

absl::Status CheckAllGatherV16Args(int rank, int world_size, const uint16_t* in,
                                   const uint16_t* out, const std::vector<int64_t>& counts) {
  if (static_cast<int64_t>(counts.size()) != world_size) {
    return absl::InvalidArgumentError(absl::StrCat("all_gather_v16: counts has ", counts.size(),
                                                   " entries, the world ", world_size, " ranks"));
  }
  int64_t total = 0;
  int64_t offset = 0;  // of segment `rank` in out
  for (int r = 0; r < world_size; ++r) {
    const int64_t c = counts[r];
    if (c < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("all_gather_v16: counts[", r, "] = ", c, " is negative"));
    }
    if (c > kMaxBytes / static_cast<int64_t>(sizeof(uint16_t)) - total) {
      return absl::InvalidArgumentError(
          absl::StrCat("all_gather_v16: counts sum past ", total, " + ", c, " elements"));
    }
    if (r == rank) offset = total;
    total += c;
  }
  const int64_t mine = counts[rank];
  if (mine > 0 && in == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("all_gather_v16: in is null for counts[", rank, "] = ", mine, " elements"));
  }
  if (total > 0 && out == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("all_gather_v16: out is null for ", total, " elements"));
  }
  if (mine > 0 && in != out + offset &&
      Overlap(in, mine * sizeof(uint16_t), out, total * sizeof(uint16_t))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "all_gather_v16: in overlaps out other than at segment ", rank, " (out + ", offset, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckAllReduceArgs(const double* values, int n, ReduceOp op) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("all_reduce: n = ", n, " < 0"));
  if (n > 0 && values == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("all_reduce: values is null for n = ", n));
  }
  if (op != ReduceOp::kSum && op != ReduceOp::kMax) {
    return absl::InvalidArgumentError(
        absl::StrCat("all_reduce: unknown op ", static_cast<int>(op)));
  }
  return absl::OkStatus();
}

absl::Status CheckBroadcastArgs(int world_size, const void* data, int64_t bytes, int root) {
  if (bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat("broadcast: bytes = ", bytes, " < 0"));
  }
  if (bytes > kMaxBytes) {
    return absl::InvalidArgumentError(absl::StrCat("broadcast: bytes = ", bytes, " too large"));
  }
  if (root < 0 || root >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("broadcast: root ", root, " outside [0, ", world_size, ")"));
  }
  if (bytes > 0 && data == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("broadcast: data is null for ", bytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status CheckForkName(absl::string_view name) {
  if (name.empty()) return absl::InvalidArgumentError("fork: name is empty");
  if (absl::StrContains(name, '/')) {
    return absl::InvalidArgumentError(absl::StrCat("fork: name \"", name, "\" contains '/'"));
  }
  return absl::OkStatus();
}

}  // namespace offload
