// safetensors: round trips of every dtype, the streaming producer path, a hand-built file in the
// official layout, and every malformed file rejected with a message that says what and where.
#include "optimizer_client/checkpoint/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "optimizer_client/checkpoint/test_util.h"

namespace offload {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

using SafetensorsTest = TempDirTest;

// u64 little endian header length + header + data, as the format defines it.
std::string Raw(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out + header + data;
}

TEST_F(SafetensorsTest, RoundTripsEveryDTypeAndMetadata) {
  const TensorDType dtypes[] = {TensorDType::kF32, TensorDType::kF16, TensorDType::kBF16,
                                TensorDType::kI32, TensorDType::kI64, TensorDType::kU16,
                                TensorDType::kU8};
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<SafetensorsTensor> tensors;
  for (TensorDType d : dtypes) {
    // Odd element counts (3 x 5), so the data offsets are not all multiples of 8.
    const int64_t n = 15 * TensorDTypeSize(d);
    std::vector<uint8_t> b(n);
    for (int64_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(i * 31 + static_cast<int>(d));
    bytes.push_back(b);
  }
  for (size_t i = 0; i < std::size(dtypes); ++i) {
    SafetensorsTensor t;
    t.name = absl::StrCat("t", i, dtypes[i] == TensorDType::kU8 ? ".weird \"name\"\n" : "");
    t.dtype = dtypes[i];
    t.shape = {3, 5};
    t.data = bytes[i].data();
    tensors.push_back(t);
  }
  tensors.push_back({"scalar", TensorDType::kF32, {}, bytes[0].data(), nullptr});
  tensors.push_back({"empty", TensorDType::kI64, {0, 4}, bytes[0].data(), nullptr});
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "100"}};
  ASSERT_TRUE(WriteSafetensors(Path("a.safetensors"), tensors, meta).ok());

  absl::StatusOr<std::unique_ptr<SafetensorsReader>> r =
      SafetensorsReader::Open(Path("a.safetensors"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->metadata(), meta);
  ASSERT_EQ((*r)->entries().size(), tensors.size());
  for (size_t i = 0; i < std::size(dtypes); ++i) {
    const SafetensorsEntry* e = (*r)->Find(tensors[i].name);
    ASSERT_NE(e, nullptr) << tensors[i].name;
    EXPECT_EQ(e->dtype, dtypes[i]);
    EXPECT_THAT(e->shape, ElementsAre(3, 5));
    EXPECT_EQ(std::memcmp((*r)->Data(*e), bytes[i].data(), bytes[i].size()), 0);
  }
  const SafetensorsEntry* scalar = (*r)->Find("scalar");
  ASSERT_NE(scalar, nullptr);
  EXPECT_TRUE(scalar->shape.empty());
  EXPECT_EQ(scalar->end - scalar->begin, 4);
  const SafetensorsEntry* empty = (*r)->Find("empty");
  ASSERT_NE(empty, nullptr);
  EXPECT_EQ(empty->begin, empty->end);
  EXPECT_EQ((*r)->Find("missing"), nullptr);
  // Entries come in data order, which is the order written.
  EXPECT_EQ((*r)->entries()[0].name, "t0");
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*r)->Data((*r)->entries()[0])) % 8, 0u);
}

TEST_F(SafetensorsTest, FillProducerStreamsInBoundedChunks) {
  const int64_t n = (int64_t{16} << 20) / 4 * 2 + 3;  // two full 16 MiB chunks and a bit
  std::vector<std::pair<int64_t, int64_t>> calls;
  auto fill = [&](int64_t offset, int64_t nbytes, void* out) {
    calls.push_back({offset, nbytes});
    float* f = static_cast<float*>(out);
    for (int64_t i = 0; i < nbytes / 4; ++i) f[i] = static_cast<float>(offset / 4 + i);
    return absl::OkStatus();
  };
  const uint16_t small[2] = {0x3c00, 0xc000};  // fp16 1, -2
  std::vector<SafetensorsTensor> tensors = {{"small", TensorDType::kF16, {2}, small, nullptr},
                                            {"big", TensorDType::kF32, {n}, nullptr, fill}};
  FileChecksum checksum;
  ASSERT_TRUE(WriteSafetensors(Path("big.safetensors"), tensors, {}, &checksum).ok());
  // The size and CRC-32 computed as the file streamed out are those of the file on disk.
  const std::string written = ReadBytes(Path("big.safetensors"));
  EXPECT_EQ(checksum.bytes, static_cast<int64_t>(written.size()));
  EXPECT_EQ(checksum.crc32, Crc32Update(0, written.data(), static_cast<int64_t>(written.size())));
  EXPECT_THAT(calls, ElementsAre(std::make_pair(int64_t{0}, int64_t{16} << 20),
                                 std::make_pair(int64_t{16} << 20, int64_t{16} << 20),
                                 std::make_pair(int64_t{32} << 20, int64_t{12})));

  absl::StatusOr<std::unique_ptr<SafetensorsReader>> r =
      SafetensorsReader::Open(Path("big.safetensors"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE((*r)->metadata().empty());
  std::vector<float> got(n);
  ASSERT_TRUE((*r)->ReadAsFloat("big", {n}, got.data()).ok());
  for (int64_t i = 0; i < n; i += 999) ASSERT_EQ(got[i], static_cast<float>(i));
  EXPECT_EQ(got[n - 1], static_cast<float>(n - 1));
}

TEST_F(SafetensorsTest, FailingProducerKeepsTheOldFile) {
  const float one = 1;
  ASSERT_TRUE(
      WriteSafetensors(Path("f.safetensors"), {{"x", TensorDType::kF32, {1}, &one, nullptr}}, {})
          .ok());
  const std::string before = ReadBytes(Path("f.safetensors"));
  auto fail = [](int64_t, int64_t, void*) { return absl::UnavailableError("shard went away"); };
  absl::Status s =
      WriteSafetensors(Path("f.safetensors"), {{"x", TensorDType::kF32, {1}, nullptr, fail}}, {});
  EXPECT_TRUE(absl::IsUnavailable(s));
  EXPECT_THAT(s.message(), AllOf(HasSubstr("'x'"), HasSubstr("shard went away")));
  EXPECT_EQ(ReadBytes(Path("f.safetensors")), before);
  EXPECT_THAT(List(dir_), ElementsAre("f.safetensors"));  // no temp file left behind
}

TEST_F(SafetensorsTest, WriterRejectsBadTensors) {
  const float v[2] = {};
  auto fill = [](int64_t, int64_t, void*) { return absl::OkStatus(); };
  EXPECT_THAT(WriteSafetensors(Path("w"),
                               {{"a", TensorDType::kF32, {1}, v, nullptr},
                                {"a", TensorDType::kF32, {1}, v, nullptr}},
                               {})
                  .message(),
              HasSubstr("given twice"));
  EXPECT_THAT(WriteSafetensors(Path("w"), {{"a", TensorDType::kF32, {1}, v, fill}}, {}).message(),
              HasSubstr("exactly one of data and fill"));
  EXPECT_THAT(
      WriteSafetensors(Path("w"), {{"a", TensorDType::kF32, {-1}, v, nullptr}}, {}).message(),
      HasSubstr("negative"));
  EXPECT_FALSE(
      WriteSafetensors(Path("w"), {{"__metadata__", TensorDType::kF32, {1}, v, nullptr}}, {}).ok());
  EXPECT_THAT(List(dir_), ElementsAre());
}

// A file built byte by byte as the format's README describes it, the way other writers may lay
// it out: an unpadded header (89 bytes, not a multiple of 8) so the data section starts
// unaligned, and metadata.
TEST_F(SafetensorsTest, ReadsAHandBuiltFileOfTheOfficialLayout) {
  const std::string header = R"({"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]},)"
                             R"("__metadata__":{"foo":"bar"}})";
  std::string data;
  for (int32_t v : {1, -2, 3, 40000}) data.append(reinterpret_cast<const char*>(&v), 4);
  ASSERT_EQ(header.size(), 89u);
  WriteBytes(Path("ex.safetensors"), Raw(header, data));
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> r =
      SafetensorsReader::Open(Path("ex.safetensors"));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ((*r)->entries().size(), 1u);
  const SafetensorsEntry& e = (*r)->entries()[0];
  EXPECT_EQ(e.name, "test");
  EXPECT_EQ(e.dtype, TensorDType::kI32);
  EXPECT_THAT(e.shape, ElementsAre(2, 2));
  EXPECT_EQ(e.begin, 0);
  EXPECT_EQ(e.end, 16);
  int32_t got[4];
  std::memcpy(got, (*r)->Data(e), 16);
  EXPECT_THAT(got, ElementsAre(1, -2, 3, 40000));
  EXPECT_EQ((*r)->metadata().at("foo"), "bar");
}

TEST_F(SafetensorsTest, ReadAsFloatConvertsAndChecksShape) {
  // Header of odd length, so the 16-bit tensors sit at odd addresses in the mapping.
  const std::string header = R"({"h":{"dtype":"F16","shape":[3],"data_offsets":[0,6]},)"
                             R"("b":{"dtype":"BF16","shape":[1,2],"data_offsets":[6,10]},)"
                             R"("f":{"dtype":"F32","shape":[1],"data_offsets":[10,14]},)"
                             R"("i":{"dtype":"I32","shape":[1],"data_offsets":[14,18]}} )";
  std::string data;
  for (uint16_t h : {0x3c00, 0xc000, 0x3800}) data.append(reinterpret_cast<const char*>(&h), 2);
  for (uint16_t b : {0x3f00, 0xc040}) data.append(reinterpret_cast<const char*>(&b), 2);
  const float f = 2.5f;
  data.append(reinterpret_cast<const char*>(&f), 4);
  data.append(4, '\0');
  WriteBytes(Path("c.safetensors"), Raw(header, data));
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> r =
      SafetensorsReader::Open(Path("c.safetensors"));
  ASSERT_TRUE(r.ok()) << r.status();
  float out[3];
  ASSERT_TRUE((*r)->ReadAsFloat("h", {3}, out).ok());
  EXPECT_THAT(out, ElementsAre(1.0f, -2.0f, 0.5f));
  ASSERT_TRUE((*r)->ReadAsFloat("b", {1, 2}, out).ok());
  EXPECT_EQ(out[0], 0.5f);
  EXPECT_EQ(out[1], -3.0f);
  ASSERT_TRUE((*r)->ReadAsFloat("f", {1}, out).ok());
  EXPECT_EQ(out[0], 2.5f);

  absl::Status s = (*r)->ReadAsFloat("b", {2}, out);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("c.safetensors"), HasSubstr("'b'"), HasSubstr("[1, 2]"),
                                 HasSubstr("expected [2]")));
  EXPECT_THAT((*r)->ReadAsFloat("i", {1}, out).message(), HasSubstr("is I32"));
  EXPECT_TRUE(absl::IsNotFound((*r)->ReadAsFloat("nope", {1}, out)));
}

// Found by safetensors_fuzz: an empty F32 tensor read into an empty vector's data() (null)
// passed null to memcpy.
TEST_F(SafetensorsTest, ReadAsFloatOfAnEmptyTensorTakesANullBuffer) {
  WriteBytes(Path("e.safetensors"),
             Raw(R"({"z":{"dtype":"F32","shape":[0,5],"data_offsets":[0,0]}})", ""));
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> r =
      SafetensorsReader::Open(Path("e.safetensors"));
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<float> out;
  EXPECT_TRUE((*r)->ReadAsFloat("z", {0, 5}, out.data()).ok());
}

TEST_F(SafetensorsTest, RejectsMalformedFiles) {
  const std::string ok_entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string eight(8, '\0');
  struct Case {
    const char* what;
    std::string bytes;
    std::vector<std::string> message;
  };
  std::string huge_len(8, '\0');
  huge_len[4] = 1;  // 2^32 bytes of header
  std::string too_long_for_file = Raw("{}", "");
  too_long_for_file[0] = 100;
  const std::vector<Case> cases = {
      {"empty", "", {"0 bytes", "shorter than the 8-byte"}},
      {"truncated length", std::string("\x02\0\0", 3), {"3 bytes"}},
      {"header past the end", too_long_for_file, {"header length 100", "not sane"}},
      {"header over the cap", huge_len + "{}", {"header length 4294967296", "capped"}},
      {"bad json", Raw("{\"a\":", ""), {"not a JSON object"}},
      {"not an object", Raw("[1,2]", ""), {"not a JSON object"}},
      {"entry not an object", Raw(R"({"a":3})", ""), {"'a'", "not a JSON object"}},
      {"bad dtype",
       Raw(R"({"a":{"dtype":"F99","shape":[2],"data_offsets":[0,8]}})", eight),
       {"'a'", "unsupported dtype 'F99'"}},
      {"no offsets",
       Raw(R"({"a":{"dtype":"F32","shape":[2]}})", eight),
       {"'a'", "has no data_offsets"}},
      {"unknown key",
       Raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", eight),
       {"'a'", "unknown key 'x'"}},
      {"negative dim",
       Raw(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight),
       {"'a'", "shape[0] is -2"}},
      {"fractional dim",
       Raw(R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,8]}})", eight),
       {"'a'", "shape[0] is 1.5"}},
      {"wrong size",
       Raw(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight),
       {"'a'", "span 8 bytes", "F32 [3] needs 12"}},
      {"huge shape",
       Raw(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", eight),
       {"'a'", "overflows"}},
      {"outside",
       Raw(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", eight),
       {"'a'", "[0, 16]", "not inside the data section of 8 bytes"}},
      {"reversed",
       Raw(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[8,0]}})", eight),
       {"'a'", "[8, 0]"}},
      {"one offset",
       Raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", eight),
       {"'a'", "1 values"}},
      {"overlap",
       Raw("{" + ok_entry + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
           std::string(12, '\0')),
       {"'b'", "overlap tensor 'a'"}},
      {"hole",
       Raw("{" + ok_entry + R"(,"b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})",
           std::string(16, '\0')),
       {"'b'", "hole after byte 8"}},
      {"trailing bytes",
       Raw("{" + ok_entry + "}", std::string(9, '\0')),
       {"describe 8 bytes", "data section has 9"}},
      {"metadata not a map", Raw(R"({"__metadata__":[1]})", ""), {"__metadata__"}},
      {"metadata value not a string",
       Raw(R"({"__metadata__":{"k":1}})", ""),
       {"__metadata__", "'k'", "not a string"}},
  };
  for (const Case& c : cases) {
    const std::string path = Path("bad.safetensors");
    WriteBytes(path, c.bytes);
    absl::StatusOr<std::unique_ptr<SafetensorsReader>> r = SafetensorsReader::Open(path);
    ASSERT_FALSE(r.ok()) << c.what;
    EXPECT_THAT(r.status().message(), HasSubstr("bad.safetensors")) << c.what;
    for (const std::string& part : c.message) {
      EXPECT_THAT(r.status().message(), HasSubstr(part)) << c.what;
    }
  }
  EXPECT_TRUE(absl::IsNotFound(SafetensorsReader::Open(Path("missing")).status()));
}

}  // namespace
}  // namespace offload
