#include "cpu_optimizer_server/grpc/step_wire.h"

#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace offload {

namespace {

using google::protobuf::io::CodedInputStream;
using google::protobuf::io::CodedOutputStream;

constexpr uint32_t kVarint = 0;
constexpr uint32_t kFixed64 = 1;
constexpr uint32_t kLengthDelimited = 2;
constexpr uint32_t kFixed32 = 5;

constexpr uint32_t Tag(uint32_t field, uint32_t wire_type) { return (field << 3) | wire_type; }

size_t VarintField(uint32_t field, uint64_t value) {
  return CodedOutputStream::VarintSize32(Tag(field, kVarint)) +
         CodedOutputStream::VarintSize64(value);
}

// The bytes before a payload of `data_size` bytes: the outer message's field `outer` holding a
// chunk message with offset (1), dtype (2), accumulate (3, only when set and accumulate_field is
// not 0) and the payload's field `data_field`, whose length prefix ends the header.
std::string ChunkHeader(uint32_t outer, uint64_t offset, int dtype, uint32_t accumulate_field,
                        bool accumulate, uint32_t data_field, size_t data_size) {
  size_t inner = VarintField(1, offset) + VarintField(2, static_cast<uint64_t>(dtype));
  if (accumulate_field != 0 && accumulate) inner += VarintField(accumulate_field, 1);
  inner += CodedOutputStream::VarintSize32(Tag(data_field, kLengthDelimited)) +
           CodedOutputStream::VarintSize64(data_size) + data_size;
  std::string header;
  {
    google::protobuf::io::StringOutputStream stream(&header);
    CodedOutputStream out(&stream);
    out.WriteTag(Tag(outer, kLengthDelimited));
    out.WriteVarint64(inner);
    out.WriteTag(Tag(1, kVarint));
    out.WriteVarint64(offset);
    out.WriteTag(Tag(2, kVarint));
    out.WriteVarint64(static_cast<uint64_t>(dtype));
    if (accumulate_field != 0 && accumulate) {
      out.WriteTag(Tag(accumulate_field, kVarint));
      out.WriteVarint32(1);
    }
    out.WriteTag(Tag(data_field, kLengthDelimited));
    out.WriteVarint64(data_size);
  }
  return header;
}

grpc::ByteBuffer HeaderAndPayload(const std::string& header, const grpc::Slice& data) {
  const grpc::Slice slices[2] = {grpc::Slice(header), data};
  return grpc::ByteBuffer(slices, data.size() > 0 ? 2 : 1);
}

// The next tag, 0 at the end (or on an error, which ConsumedEntireMessage tells); UINT32_MAX for a
// tag protobuf's parser refuses: longer than 5 bytes (CodedInputStream reads up to 10).
uint32_t ReadTag(CodedInputStream* in) {
  const int before = in->CurrentPosition();
  const uint32_t tag = in->ReadTag();
  return in->CurrentPosition() - before > 5 ? UINT32_MAX : tag;
}

// A length-delimited field's length, read as protobuf's parser reads it: at most 5 bytes and
// below 2 GiB. CodedInputStream::ReadVarint32 reads up to 10 bytes and keeps the low 32 bits, so
// `80 80 80 80 80 6d` would read as 0 where protobuf refuses the message.
bool ReadLength(CodedInputStream* in, uint32_t* length) {
  const int before = in->CurrentPosition();
  uint64_t value = 0;
  if (!in->ReadVarint64(&value) || in->CurrentPosition() - before > 5 ||
      value > static_cast<uint64_t>(std::numeric_limits<int>::max())) {
    return false;
  }
  *length = static_cast<uint32_t>(value);
  return true;
}

// Skips a field of `tag` the parser does not know; false when it cannot (a group, or the end).
bool SkipField(CodedInputStream* in, uint32_t tag) {
  if ((tag >> 3) == 0) return false;  // field number 0 is not protobuf
  uint64_t ignored;
  uint32_t length;
  switch (tag & 7) {
    case kVarint:
      return in->ReadVarint64(&ignored);
    case kFixed64:
      return in->Skip(8);
    case kLengthDelimited:
      return ReadLength(in, &length) && in->Skip(static_cast<int>(length));
    case kFixed32:
      return in->Skip(4);
    default:
      return false;
  }
}

// Reads a length-delimited payload of `length` bytes: in place where the current slice holds it
// all, else copied into *copy.
bool ReadPayload(CodedInputStream* in, uint32_t length, const char** data, std::string* copy) {
  const void* direct = nullptr;
  int available = 0;
  if (in->GetDirectBufferPointer(&direct, &available) &&
      static_cast<uint32_t>(available) >= length) {
    *data = static_cast<const char*>(direct);
    return in->Skip(static_cast<int>(length));
  }
  if (!in->ReadString(copy, static_cast<int>(length))) return false;
  *data = copy->data();
  return true;
}

}  // namespace

grpc::Slice SharedSlice(std::shared_ptr<const void> owner, const char* data, size_t n) {
  auto* keep = new std::shared_ptr<const void>(std::move(owner));
  grpc_slice slice = grpc_slice_new_with_user_data(
      const_cast<char*>(data), n,
      [](void* p) { delete static_cast<std::shared_ptr<const void>*>(p); }, keep);
  return grpc::Slice(slice, grpc::Slice::STEAL_REF);
}

grpc::ByteBuffer GradChunkMessage(uint64_t offset, v1::DType dtype, bool accumulate,
                                  const grpc::Slice& data) {
  // StepRequest.grad is field 2; GradChunk: offset 1, dtype 2, accumulate 3, data 4.
  return HeaderAndPayload(ChunkHeader(2, offset, dtype, 3, accumulate, 4, data.size()), data);
}

grpc::ByteBuffer ParamChunkMessage(uint64_t offset, v1::DType dtype, const grpc::Slice& data) {
  // StepResponse.params is field 1; ParamChunk: offset 1, dtype 2, data 3.
  return HeaderAndPayload(ChunkHeader(1, offset, dtype, 0, false, 3, data.size()), data);
}

grpc::ByteBuffer SerializedMessage(const google::protobuf::MessageLite& message) {
  const grpc::Slice slice(message.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

absl::Status ParseMessage(grpc::ByteBuffer* buffer, google::protobuf::MessageLite* message,
                          const char* what) {
  grpc::ProtoBufferReader reader(buffer);
  if (!reader.status().ok() || !message->ParseFromZeroCopyStream(&reader)) {
    return absl::InvalidArgumentError(absl::StrCat("unreadable ", what));
  }
  return absl::OkStatus();
}

absl::Status ParseStepRequest(grpc::ByteBuffer* buffer, StepRequestView* view) {
  view->is_grad = false;
  view->data = nullptr;
  view->size = 0;
  view->copied.clear();
  bool is_grad = false;
  {
    grpc::ProtoBufferReader reader(buffer);
    if (!reader.status().ok()) return absl::InvalidArgumentError("unreadable StepRequest");
    CodedInputStream in(&reader);
    is_grad = ReadTag(&in) == Tag(2, kLengthDelimited);
    if (is_grad) {
      uint32_t length = 0;
      if (!ReadLength(&in, &length)) return absl::InvalidArgumentError("unreadable GradChunk");
      const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(length));
      view->offset = 0;
      view->dtype = 0;
      view->accumulate = false;
      for (uint32_t tag; (tag = ReadTag(&in)) != 0;) {
        uint64_t value = 0;
        bool ok;
        if (tag == Tag(1, kVarint)) {
          ok = in.ReadVarint64(&view->offset);
        } else if (tag == Tag(2, kVarint)) {
          ok = in.ReadVarint64(&value);
          view->dtype = static_cast<int>(value);
        } else if (tag == Tag(3, kVarint)) {
          ok = in.ReadVarint64(&value);
          view->accumulate = value != 0;
        } else if (tag == Tag(4, kLengthDelimited)) {
          uint32_t size = 0;
          ok = ReadLength(&in, &size) && ReadPayload(&in, size, &view->data, &view->copied);
          view->size = size;
        } else {
          ok = SkipField(&in, tag);
        }
        if (!ok) return absl::InvalidArgumentError("unreadable GradChunk");
      }
      // At the limit, not at the end of the bytes before it (a truncated chunk).
      if (!in.ConsumedEntireMessage() || in.BytesUntilLimit() != 0) {
        return absl::InvalidArgumentError("unreadable GradChunk");
      }
      in.PopLimit(limit);
      // Anything after the chunk would make it another message (a oneof's last field wins):
      // read it as protobuf does, below.
      if (ReadTag(&in) == 0 && in.ConsumedEntireMessage()) {
        view->is_grad = true;
        if (view->data == nullptr) view->data = view->copied.data();  // an empty payload
        return absl::OkStatus();
      }
    }
  }
  view->copied.clear();
  return ParseMessage(buffer, &view->request, "StepRequest");
}

absl::Status ReadStepResponse(grpc::ByteBuffer* buffer, const ParamPlacement& placement,
                              v1::StepResult* result, bool* has_result) {
  grpc::ProtoBufferReader reader(buffer);
  if (!reader.status().ok()) return absl::DataLossError("unreadable StepResponse");
  CodedInputStream in(&reader);
  // params and result are a oneof: as protobuf reads it, a result merges into the one before it
  // unless params came between.
  v1::StepResult message_result;
  bool message_has_result = false;
  for (uint32_t tag; (tag = ReadTag(&in)) != 0;) {
    uint32_t length = 0;
    if (tag == Tag(2, kLengthDelimited)) {  // result
      std::string bytes;
      if (!ReadLength(&in, &length) || !in.ReadString(&bytes, static_cast<int>(length)) ||
          !message_result.MergeFromString(bytes)) {
        return absl::DataLossError("unreadable StepResult");
      }
      message_has_result = true;
      continue;
    }
    if (tag == Tag(1, kLengthDelimited)) {
      message_result.Clear();
      message_has_result = false;
    }
    if (tag != Tag(1, kLengthDelimited)) {  // not params: skipped, as protobuf would
      if (!SkipField(&in, tag)) return absl::DataLossError("unreadable StepResponse");
      continue;
    }
    if (!ReadLength(&in, &length)) return absl::DataLossError("unreadable ParamChunk");
    const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(length));
    uint64_t offset = 0, dtype = 0;
    bool seen_offset = false, placed = false;
    std::string early;  // a payload that came before its offset (not the order our shard sends)
    bool have_early = false;
    for (uint32_t t; (t = ReadTag(&in)) != 0;) {
      bool ok;
      if (t == Tag(1, kVarint)) {
        ok = in.ReadVarint64(&offset);
        seen_offset = true;
      } else if (t == Tag(2, kVarint)) {
        ok = in.ReadVarint64(&dtype);
      } else if (t == Tag(3, kLengthDelimited)) {
        uint32_t size = 0;
        ok = ReadLength(&in, &size);
        if (ok && seen_offset) {
          // The usual order (offset, dtype, data): one copy, from gRPC's slices to its place.
          char* dest = placement.place(offset, static_cast<int>(dtype), size);
          if (dest == nullptr) {
            return absl::DataLossError("shard sent parameters outside the range");
          }
          ok = in.ReadRaw(dest, static_cast<int>(size));
          placed = true;
          have_early = false;
        } else if (ok) {
          ok = in.ReadString(&early, static_cast<int>(size));
          have_early = true;
        }
      } else {
        ok = SkipField(&in, t);
      }
      if (!ok) return absl::DataLossError("unreadable ParamChunk");
    }
    if (!in.ConsumedEntireMessage() || in.BytesUntilLimit() != 0) {
      return absl::DataLossError("unreadable ParamChunk");
    }
    in.PopLimit(limit);
    if (have_early && !placed) {
      char* dest = placement.place(offset, static_cast<int>(dtype), early.size());
      if (dest == nullptr) return absl::DataLossError("shard sent parameters outside the range");
      std::memcpy(dest, early.data(), early.size());
    }
  }
  // A 0 tag before the end is not protobuf.
  if (!in.ConsumedEntireMessage()) return absl::DataLossError("unreadable StepResponse");
  if (message_has_result) {
    *result = std::move(message_result);
    *has_result = true;
  }
  return absl::OkStatus();
}

}  // namespace offload
