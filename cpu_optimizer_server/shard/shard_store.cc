#include "cpu_optimizer_server/shard/shard_store.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace offload {

namespace {

constexpr int64_t kViewAlignElements = 16;  // 64 bytes of fp32

int64_t AlignUp(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

absl::Status ValidateAdam(const AdamHyperParams& a) {
  auto bad = [](const char* field, float value, const char* want) {
    return absl::InvalidArgumentError(
        absl::StrCat("adam.", field, " is ", value, "; it must be ", want));
  };
  if (!std::isfinite(a.lr) || a.lr < 0) return bad("lr", a.lr, "finite and >= 0");
  if (!std::isfinite(a.beta1) || a.beta1 < 0 || a.beta1 >= 1) {
    return bad("beta1", a.beta1, "in [0, 1)");
  }
  if (!std::isfinite(a.beta2) || a.beta2 < 0 || a.beta2 >= 1) {
    return bad("beta2", a.beta2, "in [0, 1)");
  }
  if (!std::isfinite(a.eps) || a.eps <= 0) return bad("eps", a.eps, "finite and > 0");
  if (!std::isfinite(a.weight_decay) || a.weight_decay < 0) {
    return bad("weight_decay", a.weight_decay, "finite and >= 0");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateJobId(const std::string& job_id) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id is empty");
  if (job_id.size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("job_id is ", job_id.size(), " characters; at most 128 are allowed"));
  }
  for (char c : job_id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '-' || c == '_' || c == '.';
    if (!ok) {
      return absl::InvalidArgumentError("job_id may hold only letters, digits, '-', '_' and '.'");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<RangeState*> FindRangeFor(const Job& job, int64_t offset, int64_t n) {
  for (const auto& r : job.ranges) {
    if (offset >= r->spec.offset && offset < r->spec.offset + r->spec.length) {
      if (n > r->spec.offset + r->spec.length - offset) {
        return absl::OutOfRangeError(absl::StrCat(
            "elements [", offset, ", ", offset + n, ") run past the end of range ", r->index, " [",
            r->spec.offset, ", ", r->spec.offset + r->spec.length, ") of job ", job.config.job_id));
      }
      return r.get();
    }
  }
  return absl::OutOfRangeError(absl::StrCat("element ", offset, " is in no range of job ",
                                            job.config.job_id, " on this shard"));
}

int64_t Job::state_bytes() const {
  int64_t bytes = state_reservation.bytes();
  for (const auto& r : ranges) {
    std::lock_guard<std::mutex> lock(r->mu);
    bytes += r->accumulator_reservation.bytes();
  }
  return bytes;
}

ShardStore::ShardStore(const ShardOptions& options, ThreadPool* pool, SimdPath path)
    : options_([&] {
        ShardOptions o = options;
        o.wave_elements =
            std::max<int64_t>(kTileElements, o.wave_elements / kTileElements * kTileElements);
        return o;
      }()),
      pool_(pool),
      path_(path),
      kernel_(GetAdamKernel(path)),
      budget_(options.memory_limit_bytes) {}

void ShardStore::ParallelTiles(int64_t begin, int64_t end,
                               const std::function<void(int64_t, int64_t)>& fn) const {
  const int n = pool_->num_threads();
  pool_->Run([&](int t) { ForEachOwnedTile(begin, end, t, n, fn); });
}

absl::StatusOr<int64_t> ShardStore::CreateJob(const JobConfig& config) {
  OFFLOAD_RETURN_IF_ERROR(ValidateJobId(config.job_id));
  if (config.ranges.empty()) return absl::InvalidArgumentError("ranges is empty");
  if (config.param_dtype == DType::kFp32) {
    return absl::InvalidArgumentError("param_dtype must be FP16 or BF16");
  }
  OFFLOAD_RETURN_IF_ERROR(ValidateAdam(config.adam));
  std::vector<RangeSpec> sorted = config.ranges;
  int64_t total = 0;
  for (size_t i = 0; i < config.ranges.size(); ++i) {
    const RangeSpec& r = config.ranges[i];
    if (r.length <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("ranges[", i, "].length is 0"));
    }
    if (r.offset < 0 || r.length > (int64_t{1} << 40) || r.offset > (int64_t{1} << 50)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ranges[", i, "] [", r.offset, ", +", r.length, ") is out of bounds"));
    }
    total += r.length;
  }
  std::sort(sorted.begin(), sorted.end(),
            [](const RangeSpec& a, const RangeSpec& b) { return a.offset < b.offset; });
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i].offset < sorted[i - 1].offset + sorted[i - 1].length) {
      return absl::InvalidArgumentError(
          absl::StrCat("ranges overlap: [", sorted[i - 1].offset, ", ",
                       sorted[i - 1].offset + sorted[i - 1].length, ") and [", sorted[i].offset,
                       ", ", sorted[i].offset + sorted[i].length, ")"));
    }
  }

  auto job = std::make_shared<Job>();
  job->config = config;
  int64_t bytes = 0;
  for (const RangeSpec& r : config.ranges) bytes += 3 * AlignUp(r.length, kViewAlignElements) * 4;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (jobs_.count(config.job_id) != 0) {
      return absl::AlreadyExistsError(
          absl::StrCat("job ", config.job_id, " already exists on this shard"));
    }
    OFFLOAD_RETURN_IF_ERROR(budget_.Reserve(bytes, absl::StrCat("job ", config.job_id)));
    job->state_reservation = Reservation(&budget_, bytes);
    // Claim the id now so a concurrent create of the same job fails; the state is filled below
    // before anyone can step on it (a step needs loaded weights, and loads need the ranges).
    jobs_[config.job_id] = nullptr;
  }
  auto unclaim = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.erase(config.job_id);
  };
  for (size_t i = 0; i < config.ranges.size(); ++i) {
    auto range = std::make_unique<RangeState>();
    range->spec = config.ranges[i];
    range->index = static_cast<int>(i);
    const int64_t stride = AlignUp(range->spec.length, kViewAlignElements);
    absl::StatusOr<HostBuffer> storage = HostBuffer::Allocate(3 * stride * 4);
    if (!storage.ok()) {
      unclaim();
      return storage.status();
    }
    range->storage = *std::move(storage);
    range->param = static_cast<float*>(range->storage.data());
    range->exp_avg = range->param + stride;
    range->exp_avg_sq = range->exp_avg + stride;
    RangeState* rs = range.get();
    // First touch by the tile owners: the pages of a tile land where its thread runs.
    ParallelTiles(0, rs->spec.length, [rs](int64_t lo, int64_t hi) {
      std::memset(rs->param + lo, 0, (hi - lo) * 4);
      std::memset(rs->exp_avg + lo, 0, (hi - lo) * 4);
      std::memset(rs->exp_avg_sq + lo, 0, (hi - lo) * 4);
    });
    job->ranges.push_back(std::move(range));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_[config.job_id] = job;
  }
  return bytes;
}

absl::Status ShardStore::DropJob(const std::string& job_id) {
  std::shared_ptr<Job> job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end() || it->second == nullptr) {
      return absl::NotFoundError(absl::StrCat("job ", job_id, " is not on this shard"));
    }
    job = std::move(it->second);
    jobs_.erase(it);
  }
  // Streams still holding the job see `dropped` and fail; the memory goes with the last of them.
  job->dropped = true;
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Job>> ShardStore::FindJob(const std::string& job_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end() || it->second == nullptr) {
    return absl::NotFoundError(absl::StrCat("job ", job_id, " is not on this shard"));
  }
  return it->second;
}

absl::StatusOr<ShardStore::JobRange> ShardStore::FindJobRange(const std::string& job_id,
                                                              uint32_t range_index) const {
  OFFLOAD_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  if (range_index >= job->ranges.size()) {
    return absl::InvalidArgumentError(absl::StrCat("range_index ", range_index, " but job ", job_id,
                                                   " has ", job->ranges.size(),
                                                   " ranges on this shard"));
  }
  RangeState* range = job->ranges[range_index].get();
  return JobRange{std::move(job), range};
}

std::vector<std::shared_ptr<Job>> ShardStore::Jobs() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<Job>> out;
  for (const auto& [id, job] : jobs_) {
    if (job != nullptr) out.push_back(job);
  }
  return out;
}

absl::Status ShardStore::ReadState(
    const std::string& job_id, StateTensor tensor, DType dtype, int64_t offset, int64_t length,
    int64_t chunk_elements, const std::function<bool(int64_t, int64_t, const std::string&)>& emit) {
  OFFLOAD_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  if (length <= 0) return absl::InvalidArgumentError("range.length is 0");
  if (dtype != DType::kFp32 && tensor != StateTensor::kMasterWeights) {
    return absl::InvalidArgumentError("moments can only be read as FP32");
  }
  if (chunk_elements <= 0) chunk_elements = options_.wave_elements;
  // Validate the whole request before sending anything: it may span adjacent ranges.
  std::vector<std::pair<RangeState*, int64_t>> pieces;  // (range, elements from it)
  for (int64_t done = 0; done < length;) {
    absl::StatusOr<RangeState*> range = FindRangeFor(*job, offset + done, 1);
    if (!range.ok()) return range.status();
    const int64_t m =
        std::min(length - done, (*range)->spec.offset + (*range)->spec.length - (offset + done));
    pieces.emplace_back(*range, m);
    done += m;
  }
  std::string chunk;
  int64_t at = offset;
  for (auto [r, m] : pieces) {
    const float* src = r->Tensor(tensor) + (at - r->spec.offset);
    std::lock_guard<std::mutex> lock(r->tensors_mu);
    for (int64_t done = 0; done < m; done += chunk_elements) {
      const int64_t n = std::min(chunk_elements, m - done);
      chunk.resize(n * DTypeSize(dtype));
      ConvertFromFloat(src + done, n, dtype, chunk.data());
      if (!emit(at + done, n, chunk)) return absl::OkStatus();
    }
    at += m;
  }
  return absl::OkStatus();
}

}  // namespace offload
