// The parts of the C ABI (offload_c.h) that need no optimizer and hold no state: the structs'
// layout as this library was compiled (offload_abi_layout), which a front end that mirrors the
// structs checks at load, and the gradient buckets' greedy plan (offload_plan_buckets), the C++
// trainer's own (model_spec/gradient_buckets.h), so every front end groups gradients alike.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "model_spec/gradient_buckets.h"
#include "optimizer_client/capi/capi_handle.h"
#include "optimizer_client/capi/offload_c.h"

namespace {

// A struct as a whole (field null), then each of its fields in declaration order.
#define OFFLOAD_STRUCT(s) \
  { #s, nullptr, 0, sizeof(s) }
#define OFFLOAD_FIELD(s, f) \
  { #s, #f, offsetof(s, f), sizeof(s::f) }

constexpr OffloadFieldLayout kLayout[] = {
    OFFLOAD_STRUCT(OffloadGroup),
    OFFLOAD_FIELD(OffloadGroup, offset),
    OFFLOAD_FIELD(OffloadGroup, length),
    OFFLOAD_FIELD(OffloadGroup, kind),
    OFFLOAD_FIELD(OffloadGroup, lr),
    OFFLOAD_FIELD(OffloadGroup, beta1),
    OFFLOAD_FIELD(OffloadGroup, beta2),
    OFFLOAD_FIELD(OffloadGroup, eps),
    OFFLOAD_FIELD(OffloadGroup, weight_decay),

    OFFLOAD_STRUCT(OffloadConfig),
    OFFLOAD_FIELD(OffloadConfig, abi_version),
    OFFLOAD_FIELD(OffloadConfig, job_id),
    OFFLOAD_FIELD(OffloadConfig, num_params),
    OFFLOAD_FIELD(OffloadConfig, world_size),
    OFFLOAD_FIELD(OffloadConfig, rank),
    OFFLOAD_FIELD(OffloadConfig, create_job),
    OFFLOAD_FIELD(OffloadConfig, dtype),
    OFFLOAD_FIELD(OffloadConfig, num_groups),
    OFFLOAD_FIELD(OffloadConfig, groups),
    OFFLOAD_FIELD(OffloadConfig, num_shards),
    OFFLOAD_FIELD(OffloadConfig, shard_addresses),
    OFFLOAD_FIELD(OffloadConfig, threads),
    OFFLOAD_FIELD(OffloadConfig, transport),
    OFFLOAD_FIELD(OffloadConfig, token),
    OFFLOAD_FIELD(OffloadConfig, tls_ca),
    OFFLOAD_FIELD(OffloadConfig, tls_cert),
    OFFLOAD_FIELD(OffloadConfig, tls_key),
    OFFLOAD_FIELD(OffloadConfig, tls_server_name),
    OFFLOAD_FIELD(OffloadConfig, call_timeout_seconds),
    OFFLOAD_FIELD(OffloadConfig, loss_scale_init),
    OFFLOAD_FIELD(OffloadConfig, loss_scale_window),
    OFFLOAD_FIELD(OffloadConfig, grad_clip),
    OFFLOAD_FIELD(OffloadConfig, trace_file),
    OFFLOAD_FIELD(OffloadConfig, state_tier),
    OFFLOAD_FIELD(OffloadConfig, adam_form),
    OFFLOAD_FIELD(OffloadConfig, state_dtype),
    OFFLOAD_FIELD(OffloadConfig, state_rounding),
    OFFLOAD_FIELD(OffloadConfig, step_timeout_floor_seconds),

    OFFLOAD_STRUCT(OffloadNamedTensor),
    OFFLOAD_FIELD(OffloadNamedTensor, name),
    OFFLOAD_FIELD(OffloadNamedTensor, offset),
    OFFLOAD_FIELD(OffloadNamedTensor, ndim),
    OFFLOAD_FIELD(OffloadNamedTensor, shape),

    OFFLOAD_STRUCT(OffloadStepReport),
    OFFLOAD_FIELD(OffloadStepReport, step),
    OFFLOAD_FIELD(OffloadStepReport, skipped),
    OFFLOAD_FIELD(OffloadStepReport, loss_scale),
    OFFLOAD_FIELD(OffloadStepReport, next_loss_scale),
    OFFLOAD_FIELD(OffloadStepReport, grad_norm),
    OFFLOAD_FIELD(OffloadStepReport, clip_coef),
    OFFLOAD_FIELD(OffloadStepReport, grad_multiplier),
    OFFLOAD_FIELD(OffloadStepReport, adam_step),
    OFFLOAD_FIELD(OffloadStepReport, skipped_steps),
    OFFLOAD_FIELD(OffloadStepReport, early_updated),
    OFFLOAD_FIELD(OffloadStepReport, early_rolled_back),

    OFFLOAD_STRUCT(OffloadRangeStep),
    OFFLOAD_FIELD(OffloadRangeStep, offset),
    OFFLOAD_FIELD(OffloadRangeStep, length),
    OFFLOAD_FIELD(OffloadRangeStep, t),

    OFFLOAD_STRUCT(OffloadFieldLayout),
    OFFLOAD_FIELD(OffloadFieldLayout, struct_name),
    OFFLOAD_FIELD(OffloadFieldLayout, field),
    OFFLOAD_FIELD(OffloadFieldLayout, offset),
    OFFLOAD_FIELD(OffloadFieldLayout, size),

    {nullptr, nullptr, 0, 0},
};

#undef OFFLOAD_FIELD
#undef OFFLOAD_STRUCT

absl::Status CheckedPlanBuckets(const uint64_t* sizes, int32_t n, uint64_t bucket_elements,
                                int32_t* bucket_of) {
  if (sizes == nullptr || bucket_of == nullptr) {
    return absl::InvalidArgumentError("offload_plan_buckets: sizes and bucket_of are required");
  }
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("offload_plan_buckets: n is ", n));
  if (bucket_elements == 0) {
    return absl::InvalidArgumentError(
        "offload_plan_buckets: bucket_elements is 0; 1 gives each member a bucket of its own");
  }
  constexpr uint64_t kMax = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> members(n);
  uint64_t total = 0;
  for (int32_t i = 0; i < n; ++i) {
    if (sizes[i] > kMax - total) {
      return absl::InvalidArgumentError(absl::StrCat(
          "offload_plan_buckets: the sizes add up to more than 2^63 - 1 at member ", i));
    }
    total += sizes[i];
    members[i] = static_cast<int64_t>(sizes[i]);
  }
  // A threshold beyond int64_t is beyond the total too: every member in one bucket.
  const std::vector<int> plan =
      bucket_elements > kMax ? std::vector<int>(n, 0)
                             : offload::PlanBuckets(members, static_cast<int64_t>(bucket_elements));
  for (int32_t i = 0; i < n; ++i) bucket_of[i] = plan[i];
  return absl::OkStatus();
}

}  // namespace

const OffloadFieldLayout* offload_abi_layout(void) { return kLayout; }

int32_t offload_plan_buckets(const uint64_t* sizes, int32_t n, uint64_t bucket_elements,
                             int32_t* bucket_of) {
  return offload::capi::Guard(
      [&] { return CheckedPlanBuckets(sizes, n, bucket_elements, bucket_of); });
}
