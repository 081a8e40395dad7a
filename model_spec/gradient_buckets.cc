#include "model_spec/gradient_buckets.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "model_spec/gpt2_config.h"
#include "model_spec/param_layout.h"

namespace offload {

std::vector<int> PlanBuckets(absl::Span<const int64_t> sizes, int64_t bucket_elements) {
  std::vector<int> bucket_of(sizes.size());
  int bucket = 0;
  int64_t held = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    bucket_of[i] = bucket;
    held += sizes[i];
    if (held >= bucket_elements) {
      ++bucket;
      held = 0;
    }
  }
  return bucket_of;
}

GradientBucketPlan PlanGradientBuckets(const Gpt2Config& config, int64_t padded_length,
                                       int64_t bucket_elements) {
  GradientBucketPlan plan;
  // The padding above the parameters is a bucket of its own: its gradients are zeros, and the
  // owner of that part of the flat space sends them like the rest.
  const int64_t num_params = Gpt2NumParams(config);
  if (padded_length > num_params) {
    plan.buckets.push_back(GradientBucket{num_params, padded_length, 0, false});
  }
  // Then units in backward order, from ln_f down to the embeddings, grouped by the planner.
  const int units = Gpt2NumUnits(config);
  std::vector<int64_t> sizes;
  for (int unit = units - 1; unit >= 0; --unit) sizes.push_back(Gpt2UnitRange(config, unit).size());
  const std::vector<int> bucket_of = PlanBuckets(sizes, bucket_elements);
  const int first = static_cast<int>(plan.buckets.size());
  plan.bucket_of_unit.assign(units, -1);
  for (int k = 0; k < units; ++k) {
    const int unit = units - 1 - k;
    const int b = first + bucket_of[k];
    const ParamRange r = Gpt2UnitRange(config, unit);
    if (b == static_cast<int>(plan.buckets.size())) {
      plan.buckets.push_back(GradientBucket{r.begin, r.end, 0, false});
    }
    GradientBucket& bucket = plan.buckets[b];
    bucket.lo = r.begin;
    bucket.units++;
    bucket.embeddings = bucket.embeddings || unit == 0;
    plan.bucket_of_unit[unit] = b;
  }
  return plan;
}

std::vector<int64_t> RankCounts(int64_t lo, int64_t hi, int64_t partition_length, int world_size) {
  std::vector<int64_t> counts(std::max(0, world_size), 0);
  for (int r = 0; r < world_size; ++r) {
    const int64_t begin = std::max(lo, int64_t{r} * partition_length);
    const int64_t end = std::min(hi, (int64_t{r} + 1) * partition_length);
    counts[r] = std::max<int64_t>(0, end - begin);
  }
  return counts;
}

}  // namespace offload
