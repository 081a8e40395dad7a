#include "base/placement/cpu_list.h"

#include <sched.h>

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace offload {

std::vector<int> AllowedCpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
    }
  }
  return cpus;
}

absl::StatusOr<std::vector<int>> ParseCpuList(absl::string_view text) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("CPU list \"", text, "\": ", why, " (a list such as 2-7,10)"));
  };
  if (text.empty()) return bad("empty");
  const std::vector<int> allowed = AllowedCpus();
  std::vector<int> cpus;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    const std::vector<absl::string_view> ends = absl::StrSplit(item, absl::MaxSplits('-', 1));
    int first = 0, last = 0;
    if (!absl::SimpleAtoi(ends[0], &first) || first < 0 ||
        (ends.size() == 2 && (!absl::SimpleAtoi(ends[1], &last) || last < 0))) {
      return bad(absl::StrCat("\"", item, "\" is not a CPU number or a range a-b"));
    }
    if (ends.size() == 1) last = first;
    if (last < first) return bad(absl::StrCat("the range ", item, " is reversed"));
    if (last >= CPU_SETSIZE) return bad(absl::StrCat("CPU ", last, " is past ", CPU_SETSIZE - 1));
    for (int c = first; c <= last; ++c) cpus.push_back(c);
  }
  std::sort(cpus.begin(), cpus.end());
  if (auto twice = std::adjacent_find(cpus.begin(), cpus.end()); twice != cpus.end()) {
    return bad(absl::StrCat("CPU ", *twice, " is listed twice"));
  }
  for (int c : cpus) {
    if (!std::binary_search(allowed.begin(), allowed.end(), c)) {
      return bad(absl::StrCat("this process may not run on CPU ", c, "; it may run on ",
                              FormatCpuList(allowed)));
    }
  }
  return cpus;
}

std::string FormatCpuList(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    absl::StrAppend(&out, out.empty() ? "" : ",", cpus[i]);
    if (j > i) absl::StrAppend(&out, "-", cpus[j]);
    i = j + 1;
  }
  return out;
}

}  // namespace offload
