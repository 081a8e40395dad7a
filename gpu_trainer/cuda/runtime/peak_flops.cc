#include "gpu_trainer/cuda/runtime/peak_flops.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace offload {

PeakFlops Bf16PeakFlops(const std::string& name, int major, int minor, int sm_count,
                        int64_t clock_khz) {
  // Datasheet dense (no sparsity) BF16 tensor-core peaks, TFLOP/s. The boost-clock estimate
  // below overstates these parts (an H100 SXM's 1980 MHz gives 1070, not its 989.4), so the
  // datasheet wins wherever the name says which part it is. Most specific names first.
  struct Known {
    const char* needle;
    const char* part;
    double tflops;
  };
  static constexpr Known kKnown[] = {
      {"H100 PCIe", "H100 PCIe", 756.0}, {"H100 NVL", "H100 NVL", 835.0},
      {"H200 NVL", "H200 NVL", 835.0},   {"GH200", "GH200", 989.4},
      {"H100", "H100 SXM", 989.4},       {"H200", "H200 SXM", 989.4},
      {"A100", "A100", 312.0},           {"L40S", "L40S", 362.0},
  };
  for (const Known& k : kKnown) {
    if (absl::StrContains(name, k.needle)) {
      return PeakFlops{k.tflops * 1e12, absl::StrCat("datasheet ", k.part)};
    }
  }
  // Dense FMA per SM per clock on 16-bit tensor cores; 2 flops each.
  int fma_per_sm_clock = 0;
  if (major == 8 && minor == 0) fma_per_sm_clock = 1024;  // A100-class
  if (major == 8 && minor > 0) fma_per_sm_clock = 512;    // GA10x / Ada
  if (major == 9) fma_per_sm_clock = 2048;                // Hopper
  if (fma_per_sm_clock == 0) return PeakFlops{0, "unknown architecture"};
  return PeakFlops{2.0 * fma_per_sm_clock * sm_count * (clock_khz * 1e3),
                   absl::StrFormat("estimated: %d SMs x %d FMA x %.0f MHz", sm_count,
                                   fma_per_sm_clock, clock_khz / 1e3)};
}

}  // namespace offload
