// CPU lists as Linux writes them (cpuset(7): "0-3,8,10-11"): the cores a server's Adam threads are
// pinned to when it shares a host with its trainer (--optimizer_cores, ARCHITECTURE.md section 16),
// so that the two never take turns on one core.
#ifndef OFFLOAD_BASE_PLACEMENT_CPU_LIST_H_
#define OFFLOAD_BASE_PLACEMENT_CPU_LIST_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace offload {

// The CPUs this process may run on (sched_getaffinity), ascending.
std::vector<int> AllowedCpus();

// Parses a non-empty CPU list into ascending, distinct CPU numbers, every one of which this
// process may run on; INVALID_ARGUMENT names what is wrong (the syntax, an empty or reversed
// range, a CPU listed twice or not allowed, with the allowed ones).
absl::StatusOr<std::vector<int>> ParseCpuList(absl::string_view text);

// The list back in its shortest form ("0-3,8").
std::string FormatCpuList(const std::vector<int>& cpus);

}  // namespace offload

#endif  // OFFLOAD_BASE_PLACEMENT_CPU_LIST_H_
