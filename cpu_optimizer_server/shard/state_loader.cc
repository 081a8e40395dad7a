#include "cpu_optimizer_server/shard/state_loader.h"

#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace offload {

namespace {

absl::string_view TensorName(StateTensor t) {
  switch (t) {
    case StateTensor::kMasterWeights:
      return "master weights";
    case StateTensor::kExpAvg:
      return "exp_avg";
    case StateTensor::kExpAvgSq:
      return "exp_avg_sq";
  }
  return "?";
}

}  // namespace

absl::StatusOr<std::unique_ptr<StateLoader>> StateLoader::Start(ShardStore* store,
                                                                const std::string& job_id) {
  OFFLOAD_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, store->FindJob(job_id));
  return std::unique_ptr<StateLoader>(new StateLoader(store, std::move(job)));
}

absl::Status StateLoader::AddChunk(StateTensor tensor, int64_t offset, DType dtype,
                                   std::string data) {
  if (dtype != DType::kFp32) {
    return absl::InvalidArgumentError(
        absl::StrCat("state chunks load as FP32; this one is ", DTypeName(dtype)));
  }
  if (data.empty()) return absl::InvalidArgumentError("state chunk has no data");
  if (data.size() % 4 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("state chunk has ", data.size(), " bytes, not a multiple of 4 for fp32"));
  }
  const int64_t n = static_cast<int64_t>(data.size()) / 4;
  const float* values = reinterpret_cast<const float*>(data.data());
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(values[i]) || (tensor == StateTensor::kExpAvgSq && values[i] < 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(TensorName(tensor), " element ", offset + i, " is ", values[i],
                       "; it must be finite", tensor == StateTensor::kExpAvgSq ? " and >= 0" : ""));
    }
  }
  // A chunk may span adjacent ranges (a rank loading its whole partition); split it per range.
  std::vector<Chunk> pieces;
  std::vector<int64_t> values_at;  // where each piece starts in `values`
  for (int64_t done = 0; done < n;) {
    OFFLOAD_ASSIGN_OR_RETURN(RangeState * range, FindRangeFor(*job_, offset + done, 1));
    const RangeSpec& spec = range->spec;
    const int64_t begin = offset + done - spec.offset;
    const int64_t m = std::min(n - done, spec.length - begin);
    if (auto overlap = covered_[{range, tensor}].FindOverlap(begin, begin + m)) {
      return absl::InvalidArgumentError(
          absl::StrCat(TensorName(tensor), " chunk [", offset, ", ", offset + n,
                       ") overlaps a chunk of this load at [", overlap->first + spec.offset, ", ",
                       overlap->second + spec.offset, ")"));
    }
    pieces.push_back(Chunk{tensor, range, begin, std::string(), m});
    values_at.push_back(done);
    done += m;
  }
  // Ranges on disk take their pieces into staging files now; the rest are held in memory.
  int64_t in_memory = 0;
  for (const Chunk& c : pieces) in_memory += c.range->file == nullptr ? c.n * 4 : 0;
  if (in_memory > 0) {
    absl::StatusOr<Reservation> held = store_->budget()->Take(in_memory, "state chunks of a load");
    if (!held.ok()) return held.status();
    held_bytes_.Absorb(*std::move(held));
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    Chunk& c = pieces[i];
    if (c.range->file == nullptr) continue;
    OFFLOAD_ASSIGN_OR_RETURN(StateFile * staging, Staging(c.range));
    // A failed write leaves this chunk uncovered, so nothing of it is ever applied.
    OFFLOAD_RETURN_IF_ERROR(
        staging->Write(static_cast<int>(tensor), c.begin, c.n, values + values_at[i]));
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    Chunk& c = pieces[i];
    if (c.range->file == nullptr) {
      c.data = pieces.size() == 1 ? std::move(data)  // the common case: no copy
                                  : data.substr(values_at[i] * 4, c.n * 4);
    }
    covered_[{c.range, tensor}].Insert(c.begin, c.begin + c.n);
    chunks_.push_back(std::move(c));
  }
  return absl::OkStatus();
}

absl::Status StateLoader::SetSteps(uint64_t completed_step, uint64_t adam_step) {
  if (completed_step >= (uint64_t{1} << 62) || adam_step > completed_step) {
    return absl::InvalidArgumentError(
        absl::StrCat("completed_step ", completed_step, " and adam_step ", adam_step,
                     " are not a step count: adam_step <= completed_step < 2^62 is required"));
  }
  steps_ = std::make_pair(completed_step, adam_step);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> StateLoader::Apply() {
  if (job_->dropped) {
    return absl::NotFoundError(absl::StrCat("job ", job_->config.job_id, " was dropped"));
  }
  // Take the step lease of every range so no step runs while the state is replaced; give back
  // what was taken if one is busy.
  std::vector<RangeState*> leased;
  for (const auto& r : job_->ranges) {
    std::lock_guard<std::mutex> lock(r->mu);
    if (r->step_in_progress) {
      for (RangeState* l : leased) {
        std::lock_guard<std::mutex> l_lock(l->mu);
        l->step_in_progress = false;
      }
      return absl::FailedPreconditionError(absl::StrCat("a step stream is open on range ", r->index,
                                                        " of job ", job_->config.job_id,
                                                        "; load the state between steps"));
    }
    r->step_in_progress = true;
    leased.push_back(r.get());
  }
  int64_t elements = 0;
  absl::Status disk_status;
  for (auto& [range, file] : staging_) {
    std::lock_guard<std::mutex> tensors_lock(range->tensors_mu);
    disk_status = ApplyFromStaging(range);
    if (!disk_status.ok()) break;
  }
  if (!disk_status.ok()) {
    for (RangeState* r : leased) {
      std::lock_guard<std::mutex> lock(r->mu);
      r->step_in_progress = false;
    }
    return disk_status;
  }
  for (const Chunk& c : chunks_) {
    if (c.range->file != nullptr) {
      elements += c.n;
      continue;
    }
    void* dst = c.range->Tensor(c.tensor);
    const bool to_bf16 = c.range->TensorDType(c.tensor) == DType::kBf16;
    const char* src = c.data.data();
    const int64_t n = static_cast<int64_t>(c.data.size()) / 4;
    std::lock_guard<std::mutex> tensors_lock(c.range->tensors_mu);
    store_->ParallelTiles(c.begin, c.begin + n, [&](int64_t lo, int64_t hi) {
      const float* from = reinterpret_cast<const float*>(src) + (lo - c.begin);
      if (to_bf16) {
        // bf16 moments: a checkpoint of bf16 state comes back exactly, one of fp32 state rounded
        // to nearest.
        ConvertFromFloat(from, hi - lo, DType::kBf16, static_cast<uint16_t*>(dst) + lo);
      } else {
        std::memcpy(static_cast<float*>(dst) + lo, from, (hi - lo) * 4);
      }
    });
    elements += n;
  }
  for (RangeState* r : leased) {
    std::lock_guard<std::mutex> lock(r->mu);
    auto it = covered_.find({r, StateTensor::kMasterWeights});
    if (it != covered_.end()) {
      it->second.ForEach([r](int64_t lo, int64_t hi) { r->loaded.Insert(lo, hi); });
    }
    if (steps_) {
      r->completed_step = steps_->first;
      r->adam_step = steps_->second;
    }
    r->step_in_progress = false;
  }
  chunks_.clear();
  staging_.clear();
  held_bytes_.Reset();
  // The chunks were as large as the state they loaded (4 bytes an element for the master weights
  // alone) and came in pieces below glibc's adaptive mmap threshold, so their free pages stay in
  // the heap, counted in the server's RSS for good: give them back.
  malloc_trim(0);
  return elements;
}

absl::StatusOr<StateFile*> StateLoader::Staging(RangeState* range) {
  auto it = staging_.find(range);
  if (it != staging_.end()) return it->second.get();
  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<StateFile> file,
                           store_->disk()->CreateStateFile(job_->config.job_id, range->index,
                                                           range->spec.length, /*staging=*/true));
  return staging_.emplace(range, std::move(file)).first->second.get();
}

absl::Status StateLoader::ApplyFromStaging(RangeState* range) {
  // A copy that fails part-way has changed the state file: the range is lost until a load
  // succeeds. The copy goes through the page cache, so a full disk meets the Sync, not a step.
  constexpr int64_t kCopyElements = int64_t{1} << 20;
  std::vector<float> buffer(kCopyElements);
  StateFile* staging = staging_.at(range).get();
  bool whole = true;
  absl::Status status;
  for (int t = 0; t < kStateTensors && status.ok(); ++t) {
    auto it = covered_.find({range, static_cast<StateTensor>(t)});
    if (it == covered_.end() || it->second.covered() != range->spec.length) whole = false;
    if (it == covered_.end()) continue;
    it->second.ForEach([&](int64_t lo, int64_t hi) {
      for (int64_t at = lo; at < hi && status.ok(); at += kCopyElements) {
        const int64_t n = std::min(kCopyElements, hi - at);
        status = staging->Read(t, at, n, buffer.data());
        if (status.ok()) status = range->file->Write(t, at, n, buffer.data());
      }
    });
  }
  if (status.ok()) status = range->file->Sync();
  if (!status.ok()) {
    range->state_lost = absl::StrCat(
        "the optimizer state of range ", range->index, " of job ", job_->config.job_id,
        " was lost when a load failed part-way (", status.message(),
        "): restore it from a checkpoint (a load of its master weights and both moments)");
    return status;
  }
  if (whole) range->state_lost.clear();
  return absl::OkStatus();
}

}  // namespace offload
