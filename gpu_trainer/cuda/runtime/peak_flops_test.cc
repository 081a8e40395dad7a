// Which peak MFU is measured against, for the GPUs the lent machines have and for one the table
// does not name. Runs on any machine.
#include "gpu_trainer/cuda/runtime/peak_flops.h"

#include "gtest/gtest.h"

namespace offload {
namespace {

TEST(PeakFlops, DatasheetFiguresForNamedParts) {
  // The lent H100's own name (cudaDeviceProp::name), and its H200.
  const PeakFlops h100 = Bf16PeakFlops("NVIDIA H100 80GB HBM3", 9, 0, 132, 1980000);
  EXPECT_DOUBLE_EQ(h100.flops, 989.4e12);
  EXPECT_EQ(h100.source, "datasheet H100 SXM");
  EXPECT_DOUBLE_EQ(Bf16PeakFlops("NVIDIA H200", 9, 0, 132, 1980000).flops, 989.4e12);
  EXPECT_DOUBLE_EQ(Bf16PeakFlops("NVIDIA H100 PCIe", 9, 0, 114, 1755000).flops, 756e12);
  EXPECT_DOUBLE_EQ(Bf16PeakFlops("NVIDIA H100 NVL", 9, 0, 132, 1785000).flops, 835e12);
  EXPECT_DOUBLE_EQ(Bf16PeakFlops("NVIDIA A100-SXM4-80GB", 8, 0, 108, 1410000).flops, 312e12);
}

TEST(PeakFlops, EstimatedFromTheArchitectureOtherwise) {
  // A Hopper part the table does not name: 2 x 2048 FMA x SMs x clock.
  const PeakFlops p = Bf16PeakFlops("NVIDIA Hopper Engineering Sample", 9, 0, 100, 1000000);
  EXPECT_DOUBLE_EQ(p.flops, 2.0 * 2048 * 100 * 1e9);
  EXPECT_EQ(p.source, "estimated: 100 SMs x 2048 FMA x 1000 MHz");
  EXPECT_EQ(Bf16PeakFlops("Some GPU", 7, 5, 40, 1500000).flops, 0.0);
}

}  // namespace
}  // namespace offload
