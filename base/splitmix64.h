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

// A float uniform in [-1, 1) from the next value: 24 bits, so every value is exact in fp32.
inline float SplitMix64Uniform(uint64_t* state) {
  return static_cast<float>(SplitMix64(state) >> 40) * 0x1p-23f - 1.0f;
}

}  // namespace offload

#endif  // OFFLOAD_BASE_SPLITMIX64_H_
