#include "optimizer_client/backends/optimizer_backend.h"

#include <algorithm>
#include <functional>

#include "absl/strings/str_cat.h"
#include "base/dtype_proto.h"
#include "base/status_macros.h"
#include "model_spec/partition.h"

namespace offload {

v1::CreateJobRequest ShardCreateJobRequest(const v1::PartitionMap& map, int shard,
                                           const std::string& job_id, const v1::AdamConfig& adam,
                                           DType param_dtype,
                                           const std::vector<v1::ParamGroup>& groups) {
  v1::CreateJobRequest request;
  request.set_job_id(job_id);
  for (const v1::ShardSlice& s : SlicesOfShard(map, shard)) {
    v1::ParamRange* range = request.add_ranges();
    range->set_offset(s.offset());
    range->set_length(s.length());
  }
  *request.mutable_adam() = adam;
  request.set_param_dtype(DTypeToProto(param_dtype));
  // All of them on every shard, so a group's index (a commit's group_lr) means one group.
  request.mutable_groups()->Assign(groups.begin(), groups.end());
  return request;
}

v1::CreateJobRequest OptimizerBackend::ShardRequest(
    int shard, const std::string& job_id, const v1::AdamConfig& adam, DType param_dtype,
    const std::vector<v1::ParamGroup>& groups) const {
  v1::CreateJobRequest request =
      ShardCreateJobRequest(map_, shard, job_id, adam, param_dtype, groups);
  request.set_state_dtype(state_dtype_);
  request.set_state_rounding(state_rounding_);
  return request;
}

absl::Status OptimizerBackend::LoadShardState(int shard, const std::vector<StateSliceRef>& slices,
                                              const StepCounters* steps) {
  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<ShardStateLoad> load, BeginShardLoad(shard, steps));
  for (const StateSliceRef& slice : slices) OFFLOAD_RETURN_IF_ERROR(load->Add(slice));
  return load->Finish();
}

absl::Status OptimizerBackend::LoadMasterWeights(const float* master) {
  for (int shard = 0; shard < num_shards(); ++shard) {
    std::vector<StateSliceRef> refs;
    for (const v1::ShardSlice& s : SlicesOfShard(map_, shard)) {
      refs.push_back(StateSliceRef{v1::STATE_TENSOR_MASTER_WEIGHTS,
                                   static_cast<int64_t>(s.offset()), master + s.offset(),
                                   static_cast<int64_t>(s.length())});
    }
    OFFLOAD_RETURN_IF_ERROR(LoadShardState(shard, refs, nullptr));
  }
  return absl::OkStatus();
}

absl::Status OptimizerBackend::ReadRange(v1::StateTensor tensor, int64_t offset, int64_t n,
                                         float* out) {
  const int64_t padded = static_cast<int64_t>(map_.padded_length());
  if (out == nullptr || offset < 0 || n < 0 || offset > padded || n > padded - offset) {
    return absl::OutOfRangeError(absl::StrCat(
        "[", offset, ", ", offset + n, ") is outside the flat space of ", padded, " elements"));
  }
  const int64_t end = offset + n;
  for (int i = 0; i < map_.slices_size(); ++i) {
    const v1::ShardSlice& s = map_.slices(i);
    const int64_t lo = std::max<int64_t>(offset, s.offset());
    const int64_t hi = std::min<int64_t>(end, s.offset() + s.length());
    if (lo >= hi) continue;
    OFFLOAD_RETURN_IF_ERROR(ReadSliceState(i, tensor, lo, hi - lo, out + (lo - offset)));
  }
  return absl::OkStatus();
}

absl::Status OptimizerBackend::ReadMasterWeights(float* master) {
  return ReadRange(v1::STATE_TENSOR_MASTER_WEIGHTS, 0, static_cast<int64_t>(map_.padded_length()),
                   master);
}

absl::Status OptimizerBackend::SetRank(int rank) {
  if (rank < 0 || rank >= static_cast<int>(map_.world_size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " outside a world of ", map_.world_size(), " ranks"));
  }
  rank_ = rank;
  return absl::OkStatus();
}

int64_t OptimizerBackend::partition_length() const {
  return static_cast<int64_t>(map_.padded_length() / map_.world_size());
}

int64_t OptimizerBackend::partition_offset() const { return rank_ * partition_length(); }

absl::Status OptimizerBackend::BeginStep(uint64_t step) {
  if (in_step_) return absl::FailedPreconditionError("a step is already open");
  for (int i = 0; i < map_.slices_size(); ++i) {
    if (static_cast<int>(map_.slices(i).rank()) != rank_) continue;
    if (absl::Status s = OpenSlice(i, step); !s.ok()) {
      AbortSlices();
      return s;
    }
  }
  in_step_ = true;
  step_ = step;
  return absl::OkStatus();
}

OptimizerBackend::SliceIterator OptimizerBackend::FirstSliceEndingAfter(int64_t offset) const {
  // Slices are sorted by offset.
  return std::upper_bound(map_.slices().begin(), map_.slices().end(), offset,
                          [](int64_t o, const v1::ShardSlice& s) {
                            return o < static_cast<int64_t>(s.offset() + s.length());
                          });
}

absl::Status OptimizerBackend::ForEachSlicePiece(
    int64_t offset, int64_t n, const char* what,
    const std::function<absl::Status(int slice, int64_t lo, int64_t hi)>& fn) {
  if (!in_step_) return absl::FailedPreconditionError(absl::StrCat(what, " outside a step"));
  const int64_t end = offset + n;
  if (offset < partition_offset() || n < 0 || end > partition_offset() + partition_length()) {
    return absl::OutOfRangeError(
        absl::StrCat(what, " [", offset, ", ", end, ") outside the partition of rank ", rank_, " [",
                     partition_offset(), ", ", partition_offset() + partition_length(), ")"));
  }
  auto it = FirstSliceEndingAfter(offset);
  for (; it != map_.slices().end() && static_cast<int64_t>(it->offset()) < end; ++it) {
    const int64_t lo = std::max<int64_t>(offset, it->offset());
    const int64_t hi = std::min<int64_t>(end, it->offset() + it->length());
    OFFLOAD_RETURN_IF_ERROR(fn(static_cast<int>(it - map_.slices().begin()), lo, hi));
  }
  return absl::OkStatus();
}

absl::Status OptimizerBackend::SendGradients(int64_t offset, const uint16_t* grads, int64_t n,
                                             bool accumulate) {
  return ForEachSlicePiece(offset, n, "gradients", [&](int slice, int64_t lo, int64_t hi) {
    const uint16_t* piece = grads + (lo - offset);
    if (const uint16_t* area = SliceGradientArea(slice);
        area != nullptr &&
        piece == area + (lo - static_cast<int64_t>(map_.slices(slice).offset()))) {
      in_place_elements_ += hi - lo;
    }
    return SendSlice(slice, lo, piece, hi - lo, accumulate);
  });
}

absl::Status OptimizerBackend::SendGradients32(int64_t offset, const float* grads, int64_t n) {
  return ForEachSlicePiece(offset, n, "gradients", [&](int slice, int64_t lo, int64_t hi) {
    return SendSlice32(slice, lo, grads + (lo - offset), hi - lo);
  });
}

absl::Status OptimizerBackend::UpdateEarly(int64_t offset, int64_t n, uint64_t t, double lr,
                                           float grad_multiplier,
                                           absl::Span<const double> group_lr) {
  if (in_step_ && t > step_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "update during backward [", offset, ", ", offset + n, ") has t ", t, ", past step ", step_,
        " being taken: no element has had more updates than steps"));
  }
  return ForEachSlicePiece(
      offset, n, "update during backward", [&](int slice, int64_t lo, int64_t hi) {
        return UpdateSlice(slice, lo, hi - lo, t, lr, grad_multiplier, group_lr);
      });
}

int OptimizerBackend::PlaceSlice(int64_t offset, int64_t n) const {
  if (!in_step_ || n <= 0 || offset < partition_offset() ||
      offset + n > partition_offset() + partition_length()) {
    return -1;
  }
  auto it = FirstSliceEndingAfter(offset);
  if (it == map_.slices().end() || static_cast<int64_t>(it->offset()) > offset ||
      offset + n > static_cast<int64_t>(it->offset() + it->length())) {
    return -1;  // not all in one slice
  }
  return static_cast<int>(it - map_.slices().begin());
}

uint16_t* OptimizerBackend::GradientPlace(int64_t offset, int64_t n) {
  const int slice = PlaceSlice(offset, n);
  if (slice < 0) return nullptr;
  uint16_t* area = SliceGradientArea(slice);
  return area == nullptr ? nullptr
                         : area + (offset - static_cast<int64_t>(map_.slices(slice).offset()));
}

uint64_t OptimizerBackend::GradientPlaceId(int64_t offset, int64_t n) {
  const int slice = PlaceSlice(offset, n);
  return slice < 0 || SliceGradientArea(slice) == nullptr ? 0 : SliceGradientAreaId(slice);
}

absl::StatusOr<StepCounters> OptimizerBackend::Commit(double lr, float grad_multiplier, bool skip,
                                                      uint16_t* partition16,
                                                      absl::Span<const double> group_lr,
                                                      absl::Span<const RangeStep> range_steps) {
  if (!in_step_) return absl::FailedPreconditionError("Commit outside a step");
  in_step_ = false;
  // Checked here, where the list is whole: a slice sees only its part, and clipping an
  // unsorted or overlapping list could hand a shard a list that looks valid.
  const int64_t padded = static_cast<int64_t>(map_.padded_length());
  int64_t prev_end = 0;
  for (size_t i = 0; i < range_steps.size(); ++i) {
    const RangeStep& rs = range_steps[i];
    absl::Status bad;
    if (rs.offset < 0 || rs.length <= 0 || rs.offset > padded || rs.length > padded - rs.offset) {
      bad = absl::InvalidArgumentError(
          absl::StrCat("range_steps[", i, "] [", rs.offset, ", +", rs.length,
                       ") is empty or not inside the flat space [0, ", padded, ")"));
    } else if (rs.offset < prev_end) {
      bad = absl::InvalidArgumentError(absl::StrCat(
          "range_steps[", i, "] starts at ", rs.offset, ", before range_steps[", i - 1,
          "] ends at ", prev_end, ": range steps must be sorted by offset and not overlap"));
    } else if (rs.t > step_) {
      // The shards bound t by their adam_step + 1, which is at most this step; checked here too
      // so that every shard refuses it, not only those holding the run.
      bad = absl::InvalidArgumentError(
          absl::StrCat("range_steps[", i, "] has t ", rs.t, ", past step ", step_,
                       " being committed: no element has had more updates than steps"));
    }
    if (!bad.ok()) {
      AbortSlices();
      return bad;
    }
    prev_end = rs.offset + rs.length;
  }
  absl::StatusOr<StepCounters> counters =
      CommitSlices(lr, grad_multiplier, skip, partition16, group_lr, range_steps);
  if (counters.ok() && counters->completed_step != step_) {
    return absl::DataLossError(
        absl::StrCat("the shards completed step ", counters->completed_step, " for step ", step_));
  }
  return counters;
}

void OptimizerBackend::AbortStep() {
  if (!in_step_) return;
  in_step_ = false;
  AbortSlices();
}

}  // namespace offload
