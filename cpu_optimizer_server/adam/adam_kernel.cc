#include "cpu_optimizer_server/adam/adam_kernel.h"

#include <cpuid.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cpu_optimizer_server/adam/adam_kernel_internal.h"

namespace offload {

absl::string_view SimdPathName(SimdPath path) {
  switch (path) {
    case SimdPath::kScalar:
      return "scalar";
    case SimdPath::kAvx2:
      return "avx2";
    case SimdPath::kAvx512:
      return "avx512";
  }
  return "?";
}

absl::StatusOr<SimdPath> ParseSimdPath(absl::string_view name) {
  SimdPath path;
  if (name == "auto") {
    return BestSimdPath();
  } else if (name == "scalar") {
    path = SimdPath::kScalar;
  } else if (name == "avx2") {
    path = SimdPath::kAvx2;
  } else if (name == "avx512") {
    path = SimdPath::kAvx512;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown SIMD path \"", name, "\"; expected one of auto, scalar, avx2, avx512"));
  }
  if (!SimdPathSupported(path)) {
    return absl::FailedPreconditionError(
        absl::StrCat("SIMD path \"", name,
                     "\" was requested but this CPU (or OS) does not support it; best "
                     "supported path is \"",
                     SimdPathName(BestSimdPath()), "\""));
  }
  return path;
}

uint32_t StochasticRoundingKey(uint64_t t) {
  // splitmix64's finalizer: neighbouring steps get unrelated keys.
  uint64_t z = t + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<uint32_t>(z >> 32) ^ static_cast<uint32_t>(z);
}

namespace {

// F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c" (GCC's
// does). It is only asked together with AVX2 or AVX-512, whose checks cover the OS saving the
// wide registers.
bool CpuHasF16c() {
  unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}

}  // namespace

bool SimdPathSupported(SimdPath path) {
  // __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0), not only
  // the CPUID bits. The init call makes it safe before static constructors have run.
  __builtin_cpu_init();
  switch (path) {
    case SimdPath::kScalar:
      return true;
    case SimdPath::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && CpuHasF16c();
    case SimdPath::kAvx512:
      // adam_avx512.cc is compiled with F, BW, VL, DQ, FMA and F16C.
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma") && CpuHasF16c();
  }
  return false;
}

SimdPath BestSimdPath() {
  if (SimdPathSupported(SimdPath::kAvx512)) return SimdPath::kAvx512;
  if (SimdPathSupported(SimdPath::kAvx2)) return SimdPath::kAvx2;
  return SimdPath::kScalar;
}

// An unsupported path yields nullptr rather than a function that would die of SIGILL somewhere
// inside a pass: ParseSimdPath is the place that turns a forced path into an error.
AdamKernelFn GetAdamKernel(SimdPath path) {
  if (!SimdPathSupported(path)) return nullptr;
  switch (path) {
    case SimdPath::kScalar:
      return &internal::AdamScalar;
    case SimdPath::kAvx2:
      return &internal::AdamAvx2;
    case SimdPath::kAvx512:
      return &internal::AdamAvx512;
  }
  return nullptr;
}

RooflineKernelFn GetRooflineKernel(SimdPath path) {
  if (!SimdPathSupported(path)) return nullptr;
  switch (path) {
    case SimdPath::kScalar:
      return &internal::RooflineScalar;
    case SimdPath::kAvx2:
      return &internal::RooflineAvx2;
    case SimdPath::kAvx512:
      return &internal::RooflineAvx512;
  }
  return nullptr;
}

namespace internal {

FloatToHalfFn GetFloatToHalf(SimdPath path) {
  if (!SimdPathSupported(path)) return nullptr;
  switch (path) {
    case SimdPath::kScalar:
      return nullptr;
    case SimdPath::kAvx2:
      return &FloatToHalfAvx2;
    case SimdPath::kAvx512:
      return &FloatToHalfAvx512;
  }
  return nullptr;
}

HalfToFloatFn GetHalfToFloat(SimdPath path) {
  if (!SimdPathSupported(path)) return nullptr;
  switch (path) {
    case SimdPath::kScalar:
      return nullptr;
    case SimdPath::kAvx2:
      return &HalfToFloatAvx2;
    case SimdPath::kAvx512:
      return &HalfToFloatAvx512;
  }
  return nullptr;
}

}  // namespace internal
}  // namespace offload
