// Token + position embedding, forward and backward. The backward is deterministic: positions are
// grouped by token on the host (which holds the batch anyway), and each token's row of dwte is
// summed in fp32 by one thread per channel, in position order, then rounded once, instead of
// racing atomics into 16-bit values.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_KERNELS_ENCODER_H_
#define OFFLOAD_GPU_TRAINER_CUDA_KERNELS_ENCODER_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

namespace offload {

// out (B, T, C) = wte[inp[b, t]] + wpe[t]; inp (B, T) token ids already checked to be in range;
// wte (V, C), wpe (maxT, C).
template <typename T>
cudaError_t EncoderForward(T* out, const int32_t* inp, const T* wte, const T* wpe, int B, int Tn,
                           int C, cudaStream_t stream);

// The positions of a batch grouped by token: bucket u holds token tokens[u] and the flat
// positions (b * T + t) positions[offsets[u] .. offsets[u + 1]), ascending.
struct TokenBuckets {
  std::vector<int32_t> tokens;     // (U,) distinct token ids, ascending
  std::vector<int32_t> offsets;    // (U + 1,)
  std::vector<int32_t> positions;  // (n,)
};
// inp (n,) on the host.
void BuildTokenBuckets(const int32_t* inp, int64_t n, TokenBuckets* buckets);

// dwte (V, C): rows of tokens in the batch +=, the sum of dout over their positions (wte already
// holds the tied head's gradient); other rows untouched. dwpe (maxT, C): rows t < T = sum over b
// of dout[b, t], rows t >= T = 0. dout (B, T, C). The bucket arrays are device copies of a
// TokenBuckets of this batch's inputs, num_buckets = U.
template <typename T>
cudaError_t EncoderBackward(T* dwte, T* dwpe, const T* dout, const int32_t* bucket_tokens,
                            const int32_t* bucket_offsets, const int32_t* bucket_positions,
                            int num_buckets, int B, int Tn, int maxT, int C, cudaStream_t stream);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_KERNELS_ENCODER_H_
