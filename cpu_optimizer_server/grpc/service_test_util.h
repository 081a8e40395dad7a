// What the shard's service and data-plane tests share.
#ifndef OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_SERVICE_TEST_UTIL_H_
#define OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_SERVICE_TEST_UTIL_H_

#include "offload/v1/optimizer.pb.h"

namespace offload {

// The optimizer of the service tests: AdamW with weight decay, so both the decoupled decay and
// the moments show in every updated value.
inline v1::AdamConfig TestAdamW() {
  v1::AdamConfig adam;
  adam.set_kind(v1::OPTIMIZER_KIND_ADAMW);
  // Doubles that fp32 cannot hold, as torch's defaults: the wire carries them as they are.
  adam.set_lr(1e-3);
  adam.set_beta1(0.9);
  adam.set_beta2(0.999);
  adam.set_eps(1e-8);
  adam.set_weight_decay(0.01);
  return adam;
}

}  // namespace offload

#endif  // OFFLOAD_CPU_OPTIMIZER_SERVER_GRPC_SERVICE_TEST_UTIL_H_
