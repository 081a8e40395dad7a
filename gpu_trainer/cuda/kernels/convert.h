// Conversions between fp32 and a storage type on the device (round to nearest even, fp16
// overflow to +-inf, NaN stays NaN: the host conversions of base/dtype.h).
#ifndef OFFLOAD_GPU_TRAINER_CUDA_KERNELS_CONVERT_H_
#define OFFLOAD_GPU_TRAINER_CUDA_KERNELS_CONVERT_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace offload {

// out (n,) = in (n,) rounded to T.
template <typename T>
cudaError_t ConvertFromFloat(T* out, const float* in, int64_t n, cudaStream_t stream);
// out (n,) = in (n,) * scale in fp32, rounded to T: the mean of a reduce-scatter's sum over W
// ranks, rounded as the host's RoundGradients does.
template <typename T>
cudaError_t ConvertFromFloatScaled(T* out, const float* in, float scale, int64_t n,
                                   cudaStream_t stream);

// out (n,) = in (n,) widened to fp32.
template <typename T>
cudaError_t ConvertToFloat(float* out, const T* in, int64_t n, cudaStream_t stream);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_KERNELS_CONVERT_H_
