// --metrics_address, shared by every binary that serves /metrics.
#ifndef OFFLOAD_BASE_METRICS_METRICS_FLAGS_H_
#define OFFLOAD_BASE_METRICS_METRICS_FLAGS_H_

#include <string>

#include "absl/flags/declare.h"

ABSL_DECLARE_FLAG(std::string, metrics_address);

#endif  // OFFLOAD_BASE_METRICS_METRICS_FLAGS_H_
