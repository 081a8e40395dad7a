#include "base/utf8.h"

#include <gtest/gtest.h>

#include <string>

namespace offload {
namespace {

TEST(Utf8Test, AcceptsWellFormedText) {
  EXPECT_EQ(InvalidUtf8At(""), absl::string_view::npos);
  EXPECT_EQ(InvalidUtf8At("plain ascii"), absl::string_view::npos);
  EXPECT_EQ(InvalidUtf8At("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"), absl::string_view::npos);
  EXPECT_EQ(InvalidUtf8At("\xf4\x8f\xbf\xbf"), absl::string_view::npos);  // U+10FFFF
  EXPECT_EQ(Utf8SequenceLength("\xe2\x82\xac", 0), 3u);
}

TEST(Utf8Test, FindsTheFirstByteThatIsNot) {
  EXPECT_EQ(InvalidUtf8At("caf\xe9"), 3u);               // Latin-1, not UTF-8
  EXPECT_EQ(InvalidUtf8At("ab\x80"), 2u);                // a stray continuation byte
  EXPECT_EQ(InvalidUtf8At("a\xe2\x82"), 1u);             // truncated
  EXPECT_EQ(InvalidUtf8At("\xc0\xaf"), 0u);              // overlong '/'
  EXPECT_EQ(InvalidUtf8At("\xe0\x80\xaf"), 0u);          // overlong, three bytes
  EXPECT_EQ(InvalidUtf8At("x\xed\xa0\x80"), 1u);         // a UTF-16 surrogate
  EXPECT_EQ(InvalidUtf8At("\xf4\x90\x80\x80"), 0u);      // above U+10FFFF
  EXPECT_EQ(InvalidUtf8At(std::string("\xff", 1)), 0u);  // never in UTF-8
}

}  // namespace
}  // namespace offload
