// libFuzzer target: SafetensorsReader::Open on arbitrary file contents. A checkpoint or an
// --init_from file comes from disk, where anything can have written it, and the reader hands out
// pointers into the mapped file, so it must refuse every header that would point outside it.
//
// The input is the whole file (u64 header length | JSON header | data). It is written to a memfd
// (no disk, no cleanup) that the reader opens by its /proc/self/fd path. When the reader accepts a
// file, the target checks what the reader promises (entries inside the data section, tiling it,
// sizes matching dtype and shape) and reads every tensor back, so ASan sees any byte it touches.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "base/testing/fuzz_util.h"
#include "optimizer_client/checkpoint/safetensors.h"

namespace offload {
namespace {

void Check(bool ok, const char* what) {
  if (!ok) FuzzFail("safetensors_fuzz", "broken promise", what);
}

void Run(const uint8_t* data, size_t size) {
  static FuzzInputFile* const file = new FuzzInputFile("safetensors_fuzz");
  const std::string& path = file->Write(data, size);
  absl::StatusOr<std::unique_ptr<SafetensorsReader>> reader = SafetensorsReader::Open(path);
  if (!reader.ok()) return;
  const SafetensorsReader& r = **reader;

  // Open accepted it, so the length field is sane and the entries tile the data section.
  Check(size >= 8, "accepted a file shorter than its length field");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | data[i];
  Check(header_len <= size - 8, "header runs past the end of the file");
  const int64_t data_size = static_cast<int64_t>(size - 8 - header_len);
  int64_t covered = 0;
  for (const SafetensorsEntry& e : r.entries()) {
    Check(e.begin == covered, "entries do not tile the data section");
    Check(e.end >= e.begin && e.end <= data_size, "entry outside the data section");
    // A zero dimension first: the other ones may then be anything up to 2^53.
    int64_t numel = 1;
    for (int64_t d : e.shape) Check(d >= 0, "negative dimension");
    for (int64_t d : e.shape) numel = d == 0 ? 0 : numel;
    for (int64_t d : e.shape) numel = numel == 0 ? 0 : numel * d;
    Check(numel * TensorDTypeSize(e.dtype) == e.end - e.begin, "size does not match the shape");
    Check(r.Find(e.name) == &e, "Find does not return the entry");
    covered = e.end;

    // The bytes Data hands out are the entry's bytes of the file.
    const uint8_t* file_bytes = data + 8 + header_len + e.begin;
    Check(std::memcmp(r.Data(e), file_bytes, static_cast<size_t>(e.end - e.begin)) == 0,
          "Data does not point at the entry's bytes");
    if (e.dtype == TensorDType::kF32 || e.dtype == TensorDType::kF16 ||
        e.dtype == TensorDType::kBF16) {
      std::vector<float> out(static_cast<size_t>(numel));
      Check(r.ReadAsFloat(e.name, e.shape, out.data()).ok(), "ReadAsFloat refused a valid entry");
    }
    // A wrong shape and a missing name are refused, never read.
    std::vector<int64_t> wrong = e.shape;
    wrong.push_back(1);
    Check(!r.ReadAsFloat(e.name, wrong, nullptr).ok(), "ReadAsFloat took a wrong shape");
  }
  if (r.Find("no such tensor") == nullptr) {
    Check(absl::IsNotFound(r.ReadAsFloat("no such tensor", {}, nullptr)),
          "ReadAsFloat read a missing tensor");
  }
  Check(covered == data_size, "entries do not cover the data section");
}

}  // namespace
}  // namespace offload

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  offload::Run(data, size);
  return 0;
}
