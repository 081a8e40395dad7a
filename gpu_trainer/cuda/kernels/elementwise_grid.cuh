// The launch shape every grid-stride elementwise kernel of this directory uses: 256 threads a
// block, as many blocks as cover n up to a cap beyond which each thread loops. Indices in the
// loops are int64: n may exceed 2^31.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_KERNELS_ELEMENTWISE_GRID_CUH_
#define OFFLOAD_GPU_TRAINER_CUDA_KERNELS_ELEMENTWISE_GRID_CUH_

#include <algorithm>
#include <cstdint>

namespace offload {

constexpr int kElementwiseBlock = 256;

// n > 0.
inline int ElementwiseGrid(int64_t n) {
  constexpr int64_t kMaxGrid = int64_t{1} << 16;
  return static_cast<int>(
      std::min<int64_t>((n + kElementwiseBlock - 1) / kElementwiseBlock, kMaxGrid));
}

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_KERNELS_ELEMENTWISE_GRID_CUH_
