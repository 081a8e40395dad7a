#include "optimizer_client/backends/remote_optimizer.h"

#include <algorithm>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace offload {
namespace {

// Prefixes a shard's error with its address, so the user knows which process to look at, unless
// the error already names the shard ("optimizer shard <address> went away", "the shard at
// <address>"): the address then appears once.
absl::Status Annotate(const absl::Status& s, const std::string& address) {
  if (s.ok()) return s;
  if (absl::StrContains(s.message(), absl::StrCat("shard ", address)) ||
      absl::StrContains(s.message(), absl::StrCat("shard at ", address))) {
    return s;
  }
  return absl::Status(s.code(), absl::StrCat("optimizer shard ", address, ": ", s.message()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<RemoteOptimizer>> RemoteOptimizer::Connect(
    v1::PartitionMap map, const std::vector<std::string>& addresses, const ClientOptions& options,
    TransportChoice transport) {
  if (addresses.size() != map.num_shards()) {
    return absl::InvalidArgumentError(absl::StrCat("the partition map has ", map.num_shards(),
                                                   " shards but ", addresses.size(),
                                                   " addresses were given"));
  }
  std::unique_ptr<RemoteOptimizer> backend(new RemoteOptimizer(std::move(map)));
  for (const std::string& address : addresses) {
    ClientOptions shard_options = options;
    shard_options.address = address;
    absl::StatusOr<std::unique_ptr<ShardClient>> client = ShardClient::Connect(shard_options);
    if (!client.ok()) return client.status();
    backend->clients_.push_back(std::move(*client));
    backend->addresses_.push_back(address);
    std::unique_ptr<StepTransport> owned;
    absl::StatusOr<StepTransport*> plane =
        SelectStepTransport(backend->clients_.back().get(), transport, &owned);
    if (!plane.ok()) return Annotate(plane.status(), address);
    backend->transports_.push_back(*plane);
    backend->owned_transports_.push_back(std::move(owned));
  }
  return backend;
}

std::string RemoteOptimizer::TransportNames() const {
  std::string names;
  for (const StepTransport* t : transports_) {
    if (names.find(std::string(t->name())) != std::string::npos) continue;
    absl::StrAppend(&names, names.empty() ? "" : ", ", t->name());
  }
  return names;
}

RemoteOptimizer::~RemoteOptimizer() { AbortStep(); }

absl::Status RemoteOptimizer::CreateJob(const std::string& job_id, const v1::AdamConfig& adam,
                                        DType param_dtype,
                                        const std::vector<v1::ParamGroup>& groups) {
  job_id_ = job_id;
  param_dtype_ = param_dtype;
  for (int s = 0; s < num_shards(); ++s) {
    v1::CreateJobRequest request = ShardRequest(s, job_id, adam, param_dtype, groups);
    request.set_state_tier(state_tier_);
    absl::StatusOr<v1::CreateJobResponse> created = clients_[s]->CreateJob(request);
    if (absl::IsAlreadyExists(created.status())) {
      // Left by an earlier run of this job (a trainer restart): its state is replaced by the
      // fresh initialisation or the checkpoint that follows.
      if (absl::Status d = clients_[s]->DropJob(job_id); !d.ok()) return Annotate(d, addresses_[s]);
      created = clients_[s]->CreateJob(request);
    }
    if (!created.ok()) return Annotate(created.status(), addresses_[s]);
  }
  return absl::OkStatus();
}

namespace {

// A LoadState stream whose errors name the shard.
class RemoteShardLoad final : public ShardStateLoad {
 public:
  RemoteShardLoad(std::unique_ptr<StateLoadStream> stream, std::string address)
      : stream_(std::move(stream)), address_(std::move(address)) {}

  absl::Status Add(const StateSliceRef& slice) override {
    if (stream_->Add(slice).ok()) return absl::OkStatus();
    // The shard ended the call: its status says why.
    return Annotate(stream_->Finish(), address_);
  }
  absl::Status Finish() override { return Annotate(stream_->Finish(), address_); }

 private:
  std::unique_ptr<StateLoadStream> stream_;
  std::string address_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ShardStateLoad>> RemoteOptimizer::BeginShardLoad(
    int shard, const StepCounters* steps) {
  if (shard < 0 || shard >= num_shards()) {
    return absl::InvalidArgumentError(absl::StrCat("no shard ", shard));
  }
  absl::StatusOr<std::unique_ptr<StateLoadStream>> stream =
      clients_[shard]->OpenLoad(job_id_, steps);
  if (!stream.ok()) return Annotate(stream.status(), addresses_[shard]);
  return std::unique_ptr<ShardStateLoad>(
      new RemoteShardLoad(std::move(*stream), addresses_[shard]));
}

absl::Status RemoteOptimizer::ReadSliceState(int slice, v1::StateTensor tensor, int64_t offset,
                                             int64_t n, float* out) {
  const int shard = static_cast<int>(map_.slices(slice).shard_index());
  // One message's worth per call: a call for more would have the shard send it all at once, and
  // gRPC would buffer up to its 64 MiB window of it here (checkpoints read whole tensors).
  const int64_t per_call = clients_[shard]->options().chunk_bytes / 4;
  for (int64_t done = 0; done < n; done += per_call) {
    const int64_t m = std::min(per_call, n - done);
    if (absl::Status s =
            clients_[shard]->ReadState(job_id_, tensor, DType::kFp32, offset + done, m, out + done);
        !s.ok()) {
      return Annotate(s, addresses_[shard]);
    }
  }
  return absl::OkStatus();
}

absl::Status RemoteOptimizer::DropJob() {
  absl::Status first;
  for (int s = 0; s < num_shards(); ++s) {
    first.Update(Annotate(clients_[s]->DropJob(job_id_), addresses_[s]));
  }
  return first;
}

absl::Status RemoteOptimizer::OpenSlice(int slice, uint64_t step) {
  streams_.resize(map_.slices_size());
  no_early_.resize(map_.slices_size());
  no_early_[slice] = false;
  const v1::ShardSlice& s = map_.slices(slice);
  absl::StatusOr<std::unique_ptr<StepStream>> stream = transports_[s.shard_index()]->OpenStep(
      job_id_, s.range_index(), s.offset(), s.length(), step);
  if (!stream.ok()) return Annotate(stream.status(), addresses_[s.shard_index()]);
  streams_[slice] = std::move(*stream);
  return absl::OkStatus();
}

absl::Status RemoteOptimizer::SendSlice(int slice, int64_t offset, const uint16_t* grads, int64_t n,
                                        bool accumulate) {
  return Annotate(streams_[slice]->SendGradients(offset, grads, grad_dtype(), n, accumulate),
                  addresses_[map_.slices(slice).shard_index()]);
}

absl::Status RemoteOptimizer::UpdateSlice(int slice, int64_t offset, int64_t n, uint64_t t,
                                          double lr, float grad_multiplier,
                                          absl::Span<const double> group_lr) {
  if (no_early_[slice]) return absl::OkStatus();
  absl::Status s = streams_[slice]->UpdateEarly(offset, n, t, lr, grad_multiplier, group_lr);
  if (s.code() == absl::StatusCode::kUnimplemented) {
    // The plane declines: the commit updates these elements as always.
    no_early_[slice] = true;
    return absl::OkStatus();
  }
  return Annotate(s, addresses_[map_.slices(slice).shard_index()]);
}

absl::Status RemoteOptimizer::SendSlice32(int slice, int64_t offset, const float* grads,
                                          int64_t n) {
  return Annotate(streams_[slice]->SendGradients(offset, grads, DType::kFp32, n,
                                                 /*accumulate=*/true),
                  addresses_[map_.slices(slice).shard_index()]);
}

uint16_t* RemoteOptimizer::SliceGradientArea(int slice) {
  if (slice < 0 || slice >= static_cast<int>(streams_.size()) || streams_[slice] == nullptr) {
    return nullptr;
  }
  return static_cast<uint16_t*>(streams_[slice]->GradientArea());
}

uint64_t RemoteOptimizer::SliceGradientAreaId(int slice) {
  if (slice < 0 || slice >= static_cast<int>(streams_.size()) || streams_[slice] == nullptr) {
    return 0;
  }
  return streams_[slice]->GradientAreaId();
}

absl::StatusOr<StepCounters> RemoteOptimizer::CommitSlices(
    double lr, float grad_multiplier, bool skip, uint16_t* partition16,
    absl::Span<const double> group_lr, absl::Span<const RangeStep> range_steps) {
  std::vector<int> open;  // the slices of this rank's step
  for (int i = 0; i < static_cast<int>(streams_.size()); ++i) {
    if (streams_[i] != nullptr) open.push_back(i);
  }
  std::vector<absl::StatusOr<v1::StepResult>> results(streams_.size(),
                                                      absl::UnknownError("not committed"));
  // Every shard streams its parameters back at once: each slice on its own thread.
  auto commit = [&](int i) {
    const v1::ShardSlice& s = map_.slices(i);
    const std::vector<RangeStep> slice_steps =
        ClipRangeSteps(range_steps, static_cast<int64_t>(s.offset()),
                       static_cast<int64_t>(s.offset() + s.length()));
    results[i] =
        streams_[i]->Commit(lr, grad_multiplier, skip,
                            partition16 + (s.offset() - partition_offset()), group_lr, slice_steps);
  };
  std::vector<std::thread> threads;
  for (size_t k = 1; k < open.size(); ++k) threads.emplace_back(commit, open[k]);
  if (!open.empty()) commit(open[0]);
  for (std::thread& t : threads) t.join();
  streams_.clear();
  StepCounters counters;
  for (int i : open) {
    if (!results[i].ok()) {
      return Annotate(results[i].status(), addresses_[map_.slices(i).shard_index()]);
    }
    counters.completed_step = results[i]->step();
    counters.adam_step = results[i]->adam_step();
    counters.early_updated += results[i]->early_updated();
    counters.early_rolled_back += results[i]->early_rolled_back();
  }
  return counters;
}

void RemoteOptimizer::AbortSlices() { streams_.clear(); }

}  // namespace offload
