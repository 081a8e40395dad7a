#include "base/metrics/metrics_flags.h"

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, metrics_address, "",
          "HOST:PORT to serve Prometheus /metrics on (port 0: any free port); empty: none");
