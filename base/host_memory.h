// How much memory the host can still give this process: MemAvailable from /proc/meminfo, the
// kernel's estimate of what can be allocated without swapping. Start-up checks compare a job's
// needs with it, so that a job too large for the machine is refused with the numbers instead of
// being killed by the OOM killer part way through.
#ifndef OFFLOAD_BASE_HOST_MEMORY_H_
#define OFFLOAD_BASE_HOST_MEMORY_H_

#include <cstdint>
#include <cstdio>

namespace offload {

// Bytes available, or -1 where /proc/meminfo cannot say (not Linux, or a sandbox without /proc).
inline int64_t AvailableHostBytes() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return -1;
  char line[256];
  long long kib = -1;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "MemAvailable: %lld kB", &kib) == 1) break;
  }
  std::fclose(f);
  return kib < 0 ? -1 : static_cast<int64_t>(kib) * 1024;
}

}  // namespace offload

#endif  // OFFLOAD_BASE_HOST_MEMORY_H_
