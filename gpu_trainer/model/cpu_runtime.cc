#include "gpu_trainer/model/cpu_runtime.h"

#include <cblas.h>

#include <cstdlib>

namespace offload {

std::string BlasCoreName() {
  // openblas_get_corename() names the detected CPU even when OPENBLAS_CORETYPE forced others.
  if (const char* forced = std::getenv("OPENBLAS_CORETYPE")) return forced;
  const char* name = openblas_get_corename();
  return name != nullptr ? name : "";
}

}  // namespace offload
