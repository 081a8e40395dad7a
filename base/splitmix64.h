// splitmix64 (Steele, Lea, Flood 2014): a portable 64-bit generator with one word of state. The
// trainer's seeded choices (initialisation seeding, batch windows, text sampling) use it instead
// of std:: distributions, whose results differ between standard libraries.
#ifndef OFFLOAD_BASE_SPLITMIX64_H_
#define OFFLOAD_BASE_SPLITMIX64_H_

#include <cstdint>

namespace offload {

inline uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace offload

#endif  // OFFLOAD_BASE_SPLITMIX64_H_
