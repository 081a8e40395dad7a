#include "optimizer_client/backends/inprocess_optimizer.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "cpu_optimizer_server/shard/state_loader.h"
#include "cpu_optimizer_server/shard/wire_convert.h"

namespace offload {
namespace {

// Parameters land straight in the trainer's 16-bit weights: the wave buffers are views of it.
class DirectParamSink final : public ParamSink {
 public:
  // params16 holds flat elements from `first` on.
  DirectParamSink(uint16_t* params16, int64_t first) : params16_(params16), first_(first) {}
  void* Buffer(int slot, int64_t offset, int64_t n) override {
    return params16_ + (offset - first_);
  }
  bool Send(int slot) override { return true; }

 private:
  uint16_t* const params16_;
  const int64_t first_;
};

}  // namespace

InProcessOptimizer::InProcessOptimizer(v1::PartitionMap map, int threads, SimdPath path,
                                       bool pin_threads)
    : OptimizerBackend(std::move(map)), pool_(ThreadPool::Options{threads, pin_threads}) {
  // In process the trainer's own memory is the limit; a budget would only refuse big models.
  ShardOptions options;
  options.memory_limit_bytes = std::numeric_limits<int64_t>::max() / 2;
  for (int s = 0; s < num_shards(); ++s) {
    stores_.push_back(std::make_unique<ShardStore>(options, &pool_, path));
  }
}

InProcessOptimizer::~InProcessOptimizer() { AbortStep(); }

absl::Status InProcessOptimizer::CreateJob(const std::string& job_id, const v1::AdamConfig& adam,
                                           DType param_dtype,
                                           const std::vector<v1::ParamGroup>& groups) {
  job_id_ = job_id;
  param_dtype_ = param_dtype;
  for (int s = 0; s < num_shards(); ++s) {
    absl::StatusOr<JobConfig> config =
        JobConfigFromProto(ShardRequest(s, job_id, adam, param_dtype, groups));
    if (!config.ok()) return config.status();
    if (absl::StatusOr<int64_t> bytes = stores_[s]->CreateJob(*config); !bytes.ok()) {
      return bytes.status();
    }
  }
  return absl::OkStatus();
}

namespace {

// The service's LoadState without the wire: the same StateLoader, chunks copied in as they come.
class InProcessShardLoad final : public ShardStateLoad {
 public:
  explicit InProcessShardLoad(std::unique_ptr<StateLoader> loader) : loader_(std::move(loader)) {}

  absl::Status Add(const StateSliceRef& slice) override {
    if (loader_ == nullptr) return absl::FailedPreconditionError("the load is finished");
    OFFLOAD_ASSIGN_OR_RETURN(StateTensor tensor, StateTensorFromProto(slice.tensor, "tensor"));
    std::string data(reinterpret_cast<const char*>(slice.values), slice.n * sizeof(float));
    absl::Status added = loader_->AddChunk(tensor, slice.offset, DType::kFp32, std::move(data));
    if (!added.ok()) loader_.reset();  // as the service ends the stream: nothing is applied
    return added;
  }

  absl::Status Finish() override {
    if (loader_ == nullptr) return absl::FailedPreconditionError("the load is finished");
    std::unique_ptr<StateLoader> loader = std::move(loader_);
    return loader->Apply().status();
  }

 private:
  std::unique_ptr<StateLoader> loader_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ShardStateLoad>> InProcessOptimizer::BeginShardLoad(
    int shard, const StepCounters* steps) {
  if (shard < 0 || shard >= num_shards()) {
    return absl::InvalidArgumentError(absl::StrCat("no shard ", shard));
  }
  OFFLOAD_ASSIGN_OR_RETURN(std::unique_ptr<StateLoader> loader,
                           StateLoader::Start(stores_[shard].get(), job_id_));
  if (steps != nullptr) {
    OFFLOAD_RETURN_IF_ERROR(loader->SetSteps(steps->completed_step, steps->adam_step));
  }
  return std::unique_ptr<ShardStateLoad>(new InProcessShardLoad(std::move(loader)));
}

absl::Status InProcessOptimizer::ReadSliceState(int slice, v1::StateTensor tensor, int64_t offset,
                                                int64_t n, float* out) {
  OFFLOAD_ASSIGN_OR_RETURN(StateTensor t, StateTensorFromProto(tensor, "tensor"));
  const v1::ShardSlice& s = map_.slices(slice);
  return stores_[s.shard_index()]->ReadState(job_id_, t, DType::kFp32, offset, n, int64_t{1} << 20,
                                             [&](int64_t at, int64_t m, const std::string& bytes) {
                                               std::memcpy(out + (at - offset), bytes.data(),
                                                           m * sizeof(float));
                                               return true;
                                             });
}

absl::Status InProcessOptimizer::DropJob() {
  absl::Status first;
  for (auto& store : stores_) first.Update(store->DropJob(job_id_));
  return first;
}

absl::Status InProcessOptimizer::OpenSlice(int slice, uint64_t step) {
  sessions_.resize(map_.slices_size());
  const v1::ShardSlice& s = map_.slices(slice);
  absl::StatusOr<std::unique_ptr<StepSession>> session =
      StepSession::Open(stores_[s.shard_index()].get(), job_id_, s.range_index(), step);
  if (!session.ok()) return session.status();
  sessions_[slice] = std::move(*session);
  step_ = step;
  return absl::OkStatus();
}

absl::Status InProcessOptimizer::SendSlice(int slice, int64_t offset, const uint16_t* grads,
                                           int64_t n, bool accumulate) {
  std::string data(reinterpret_cast<const char*>(grads), n * sizeof(uint16_t));
  return sessions_[slice]->AddGradients(offset, grad_dtype(), accumulate, std::move(data));
}

absl::Status InProcessOptimizer::SendSlice32(int slice, int64_t offset, const float* grads,
                                             int64_t n) {
  std::string data(reinterpret_cast<const char*>(grads), n * sizeof(float));
  return sessions_[slice]->AddGradients(offset, DType::kFp32, /*accumulate=*/true, std::move(data));
}

absl::StatusOr<StepCounters> InProcessOptimizer::CommitSlices(
    double lr, float grad_multiplier, bool skip, uint16_t* partition16,
    absl::Span<const double> group_lr, absl::Span<const RangeStep> range_steps) {
  DirectParamSink sink(partition16, partition_offset());
  StepCommitArgs args{
      step_, lr, grad_multiplier, skip, std::vector<double>(group_lr.begin(), group_lr.end()), {}};
  StepCounters counters;
  absl::Status first;
  for (size_t i = 0; i < sessions_.size(); ++i) {
    std::unique_ptr<StepSession>& session = sessions_[i];
    if (session == nullptr) continue;  // another rank's slice
    // The same list a server's shard gets over the wire: this slice's part.
    const v1::ShardSlice& s = map_.slices(static_cast<int>(i));
    args.range_steps = ClipRangeSteps(range_steps, static_cast<int64_t>(s.offset()),
                                      static_cast<int64_t>(s.offset() + s.length()));
    absl::StatusOr<StepOutcome> outcome = session->Commit(args, &sink);
    if (!outcome.ok()) {
      first.Update(outcome.status());
      continue;
    }
    counters.completed_step = outcome->step;
    counters.adam_step = outcome->adam_step;
    counters.early_updated += outcome->early_updated;
    counters.early_rolled_back += outcome->early_rolled_back;
  }
  sessions_.clear();
  if (!first.ok()) return first;
  return counters;
}

void InProcessOptimizer::AbortSlices() { sessions_.clear(); }

absl::Status InProcessOptimizer::UpdateSlice(int slice, int64_t offset, int64_t n, uint64_t t,
                                             double lr, float grad_multiplier,
                                             absl::Span<const double> group_lr) {
  StepCommitArgs args{
      step_, lr, grad_multiplier, false, std::vector<double>(group_lr.begin(), group_lr.end()), {}};
  if (t > 0) args.range_steps.push_back(RangeStep{offset, n, t});
  // A decline (false) is no error: the commit updates those elements as usual.
  return sessions_[slice]->UpdateEarly(args, offset, n).status();
}

}  // namespace offload
