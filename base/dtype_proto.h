// DType <-> its wire enum (offload.v1.DType), for every end of the wire API.
#ifndef OFFLOAD_BASE_DTYPE_PROTO_H_
#define OFFLOAD_BASE_DTYPE_PROTO_H_

#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "offload/v1/optimizer.pb.h"

namespace offload {

// INVALID_ARGUMENT naming `field` for anything but FP32, FP16 and BF16.
absl::StatusOr<DType> DTypeFromProto(v1::DType dtype, const char* field);
v1::DType DTypeToProto(DType dtype);

}  // namespace offload

#endif  // OFFLOAD_BASE_DTYPE_PROTO_H_
