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

// The hyper-parameters of group `group` (the job's only group when the request had none, so its
// `adam`); refusals name the group.
absl::Status ValidateAdam(const AdamHyperParams& a, size_t group) {
  auto bad = [group](const char* field, double value, const char* want) {
    return absl::InvalidArgumentError(absl::StrCat("parameter group ", group, ": adam.", field,
                                                   " is ", value, "; it must be ", want));
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

// Groups in offset order, not overlapping, at most kMaxParamGroups, together covering every
// range. Runs before anything is allocated.
absl::Status ValidateGroups(const std::vector<ParamGroupSpec>& groups,
                            const std::vector<RangeSpec>& ranges) {
  if (groups.size() > static_cast<size_t>(kMaxParamGroups)) {
    return absl::InvalidArgumentError(
        absl::StrCat("groups[", kMaxParamGroups, "] is one too many: ", groups.size(),
                     " parameter groups, at most ", kMaxParamGroups, " are allowed"));
  }
  for (size_t i = 0; i < groups.size(); ++i) {
    const ParamGroupSpec& g = groups[i];
    if (g.offset < 0 || g.length < 0 || g.offset > (int64_t{1} << 50) ||
        g.length > (int64_t{1} << 50)) {
      return absl::InvalidArgumentError(
          absl::StrCat("groups[", i, "] [", g.offset, ", +", g.length, ") is out of bounds"));
    }
    OFFLOAD_RETURN_IF_ERROR(ValidateAdam(g.adam, i));
    if (i == 0) continue;
    const ParamGroupSpec& prev = groups[i - 1];
    if (g.offset < prev.offset + prev.length) {
      return absl::InvalidArgumentError(
          absl::StrCat("groups[", i, "] [", g.offset, ", ", g.offset + g.length, ") ",
                       g.offset < prev.offset ? "comes before" : "overlaps", " groups[", i - 1,
                       "] [", prev.offset, ", ", prev.offset + prev.length,
                       "): groups must be in offset order and must not overlap"));
    }
  }
  for (size_t r = 0; r < ranges.size(); ++r) {
    const int64_t end = ranges[r].offset + ranges[r].length;
    // The first group ending after the range's start, then on while they touch.
    auto g = std::upper_bound(
        groups.begin(), groups.end(), ranges[r].offset,
        [](int64_t at, const ParamGroupSpec& x) { return at < x.offset + x.length; });
    for (int64_t at = ranges[r].offset; at < end; ++g) {
      if (g == groups.end() || g->offset > at) {
        const std::string where =
            g == groups.end()
                ? (groups.empty()
                       ? std::string("there are no groups")
                       : absl::StrCat("the last group, groups[", groups.size() - 1, "], ends at ",
                                      groups.back().offset + groups.back().length))
                : absl::StrCat("groups[", g - groups.begin(), "] starts at ", g->offset);
        return absl::InvalidArgumentError(absl::StrCat(
            "element ", at, " of ranges[", r, "] [", ranges[r].offset, ", ", end,
            ") is in no parameter group (", where, "): the groups must cover every range"));
      }
      at = g->offset + g->length;
    }
  }
  return absl::OkStatus();
}

}  // namespace

ParamGroupSpec DefaultParamGroup(const std::vector<RangeSpec>& ranges,
                                 const AdamHyperParams& adam) {
  ParamGroupSpec group;
  group.adam = adam;
  if (ranges.empty()) return group;
  int64_t lo = ranges[0].offset, hi = ranges[0].offset + ranges[0].length;
  for (const RangeSpec& r : ranges) {
    lo = std::min(lo, r.offset);
    hi = std::max(hi, r.offset + r.length);
  }
  group.offset = lo;
  group.length = hi - lo;
  return group;
}

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

namespace {

// Elements a view of `length` holds: whole 64-byte lines of fp32, so of bf16 too.
int64_t ViewStride(int64_t length) { return AlignUp(length, kViewAlignElements); }

}  // namespace

int64_t RangeState::stride() const { return ViewStride(spec.length); }

int64_t RangeState::storage_bytes() const { return stride() * StateBytesPerElement(state_dtype); }

void* RangeState::MomentView(const HostBuffer& buffer, int moment) const {
  return static_cast<char*>(buffer.data()) + stride() * (4 + moment * DTypeSize(state_dtype));
}

void RangeState::CarveViews() {
  param = static_cast<float*>(storage.data());
  exp_avg = MomentView(storage, 0);
  exp_avg_sq = MomentView(storage, 1);
}

void RangeState::SwapStaging() {
  std::swap(storage, staging_storage);
  CarveViews();
}

int64_t Job::state_bytes() const {
  int64_t bytes = state_reservation.bytes();
  for (const auto& r : ranges) {
    std::lock_guard<std::mutex> lock(r->mu);
    bytes += r->accumulator_reservation.bytes() + r->staging_reservation.bytes();
  }
  return bytes;
}

int64_t Job::disk_bytes() const {
  int64_t bytes = 0;
  for (const auto& r : ranges) {
    bytes += r->file != nullptr ? StateFileBytes(r->spec.length, r->state_dtype) : 0;
  }
  return bytes;
}

ShardStore::ShardStore(const ShardOptions& options, ThreadPool* pool, SimdPath path, DiskTier* disk)
    : options_([&] {
        ShardOptions o = options;
        o.wave_elements =
            std::max<int64_t>(kTileElements, o.wave_elements / kTileElements * kTileElements);
        // A disk range's waves are the ring's slots, and every range streams the same waves.
        if (disk != nullptr) o.wave_elements = disk->wave_elements();
        return o;
      }()),
      pool_(pool),
      path_(path),
      kernel_(GetAdamKernel(path)),
      disk_(disk),
      budget_(options.memory_limit_bytes) {}

void ShardStore::ParallelTiles(int64_t begin, int64_t end,
                               const std::function<void(int64_t, int64_t)>& fn) const {
  const int n = pool_->num_threads();
  pool_->Run([&](int t) { ForEachOwnedTile(begin, end, t, n, fn); });
}

absl::StatusOr<int64_t> ShardStore::CreateJob(const JobConfig& requested) {
  OFFLOAD_RETURN_IF_ERROR(ValidateJobId(requested.job_id));
  if (requested.ranges.empty()) return absl::InvalidArgumentError("ranges is empty");
  if (requested.param_dtype == DType::kFp32) {
    return absl::InvalidArgumentError("param_dtype must be FP16 or BF16");
  }
  if (requested.state_dtype == DType::kFp16) {
    return absl::InvalidArgumentError("state_dtype must be FP32 or BF16");
  }
  JobConfig config = requested;
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
  // After the ranges' own checks, so the groups are checked against sane ranges.
  if (config.groups.empty()) config.groups = {DefaultParamGroup(config.ranges, config.adam)};
  OFFLOAD_RETURN_IF_ERROR(ValidateGroups(config.groups, config.ranges));

  auto job = std::make_shared<Job>();
  int64_t bytes = 0;
  for (const RangeSpec& r : config.ranges) {
    bytes += ViewStride(r.length) * StateBytesPerElement(config.state_dtype);
  }
  int64_t disk_bytes = 0;
  for (const RangeSpec& r : config.ranges) {
    disk_bytes += StateFileBytes(r.length, config.state_dtype);
  }
  if (config.state_tier == StateTier::kDisk && disk_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", config.job_id,
                     " asks for its optimizer state on disk but this server has no "
                     "disk tier (start it with --state_dir)"));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (jobs_.count(config.job_id) != 0) {
      return absl::AlreadyExistsError(
          absl::StrCat("job ", config.job_id, " already exists on this shard"));
    }
    bool on_disk = config.state_tier == StateTier::kDisk;
    if (config.state_tier == StateTier::kAuto && disk_ != nullptr) {
      on_disk = options_.state_on_disk || bytes > budget_.limit() - budget_.used();
    }
    if (on_disk) {
      const int64_t free_bytes = disk_->FreeBytes();
      if (free_bytes >= 0 && disk_bytes > free_bytes) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "job ", config.job_id, "'s optimizer state needs ", disk_bytes, " bytes on disk but ",
            disk_->dir(), " has ", free_bytes, " bytes free (in memory it would need ", bytes,
            " bytes; the shard holds ", budget_.used(), " of its ", budget_.limit(),
            " byte limit, --memory_limit)"));
      }
    } else {
      absl::Status reserved = budget_.Reserve(bytes, absl::StrCat("job ", config.job_id));
      if (!reserved.ok()) {
        if (disk_ == nullptr) return reserved;
        // The tier was asked for memory, or AUTO chose it: name the disk too.
        return absl::ResourceExhaustedError(absl::StrCat(
            reserved.message(), "; state_tier MEMORY was asked, though the disk tier at ",
            disk_->dir(), " has ", disk_->FreeBytes(), " bytes free"));
      }
      job->state_reservation = Reservation(&budget_, bytes);
    }
    config.state_tier = on_disk ? StateTier::kDisk : StateTier::kMemory;
    // Claim the id now so a concurrent create of the same job fails; the state is filled below
    // before anyone can step on it (a step needs loaded weights, and loads need the ranges).
    jobs_[config.job_id] = nullptr;
  }
  job->config = config;
  auto unclaim = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.erase(config.job_id);
  };
  for (size_t i = 0; i < config.ranges.size(); ++i) {
    auto range = std::make_unique<RangeState>();
    range->spec = config.ranges[i];
    range->index = static_cast<int>(i);
    const int64_t range_end = range->spec.offset + range->spec.length;
    for (size_t g = 0; g < config.groups.size(); ++g) {
      const int64_t lo = std::max(config.groups[g].offset, range->spec.offset);
      const int64_t hi = std::min(config.groups[g].offset + config.groups[g].length, range_end);
      if (lo < hi) {
        range->group_pieces.push_back(
            RangeGroupPiece{lo - range->spec.offset, hi - range->spec.offset, static_cast<int>(g)});
      }
    }
    range->state_dtype = config.state_dtype;
    if (config.state_tier == StateTier::kDisk) {
      // Preallocated blocks read as zeros: the state of a new job, with nothing written.
      absl::StatusOr<std::unique_ptr<StateFile>> file =
          disk_->CreateStateFile(config.job_id, static_cast<int>(i), range->spec.length,
                                 /*staging=*/false, config.state_dtype);
      if (!file.ok()) {
        job->ranges.clear();  // unlinks the files made so far
        unclaim();
        return file.status();
      }
      range->file = *std::move(file);
      job->ranges.push_back(std::move(range));
      continue;
    }
    absl::StatusOr<HostBuffer> storage = HostBuffer::Allocate(range->storage_bytes());
    if (!storage.ok()) {
      unclaim();
      return storage.status();
    }
    range->storage = *std::move(storage);
    range->CarveViews();
    RangeState* rs = range.get();
    // First touch by the tile owners: the pages of a tile land where its thread runs.
    const int moment_size = DTypeSize(rs->state_dtype);
    ParallelTiles(0, rs->spec.length, [rs, moment_size](int64_t lo, int64_t hi) {
      std::memset(rs->param + lo, 0, (hi - lo) * 4);
      std::memset(static_cast<char*>(rs->exp_avg) + lo * moment_size, 0, (hi - lo) * moment_size);
      std::memset(static_cast<char*>(rs->exp_avg_sq) + lo * moment_size, 0,
                  (hi - lo) * moment_size);
    });
    job->ranges.push_back(std::move(range));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_[config.job_id] = job;
  }
  return config.state_tier == StateTier::kDisk ? int64_t{0} : bytes;
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
  std::vector<float> from_disk;
  int64_t at = offset;
  for (auto [r, m] : pieces) {
    const int64_t begin = at - r->spec.offset;
    std::lock_guard<std::mutex> lock(r->tensors_mu);
    if (!r->state_lost.empty()) return absl::DataLossError(r->state_lost);
    for (int64_t done = 0; done < m; done += chunk_elements) {
      const int64_t n = std::min(chunk_elements, m - done);
      chunk.resize(n * DTypeSize(dtype));
      if (r->file != nullptr && dtype == DType::kFp32) {
        // What a checkpoint reads: straight from the file into the chunk.
        OFFLOAD_RETURN_IF_ERROR(r->file->Read(static_cast<int>(tensor), begin + done, n,
                                              reinterpret_cast<float*>(chunk.data())));
      } else if (r->file != nullptr) {
        from_disk.resize(n);
        OFFLOAD_RETURN_IF_ERROR(
            r->file->Read(static_cast<int>(tensor), begin + done, n, from_disk.data()));
        ConvertFromFloat(from_disk.data(), n, dtype, chunk.data());
      } else if (r->TensorDType(tensor) == DType::kBf16) {
        // bf16 moments, widened exactly (moments are read as fp32 only).
        const uint16_t* from = static_cast<const uint16_t*>(r->Tensor(tensor)) + begin + done;
        float* to = reinterpret_cast<float*>(chunk.data());
        for (int64_t i = 0; i < n; ++i) to[i] = Bf16ToFloat(from[i]);
      } else {
        ConvertFromFloat(static_cast<const float*>(r->Tensor(tensor)) + begin + done, n, dtype,
                         chunk.data());
      }
      if (!emit(at + done, n, chunk)) return absl::OkStatus();
    }
    at += m;
  }
  return absl::OkStatus();
}

}  // namespace offload
