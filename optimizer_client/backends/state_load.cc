#include "optimizer_client/backends/state_load.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "optimizer_client/checkpoint/state_tensor_names.h"

namespace offload {

absl::Status CheckStateValues(v1::StateTensor tensor, int64_t offset, const float* values,
                              int64_t n) {
  const bool non_negative = tensor == v1::STATE_TENSOR_EXP_AVG_SQ;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(values[i]) || (non_negative && values[i] < 0)) {
      return absl::InvalidArgumentError(absl::StrCat(StateTensorNameOf(tensor), "[", offset + i,
                                                     "] is ", values[i], "; it must be finite",
                                                     non_negative ? " and >= 0" : ""));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<JobStateLoad>> JobStateLoad::Begin(OptimizerBackend* backend,
                                                                  const StepCounters* steps) {
  std::unique_ptr<JobStateLoad> load(new JobStateLoad(backend));
  for (int shard = 0; shard < backend->num_shards(); ++shard) {
    OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<ShardStateLoad> s,
                             backend->BeginShardLoad(shard, steps));
    load->shards_.push_back(std::move(s));
  }
  return load;
}

absl::Status JobStateLoad::Fail(absl::Status status) {
  shards_.clear();  // each shard's load ends unfinished: nothing applied
  ended_ = true;
  return status;
}

absl::Status JobStateLoad::CheckChunk(v1::StateTensor tensor, int64_t offset, int64_t n) {
  if (ended_) return absl::FailedPreconditionError("the state load has ended");
  const int64_t num_params = static_cast<int64_t>(backend_->partition().num_params());
  if (tensor != v1::STATE_TENSOR_MASTER_WEIGHTS && tensor != v1::STATE_TENSOR_EXP_AVG &&
      tensor != v1::STATE_TENSOR_EXP_AVG_SQ) {
    return Fail(absl::InvalidArgumentError(absl::StrCat("no state tensor ", tensor)));
  }
  if (n < 0 || offset < 0 || offset > num_params || n > num_params - offset) {
    return Fail(absl::OutOfRangeError(absl::StrCat("state [", offset, ", ", offset + n,
                                                   ") is outside the ", num_params,
                                                   " parameters (the padding after them loads "
                                                   "as zeros by itself)")));
  }
  return absl::OkStatus();
}

absl::Status JobStateLoad::Add(v1::StateTensor tensor, int64_t offset, const float* values,
                               int64_t n) {
  OFFLOAD_RETURN_IF_ERROR(CheckChunk(tensor, offset, n));
  if (values == nullptr) return Fail(absl::InvalidArgumentError("null values"));
  if (absl::Status s = CheckStateValues(tensor, offset, values, n); !s.ok()) return Fail(s);
  return Send(tensor, offset, values, n);
}

absl::Status JobStateLoad::AddZeros(v1::StateTensor tensor, int64_t offset, int64_t n) {
  OFFLOAD_RETURN_IF_ERROR(CheckChunk(tensor, offset, n));
  return SendZeros(tensor, offset, n);
}

absl::Status JobStateLoad::Send(v1::StateTensor tensor, int64_t offset, const float* values,
                                int64_t n) {
  // The slices tile [0, padded_length) in offset order: cut the chunk at their bounds.
  for (const v1::ShardSlice& slice : backend_->partition().slices()) {
    const int64_t lo = std::max<int64_t>(offset, slice.offset());
    const int64_t hi = std::min<int64_t>(offset + n, slice.offset() + slice.length());
    if (lo >= hi) continue;
    absl::Status s = shards_[slice.shard_index()]->Add(
        StateSliceRef{tensor, lo, values + (lo - offset), hi - lo});
    if (!s.ok()) return Fail(s);
  }
  return absl::OkStatus();
}

absl::Status JobStateLoad::SendZeros(v1::StateTensor tensor, int64_t offset, int64_t n) {
  static const std::vector<float> zeros(int64_t{1} << 16, 0.0f);
  for (int64_t done = 0; done < n;) {
    const int64_t m = std::min<int64_t>(n - done, static_cast<int64_t>(zeros.size()));
    OFFLOAD_RETURN_IF_ERROR(Send(tensor, offset + done, zeros.data(), m));
    done += m;
  }
  return absl::OkStatus();
}

absl::Status JobStateLoad::Finish() {
  if (ended_) return absl::FailedPreconditionError("the state load has ended");
  const v1::PartitionMap& map = backend_->partition();
  const int64_t num_params = static_cast<int64_t>(map.num_params());
  const int64_t pad = static_cast<int64_t>(map.padded_length()) - num_params;
  for (v1::StateTensor t :
       {v1::STATE_TENSOR_MASTER_WEIGHTS, v1::STATE_TENSOR_EXP_AVG, v1::STATE_TENSOR_EXP_AVG_SQ}) {
    OFFLOAD_RETURN_IF_ERROR(SendZeros(t, num_params, pad));
  }
  ended_ = true;
  std::vector<std::unique_ptr<ShardStateLoad>> shards = std::move(shards_);
  for (size_t i = 0; i < shards.size(); ++i) {
    absl::Status s = shards[i]->Finish();
    if (!s.ok()) {
      if (i == 0) return s;
      return absl::Status(s.code(), absl::StrCat(s.message(), " (shards 0 to ", i - 1,
                                                 " had applied their part of the load: load the "
                                                 "state again once the shard is back)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace offload
