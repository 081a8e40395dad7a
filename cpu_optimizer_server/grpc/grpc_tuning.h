// gRPC channel arguments for bulk tensor traffic, applied by both ends of a shard connection.
// The defaults suit small RPCs: 16 KiB HTTP/2 frames, 8 KiB socket reads and a flow-control
// window that starts small on every new stream (a step stream lives for one step, so it would
// spend its life in slow start). Measured by bench_server; see docs/PERFORMANCE.md.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_GRPC_TUNING_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_GRPC_TUNING_H_

#include "grpc/grpc.h"

namespace offload {

// set_int(name, value) is ChannelArguments::SetInt or ServerBuilder::AddChannelArgument.
template <typename SetInt>
void ApplyBulkTransferArgs(SetInt&& set_int) {
  set_int(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 20);
  set_int(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, (16 << 20) - 1);
  set_int(GRPC_ARG_HTTP2_WRITE_BUFFER_SIZE, 64 << 20);
  set_int(GRPC_ARG_TCP_READ_CHUNK_SIZE, 4 << 20);
  set_int(GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, 256 << 10);
  set_int(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, 16 << 20);
}

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_GRPC_TUNING_H_
