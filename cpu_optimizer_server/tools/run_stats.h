// The figure a bench reports for a quantity measured in several runs of one invocation: the
// median, with the spread (min and max) beside it, since this machine is noisy and the spread is
// part of the figure.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_TOOLS_RUN_STATS_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_TOOLS_RUN_STATS_H_

#include <algorithm>
#include <vector>

namespace offload {

struct Spread {
  double median = 0;
  double min = 0;
  double max = 0;
};

// Of one value per run (not empty); an even count takes the mean of the middle two.
inline Spread SpreadOf(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t k = values.size();
  Spread s;
  s.min = values.front();
  s.max = values.back();
  s.median = k % 2 == 1 ? values[k / 2] : (values[k / 2 - 1] + values[k / 2]) / 2;
  return s;
}

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_TOOLS_RUN_STATS_H_
