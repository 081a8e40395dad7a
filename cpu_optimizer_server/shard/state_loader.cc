#include "cpu_optimizer_server/shard/state_loader.h"

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
    pieces.push_back(
        Chunk{tensor, range, begin, m == n ? std::string() : data.substr(done * 4, m * 4)});
    done += m;
  }
  absl::StatusOr<Reservation> held =
      store_->budget()->Take(static_cast<int64_t>(data.size()), "state chunks of a load");
  if (!held.ok()) return held.status();
  held_bytes_.Absorb(*std::move(held));
  if (pieces.size() == 1) pieces[0].data = std::move(data);  // the common case: no copy
  for (Chunk& c : pieces) {
    const int64_t m = static_cast<int64_t>(c.data.size()) / 4;
    covered_[{c.range, tensor}].Insert(c.begin, c.begin + m);
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
  for (const Chunk& c : chunks_) {
    float* dst = c.range->Tensor(c.tensor);
    const char* src = c.data.data();
    const int64_t n = static_cast<int64_t>(c.data.size()) / 4;
    std::lock_guard<std::mutex> tensors_lock(c.range->tensors_mu);
    store_->ParallelTiles(c.begin, c.begin + n, [&](int64_t lo, int64_t hi) {
      std::memcpy(dst + lo, src + (lo - c.begin) * 4, (hi - lo) * 4);
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
  held_bytes_.Reset();
  return elements;
}

}  // namespace offload
