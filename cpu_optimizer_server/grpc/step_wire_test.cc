// The Step stream's bytes (step_wire.h) are optimizer.proto's messages: what one end writes by hand
// protobuf reads as the same message, and what protobuf writes the hand-written readers read the
// same, whether a payload lies in one slice or is split across several.
#include "cpu_optimizer_server/grpc/step_wire.h"

#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "cpu_optimizer_server/grpc/slice_buffer_pool.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

std::string Bytes(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// The same bytes cut into slices of `piece` bytes, as gRPC's receive path may cut a message.
grpc::ByteBuffer Cut(const std::string& bytes, size_t piece) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += piece) {
    slices.emplace_back(bytes.data() + at, std::min(piece, bytes.size() - at));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::shared_ptr<std::vector<char>> Payload(size_t n) {
  auto p = std::make_shared<std::vector<char>>(n);
  std::iota(p->begin(), p->end(), 7);
  return p;
}

TEST(StepWireTest, GradChunkIsTheProtobufMessage) {
  for (bool accumulate : {false, true}) {
    const auto payload = Payload(100003);
    grpc::ByteBuffer message = GradChunkMessage((uint64_t{1} << 40) + 5, v1::DTYPE_BF16, accumulate,
                                                SharedSlice(payload, payload->data(), 100002));
    v1::StepRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(Bytes(message)));
    ASSERT_TRUE(parsed.has_grad());
    EXPECT_EQ(parsed.grad().offset(), (uint64_t{1} << 40) + 5);
    EXPECT_EQ(parsed.grad().dtype(), v1::DTYPE_BF16);
    EXPECT_EQ(parsed.grad().accumulate(), accumulate);
    EXPECT_EQ(parsed.grad().data(), std::string(payload->data(), 100002));
  }
}

TEST(StepWireTest, ParamChunkIsTheProtobufMessage) {
  const auto payload = Payload(4096);
  grpc::ByteBuffer message =
      ParamChunkMessage(0, v1::DTYPE_FP16, SharedSlice(payload, payload->data(), 4096));
  v1::StepResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(Bytes(message)));
  ASSERT_TRUE(parsed.has_params());
  EXPECT_EQ(parsed.params().offset(), 0u);
  EXPECT_EQ(parsed.params().dtype(), v1::DTYPE_FP16);
  EXPECT_EQ(parsed.params().data(), std::string(payload->data(), 4096));
}

// A slice keeps its buffer alive after its owner lets go, until the message is gone.
TEST(StepWireTest, SharedSliceOwnsItsBuffer) {
  auto payload = Payload(64);
  std::weak_ptr<std::vector<char>> watch = payload;
  auto message = std::make_unique<grpc::ByteBuffer>(
      ParamChunkMessage(8, v1::DTYPE_FP16, SharedSlice(payload, payload->data(), 64)));
  EXPECT_GT(payload.use_count(), 1);
  payload.reset();
  EXPECT_FALSE(watch.expired());
  v1::StepResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(Bytes(*message)));
  EXPECT_EQ(parsed.params().data().size(), 64u);
  message.reset();
  EXPECT_TRUE(watch.expired());
}

// What protobuf writes, cut anywhere, the shard reads: in place where the payload lies in one
// slice, copied otherwise, the same fields either way; other kinds come out parsed.
TEST(StepWireTest, ShardReadsWhatProtobufWrites) {
  v1::StepRequest grad;
  grad.mutable_grad()->set_offset(1234567);
  grad.mutable_grad()->set_dtype(v1::DTYPE_FP16);
  grad.mutable_grad()->set_data(std::string(70001, 'g'));
  const std::string bytes = grad.SerializeAsString();
  for (size_t piece : {bytes.size(), size_t{1}, size_t{3}, size_t{4096}, size_t{65536}}) {
    grpc::ByteBuffer buffer = Cut(bytes, piece);
    StepRequestView view;
    ASSERT_TRUE(ParseStepRequest(&buffer, &view).ok()) << piece;
    ASSERT_TRUE(view.is_grad) << piece;
    EXPECT_EQ(view.offset, 1234567u);
    EXPECT_EQ(view.dtype, v1::DTYPE_FP16);
    EXPECT_FALSE(view.accumulate);
    EXPECT_EQ(std::string(view.data, view.size), grad.grad().data()) << piece;
    // In place exactly when one slice holds the payload.
    EXPECT_EQ(view.copied.empty(), piece == bytes.size()) << piece;
  }
  // One view read again and again, as the shard's loop does: nothing of a copied chunk stays
  // for the next one read in place.
  {
    StepRequestView view;
    grpc::ByteBuffer split = Cut(bytes, 7);
    ASSERT_TRUE(ParseStepRequest(&split, &view).ok());
    EXPECT_FALSE(view.copied.empty());
    grpc::ByteBuffer whole = Cut(bytes, bytes.size());
    ASSERT_TRUE(ParseStepRequest(&whole, &view).ok());
    EXPECT_TRUE(view.copied.empty());
    EXPECT_EQ(std::string(view.data, view.size), grad.grad().data());
  }
  v1::StepRequest commit;
  commit.mutable_commit()->set_step(9);
  commit.mutable_commit()->add_group_lr(0.5);
  grpc::ByteBuffer buffer = SerializedMessage(commit);
  StepRequestView view;
  ASSERT_TRUE(ParseStepRequest(&buffer, &view).ok());
  EXPECT_FALSE(view.is_grad);
  EXPECT_EQ(view.request.commit().step(), 9u);
  EXPECT_EQ(view.request.commit().group_lr(0), 0.5);
  // A grad followed by another field is another message (a oneof's last field wins): protobuf's
  // reading, not the chunk.
  v1::StepRequest update;
  update.mutable_update()->set_n(3);
  std::string both = bytes + update.SerializeAsString();
  buffer = Cut(both, both.size());
  ASSERT_TRUE(ParseStepRequest(&buffer, &view).ok());
  EXPECT_FALSE(view.is_grad);
  EXPECT_TRUE(view.request.has_update());
}

// Each as protobuf refuses it (the fuzz target found the last four): a chunk cut short, a length
// past the end, a payload past its chunk, garbage, a 0 tag before the end, a field number 0, a
// chunk whose length runs past the bytes, a tag longer than 5 bytes.
TEST(StepWireTest, MalformedRequestsAreRefused) {
  const std::vector<std::string> bad = {
      std::string("\x12\x05\x08", 3),
      std::string("\x12\x80", 2),
      std::string("\x12\x02\x22\x09", 4),
      std::string("\xff\xff\xff", 3),
      std::string("\x00\x00\x00\x09", 4),
      std::string("\x12\x0b\x08\x07\x01\x01\x01\x01\x01\x01\x01\x01\x01", 13),
      std::string("\x12\xff\xff\x5f\x08\x03\x10\x01", 8),
      std::string("\x12\x02\x08\x01\xd8\xd7\xd7\xd7\xd7\xd7\xd7\xd3\x28", 13),
      // Lengths protobuf refuses and a 32-bit varint read would wrap to 0: six bytes, and five
      // whose last byte reaches past 2 GiB (a result, a params chunk, a gradient's payload).
      std::string("\x08\x06\x12\x80\x80\x80\x80\x80\x6d", 9),
      std::string("\x12\x80\x80\x80\x80\x70", 6),
      std::string("\x0a\x80\x80\x80\x80\x80\x01", 7),
      std::string("\x12\x07\x22\x80\x80\x80\x80\x80\x01", 9),
      std::string("\x1a\x80\x80\x80\x80\x80\x01", 7),
  };
  for (const std::string& bytes : bad) {
    v1::StepRequest request;
    v1::StepResponse response;
    ASSERT_FALSE(request.ParseFromString(bytes) && response.ParseFromString(bytes))
        << testing::PrintToString(bytes);
    grpc::ByteBuffer buffer = Cut(bytes, bytes.size());
    StepRequestView view;
    if (!request.ParseFromString(bytes)) {
      EXPECT_FALSE(ParseStepRequest(&buffer, &view).ok()) << testing::PrintToString(bytes);
    }
    if (!response.ParseFromString(bytes)) {
      ParamPlacement placement;
      std::vector<char> out(64);
      placement.place = [&](uint64_t, int, size_t n) -> char* {
        return n <= out.size() ? out.data() : nullptr;
      };
      v1::StepResult result;
      bool has_result = false;
      grpc::ByteBuffer again = Cut(bytes, bytes.size());
      EXPECT_FALSE(ReadStepResponse(&again, placement, &result, &has_result).ok())
          << testing::PrintToString(bytes);
    }
  }
}

// The trainer places each chunk's payload where `place` says, once, and reads a result; an
// offset it refuses is DATA_LOSS.
TEST(StepWireTest, TrainerPlacesParametersAndReadsTheResult) {
  std::vector<char> out(8192, 0);
  int placed = 0;
  ParamPlacement placement;
  placement.place = [&](uint64_t offset, int dtype, size_t bytes) -> char* {
    EXPECT_EQ(dtype, v1::DTYPE_BF16);
    ++placed;
    if (offset * 2 + bytes > out.size()) return nullptr;
    return out.data() + offset * 2;
  };
  const auto payload = Payload(4000);
  v1::StepResult result;
  bool has_result = false;
  for (size_t piece : {size_t{1} << 20, size_t{7}}) {
    std::fill(out.begin(), out.end(), 0);
    grpc::ByteBuffer message = ParamChunkMessage(
        100, v1::DTYPE_BF16, SharedSlice(payload, payload->data(), payload->size()));
    grpc::ByteBuffer cut = Cut(Bytes(message), piece);
    ASSERT_TRUE(ReadStepResponse(&cut, placement, &result, &has_result).ok()) << piece;
    EXPECT_EQ(std::memcmp(out.data() + 200, payload->data(), payload->size()), 0) << piece;
    EXPECT_FALSE(has_result);
  }
  // protobuf's own writing of both kinds, the payload before its offset included.
  v1::StepResponse response;
  response.mutable_result()->set_step(12);
  response.mutable_result()->set_applied(true);
  grpc::ByteBuffer buffer = SerializedMessage(response);
  ASSERT_TRUE(ReadStepResponse(&buffer, placement, &result, &has_result).ok());
  EXPECT_TRUE(has_result);
  EXPECT_EQ(result.step(), 12u);
  std::string reversed = "\x0a";  // params, with data (3) before offset (1)
  std::string inner = std::string("\x1a\x04") + "abcd" + "\x08\x05" + "\x10\x03";
  reversed += static_cast<char>(inner.size());
  reversed += inner;
  buffer = Cut(reversed, reversed.size());
  ASSERT_TRUE(ReadStepResponse(&buffer, placement, &result, &has_result).ok());
  EXPECT_EQ(std::string(out.data() + 10, 4), "abcd");
  // Outside what the trainer accepts.
  grpc::ByteBuffer far =
      ParamChunkMessage(1 << 20, v1::DTYPE_BF16, SharedSlice(payload, payload->data(), 4000));
  EXPECT_EQ(ReadStepResponse(&far, placement, &result, &has_result).code(),
            absl::StatusCode::kDataLoss);
}

// The pool hands out a buffer again only once gRPC let go of every slice over it.
TEST(SliceBufferPoolTest, ReusesABufferOnlyOnceGrpcLetsGo) {
  SliceBufferPool pool(2);
  std::shared_ptr<SliceBuffer> a = pool.Take(1000);
  ASSERT_GE(a->capacity(), 1000u);
  SliceBuffer* const first = a.get();
  char* data = a->data();
  auto message = std::make_unique<grpc::ByteBuffer>(
      ParamChunkMessage(0, v1::DTYPE_FP16, SharedSlice(std::move(a), data, 1000)));
  std::shared_ptr<SliceBuffer> b = pool.Take(1000);  // the first is still in gRPC's hands
  EXPECT_NE(b.get(), first);
  b.reset();
  message.reset();
  EXPECT_EQ(pool.Take(800).get(), first);  // free again, and large enough
  // A request past every free buffer's capacity replaces one of them, and is kept.
  std::shared_ptr<SliceBuffer> big = pool.Take(5000);
  EXPECT_GE(big->capacity(), 5000u);
  SliceBuffer* const big_one = big.get();
  EXPECT_NE(pool.Take(5000).get(), big_one);  // held by the caller
  big.reset();
  EXPECT_EQ(pool.Take(5000).get(), big_one);
}

// Past max_kept the pool still hands out buffers, and keeps none of them.
TEST(SliceBufferPoolTest, BurstsPastTheLimitAreNotKept) {
  SliceBufferPool pool(1);
  std::shared_ptr<SliceBuffer> kept = pool.Take(64);
  std::shared_ptr<SliceBuffer> extra = pool.Take(64);
  ASSERT_NE(kept.get(), extra.get());
  std::weak_ptr<SliceBuffer> watch = extra;
  extra.reset();
  EXPECT_TRUE(watch.expired());
  SliceBuffer* const first = kept.get();
  kept.reset();
  EXPECT_EQ(pool.Take(64).get(), first);
}

}  // namespace
}  // namespace offload
