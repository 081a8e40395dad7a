#include "model_spec/gradient_buckets.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "model_spec/gpt2_config.h"
#include "model_spec/param_layout.h"

namespace offload {

GradientBucketPlan PlanGradientBuckets(const Gpt2Config& config, int64_t padded_length,
                                       int64_t bucket_elements) {
  GradientBucketPlan plan;
  // The padding above the parameters is a bucket of its own: its gradients are zeros, and the
  // owner of that part of the flat space sends them like the rest.
  const int64_t num_params = Gpt2NumParams(config);
  if (padded_length > num_params) {
    plan.buckets.push_back(GradientBucket{num_params, padded_length, 0, false});
  }
  // Then units in backward order, grouped greedily from the top: a bucket closes once it holds
  // bucket_elements (with bucket_elements <= 1, after every unit) or at the embeddings.
  const int units = Gpt2NumUnits(config);
  plan.bucket_of_unit.assign(units, -1);
  GradientBucket open;
  for (int unit = units - 1; unit >= 0; --unit) {
    const ParamRange r = Gpt2UnitRange(config, unit);
    if (open.units == 0) open = GradientBucket{r.begin, r.end, 0, false};
    open.lo = r.begin;
    open.units++;
    open.embeddings = open.embeddings || unit == 0;
    plan.bucket_of_unit[unit] = static_cast<int>(plan.buckets.size());
    if (open.size() >= bucket_elements || unit == 0) {
      plan.buckets.push_back(open);
      open = GradientBucket{};
    }
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
