#include "base/placement/cpu_list.h"

#include <vector>

#include "gtest/gtest.h"

namespace offload {
namespace {

TEST(CpuListTest, ParsesWhatLinuxWritesAndFormatsItBack) {
  const std::vector<int> allowed = AllowedCpus();
  ASSERT_FALSE(allowed.empty());
  const std::string all = FormatCpuList(allowed);
  absl::StatusOr<std::vector<int>> parsed = ParseCpuList(all);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed, allowed);
  parsed = ParseCpuList(std::to_string(allowed.back()));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed, std::vector<int>{allowed.back()});
}

TEST(CpuListTest, FormatsRunsAsRanges) {
  EXPECT_EQ(FormatCpuList({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(FormatCpuList({5}), "5");
  EXPECT_EQ(FormatCpuList({}), "");
}

TEST(CpuListTest, RefusesWhatIsNotAListOfAllowedCpus) {
  const std::vector<int> allowed = AllowedCpus();
  const std::string first = std::to_string(allowed.front());
  for (const std::string& text :
       {std::string(""), std::string("a"), std::string("1-"), std::string("-1"), std::string("3-1"),
        std::string("1,,2"), first + "," + first, std::string("100000"),
        std::to_string(allowed.back() + 1)}) {
    absl::StatusOr<std::vector<int>> parsed = ParseCpuList(text);
    EXPECT_FALSE(parsed.ok()) << "\"" << text << "\"";
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_NE(parsed.status().message().find("CPU list"), absl::string_view::npos) << text;
  }
}

}  // namespace
}  // namespace offload
