// Atomic replacement: the target holds old or new contents, and failed writes leave no temp file.
#include "optimizer_client/checkpoint/atomic_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "optimizer_client/checkpoint/test_util.h"

namespace offload {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

using AtomicFileTest = TempDirTest;

TEST_F(AtomicFileTest, ReplacesContents) {
  ASSERT_TRUE(WriteFileAtomic(Path("f"), "old").ok());
  ASSERT_TRUE(WriteFileAtomic(Path("f"), "new contents").ok());
  EXPECT_EQ(ReadBytes(Path("f")), "new contents");
  EXPECT_THAT(List(dir_), ElementsAre("f"));
}

TEST_F(AtomicFileTest, UncommittedWriteLeavesOldFileAndNoTemp) {
  ASSERT_TRUE(WriteFileAtomic(Path("f"), "old").ok());
  {
    absl::StatusOr<std::unique_ptr<AtomicFileWriter>> w = AtomicFileWriter::Open(Path("f"));
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE((*w)->Append("half of the new").ok());
    EXPECT_EQ((*w)->bytes_written(), 15);
    EXPECT_EQ(List(dir_).size(), 2u);  // the temp file sits next to the target
  }
  EXPECT_EQ(ReadBytes(Path("f")), "old");
  EXPECT_THAT(List(dir_), ElementsAre("f"));
}

TEST_F(AtomicFileTest, MissingDirectoryIsNamed) {
  absl::Status s = WriteFileAtomic(Path("no/such/f"), "x");
  EXPECT_THAT(s.message(), HasSubstr("no/such/f"));
}

TEST_F(AtomicFileTest, TheCrc32IsOfTheBytesAsTheyStreamOut) {
  // The check value of CRC-32/ISO-HDLC, which zlib's crc32() computes.
  EXPECT_EQ(Crc32Update(0, "123456789", 9), 0xcbf43926u);
  EXPECT_EQ(Crc32Update(Crc32Update(0, "1234", 4), "56789", 5), 0xcbf43926u);
  absl::StatusOr<std::unique_ptr<AtomicFileWriter>> w = AtomicFileWriter::Open(Path("f"));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ((*w)->crc32(), 0u);
  ASSERT_TRUE((*w)->Append("12345").ok());
  ASSERT_TRUE((*w)->Append("").ok());
  ASSERT_TRUE((*w)->Append("6789").ok());
  EXPECT_EQ((*w)->crc32(), 0xcbf43926u);
  ASSERT_TRUE((*w)->Commit().ok());
  EXPECT_EQ(ReadBytes(Path("f")), "123456789");
}

TEST_F(AtomicFileTest, CommitTwiceIsAnError) {
  absl::StatusOr<std::unique_ptr<AtomicFileWriter>> w = AtomicFileWriter::Open(Path("f"));
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Commit().ok());
  EXPECT_FALSE((*w)->Commit().ok());
  EXPECT_FALSE((*w)->Append("x").ok());
  EXPECT_EQ(ReadBytes(Path("f")), "");
}

}  // namespace
}  // namespace offload
