// The dense 16-bit tensor-core peak that MFU is measured against: the vendor's datasheet figure
// for the GPUs it names (an H100 SXM: 989.4 TFLOP/s), else an estimate from the SM count, the
// boost clock and the architecture's per-SM rate. Host arithmetic, tested on the CPU.
#ifndef OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_PEAK_FLOPS_H_
#define OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_PEAK_FLOPS_H_

#include <cstdint>
#include <string>

namespace offload {

struct PeakFlops {
  double flops = 0;    // 0: unknown
  std::string source;  // "datasheet H100 SXM", "estimated: 132 SMs x 2048 FMA x 1980 MHz", ...
};

// name: cudaDeviceProp::name ("NVIDIA H100 80GB HBM3"); compute capability major.minor.
PeakFlops Bf16PeakFlops(const std::string& name, int major, int minor, int sm_count,
                        int64_t clock_khz);

}  // namespace offload

#endif  // OFFLOAD_GPU_TRAINER_CUDA_RUNTIME_PEAK_FLOPS_H_
