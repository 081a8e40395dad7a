// Grouping a batch's positions by token for the deterministic embedding backward (encoder.h).
// One sort of (token, position) keys packed into 64 bits: positions come out ascending within
// each token without a stable sort, and no vocabulary size is needed, as a counting sort would.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "gpu_trainer/cuda/kernels/encoder.h"

namespace offload {

void BuildTokenBuckets(const int32_t* inp, int64_t n, TokenBuckets* buckets) {
  // Token ids are in [0, V) (checked by the caller), so the unsigned high half sorts as they do.
  std::vector<uint64_t> keys(static_cast<size_t>(n));  // (n,) token << 32 | position
  for (int64_t i = 0; i < n; ++i) {
    keys[i] = static_cast<uint64_t>(static_cast<uint32_t>(inp[i])) << 32 | static_cast<uint64_t>(i);
  }
  std::sort(keys.begin(), keys.end());
  buckets->tokens.clear();
  buckets->offsets.clear();
  buckets->positions.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int32_t token = static_cast<int32_t>(keys[i] >> 32);
    buckets->positions[i] = static_cast<int32_t>(keys[i] & 0xffffffffu);
    if (buckets->tokens.empty() || buckets->tokens.back() != token) {
      buckets->tokens.push_back(token);
      buckets->offsets.push_back(static_cast<int32_t>(i));
    }
  }
  buckets->offsets.push_back(static_cast<int32_t>(n));
}

}  // namespace offload
