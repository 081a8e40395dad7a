// libFuzzer target: the hand-written readers of the Step stream's bytes (step_wire.h), which read
// what a trainer or a shard sends over the network. Input: byte 0 says how the rest is cut into
// slices (as gRPC's receive path may cut a message); the rest is one message. For any input:
//   - ParseStepRequest either refuses it or gives what protobuf gives: a gradient chunk whose
//     fields and payload equal protobuf's parse of the same bytes, or the same StepRequest;
//   - ReadStepResponse never writes outside the destinations `place` hands out (each checked
//     against a buffer), reads the result protobuf reads, and where it placed one chunk where
//     protobuf reads it, the payload placed is protobuf's data.
// abort() otherwise; ASan and UBSan watch the reads.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_optimizer_server/grpc/step_wire.h"
#include "grpc/grpc.h"

namespace {

grpc::ByteBuffer Cut(const std::string& bytes, size_t piece) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += piece) {
    slices.emplace_back(bytes.data() + at, std::min(piece, bytes.size() - at));
  }
  if (slices.empty()) slices.emplace_back();
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// Names the check that failed, for the reproducer's report.
#define CHECK_WIRE(ok)                                                                      \
  do {                                                                                      \
    if (!(ok)) {                                                                            \
      std::fprintf(stderr, "step_wire_fuzz: check failed at line %d: %s\n", __LINE__, #ok); \
      std::abort();                                                                         \
    }                                                                                       \
  } while (0)

}  // namespace

// Once: without it every ByteBuffer starts and stops gRPC's core.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  grpc_init();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t piece = data[0] == 0 ? size : data[0];
  const std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);

  offload::v1::StepRequest expected;
  const bool parses = expected.ParseFromString(bytes);
  grpc::ByteBuffer request = Cut(bytes, piece);
  offload::StepRequestView view;
  if (offload::ParseStepRequest(&request, &view).ok()) {
    CHECK_WIRE(parses);
    if (view.is_grad) {
      CHECK_WIRE(expected.has_grad());
      CHECK_WIRE(view.offset == expected.grad().offset());
      CHECK_WIRE(view.dtype == static_cast<int>(expected.grad().dtype()));
      CHECK_WIRE(view.accumulate == expected.grad().accumulate());
      CHECK_WIRE(std::string(view.data, view.size) == expected.grad().data());
    } else {
      CHECK_WIRE(view.request.SerializeAsString() == expected.SerializeAsString());
    }
  }

  std::vector<char> out(4096);
  int placements = 0;
  uint64_t last_offset = 0;
  size_t last_bytes = 0;
  offload::ParamPlacement placement;
  placement.place = [&](uint64_t offset, int, size_t n) -> char* {
    if (offset > out.size() || n > out.size() - offset) return nullptr;
    ++placements;
    last_offset = offset;
    last_bytes = n;
    return out.data() + offset;
  };
  offload::v1::StepResponse response;
  const bool response_parses = response.ParseFromString(bytes);
  grpc::ByteBuffer buffer = Cut(bytes, piece);
  offload::v1::StepResult result;
  bool has_result = false;
  if (offload::ReadStepResponse(&buffer, placement, &result, &has_result).ok()) {
    CHECK_WIRE(response_parses);
    if (has_result && response.has_result()) {
      CHECK_WIRE(result.SerializeAsString() == response.result().SerializeAsString());
    }
    // One chunk placed where protobuf reads it (repeated fields merge in protobuf; skip those).
    if (placements == 1 && response.has_params() && response.params().offset() == last_offset &&
        response.params().data().size() == last_bytes) {
      CHECK_WIRE(
          std::memcmp(out.data() + last_offset, response.params().data().data(), last_bytes) == 0);
    }
  }
  return 0;
}
