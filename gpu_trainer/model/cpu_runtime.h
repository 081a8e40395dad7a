// Which kernels the CPU backend's BLAS runs: OpenBLAS picks them from the CPU when it loads,
// unless OPENBLAS_CORETYPE names a set (some environments force "Haswell", the AVX2 kernels,
// which run this model's matrix products about 1.4x slower on an AVX-512 machine). Benchmarks
// and the trainer print it so a number can be read with its kernels.
#ifndef OFFLOAD_GPU_TRAINER_MODEL_CPU_RUNTIME_H_
#define OFFLOAD_GPU_TRAINER_MODEL_CPU_RUNTIME_H_

#include <string>

namespace offload {

// The kernel set OpenBLAS runs, e.g. "Haswell", "SkylakeX" or "Cooperlake".
std::string BlasCoreName();

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_MODEL_CPU_RUNTIME_H_
