// The Step stream's bulk messages as bytes (ARCHITECTURE.md section 4, "gRPC data plane"): a
// gradient chunk goes out as a small header slice plus a slice over a buffer the message owns
// (the trainer copies the chunk there once), and a wave of parameters as a header plus a slice
// over the buffer Adam wrote it into, so neither side copies the payload into a protobuf message
// and serializes it again; the receiving side reads the payload straight out of gRPC's receive
// slices (in place on the shard where it lies in one slice, into its destination on the trainer).
// The bytes on the wire are the StepRequest and StepResponse messages of optimizer.proto, field for
// field, so any protobuf client or server still speaks to either end; only the small messages
// (open, update, commit, result) go through protobuf as before.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_STEP_WIRE_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_STEP_WIRE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "offload/v1/optimizer.pb.h"

namespace offload {

// A slice over n bytes at `data`, inside memory `owner` keeps alive until gRPC releases the slice:
// the caller may drop its reference at any time. owner.use_count() grows while gRPC holds it.
grpc::Slice SharedSlice(std::shared_ptr<const void> owner, const char* data, size_t n);

// StepRequest{grad: GradChunk{offset, dtype, accumulate, data}} with `data` as its payload.
grpc::ByteBuffer GradChunkMessage(uint64_t offset, v1::DType dtype, bool accumulate,
                                  const grpc::Slice& data);
// StepResponse{params: ParamChunk{offset, dtype, data}} with `data` as its payload.
grpc::ByteBuffer ParamChunkMessage(uint64_t offset, v1::DType dtype, const grpc::Slice& data);
// Any message, serialized by protobuf (the small ones).
grpc::ByteBuffer SerializedMessage(const google::protobuf::MessageLite& message);
// Parses a whole message; INVALID_ARGUMENT naming `what` when the bytes are not one.
absl::Status ParseMessage(grpc::ByteBuffer* buffer, google::protobuf::MessageLite* message,
                          const char* what);

// A StepRequest as the shard reads it: a gradient chunk with its payload in place, or any other
// kind parsed by protobuf.
struct StepRequestView {
  bool is_grad = false;
  // is_grad: the GradChunk's fields. `data` points into the received slices where the payload
  // lies in one of them (valid while the ByteBuffer lives), else into `copied`.
  uint64_t offset = 0;
  int dtype = 0;  // v1::DType's value, unchecked
  bool accumulate = false;
  const char* data = nullptr;
  size_t size = 0;
  std::string copied;
  // !is_grad: the whole request.
  v1::StepRequest request;
};
absl::Status ParseStepRequest(grpc::ByteBuffer* buffer, StepRequestView* view);

// A StepResponse as the trainer reads it: a ParamChunk's payload is handed to `place`, which
// returns where its n bytes go for the chunk's offset (null: refused, the parse stops with
// DATA_LOSS), so they are copied once, from gRPC's slices to their destination; a result is
// parsed into *result and *has_result set.
struct ParamPlacement {
  // (offset, dtype, bytes) -> destination of `bytes` bytes, or null.
  std::function<char*(uint64_t, int, size_t)> place;
};
absl::Status ReadStepResponse(grpc::ByteBuffer* buffer, const ParamPlacement& placement,
                              v1::StepResult* result, bool* has_result);

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_STEP_WIRE_H_
