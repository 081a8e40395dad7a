#include "gpu_trainer/cuda/memory_planner.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "gpu_trainer/cuda/gpt2_cuda_buffers.h"
#include "gpu_trainer/cuda/runtime/storage_type.h"
#include "gpu_trainer/cuda/zero/bucket_slots.h"
#include "gpu_trainer/cuda/zero/param_window.h"
#include "model_spec/gradient_buckets.h"
#include "model_spec/param_layout.h"
#include "model_spec/partition.h"

namespace offload {

int64_t DeviceParamElements(const Gpt2Config& config, const ParamPlacement& placement) {
  const int64_t n = Gpt2NumParams(config);
  const int W = std::max(1, placement.world_size);
  // W ranks: the flat space padded to W whole partitions of 64-element blocks.
  const int64_t padded =
      W > 1 ? static_cast<int64_t>(MakePartitionMap(n, W, 1)->padded_length()) : n;
  if (placement.zero_stage != 3) return padded;
  const int64_t window =
      PlanParamWindow(config, std::max(1, placement.window_layers)).total_elements;
  return window + (W > 1 ? padded / W : 0);  // one rank: the partition is in pinned host memory
}

CudaMemoryPlan PlanGpt2CudaMemory(const Gpt2Config& config, int B, int T, DType dtype,
                                  bool gpu_optimizer, const ParamPlacement& placement,
                                  bool activation_checkpointing, int64_t gradient_bucket_elements,
                                  const AttentionMemory& attention) {
  const int64_t n = Gpt2NumParams(config);
  const int64_t size = DTypeSize(dtype);
  CudaMemoryPlan plan;
  plan.params_bytes = DeviceParamElements(config, placement) * size;
  // The optimizer on the GPU needs every gradient at once.
  const bool buckets = gradient_bucket_elements > 0 && !gpu_optimizer;
  plan.grads_bytes =
      (buckets ? DeviceGradientElements(config, gradient_bucket_elements) : n) * size;
  if (buckets && placement.world_size > 1) {
    // The reduce-scatter sums one bucket at a time in fp32, the embeddings' too.
    plan.reduce_scratch_bytes = ReduceScratchElements(PlanBucketSlots(
                                    PlanGradientBuckets(config, n, gradient_bucket_elements))) *
                                int64_t{sizeof(float)};
  }
  plan.activation_bytes = DispatchStorageType(dtype, [&](auto zero) {
    using Storage = decltype(zero);
    Gpt2CudaActivations<Storage> views;
    BufferCarver carver(nullptr);
    CarveGpt2CudaActivations(config, B, T, carver, &views, activation_checkpointing, attention);
    return static_cast<int64_t>(carver.bytes());
  });
  plan.optimizer_bytes = gpu_optimizer ? 3 * n * int64_t{sizeof(float)} : 0;
  plan.workspace_bytes = kCublasWorkspaceBytes;
  plan.reserved_bytes = kCudaReservedBytes;
  return plan;
}

HostMemoryPlan PlanHostMemory(const Gpt2Config& config, DType dtype, bool gpu_optimizer,
                              int64_t pinned_staging_bytes) {
  const int64_t n = Gpt2NumParams(config);
  const int64_t size = DTypeSize(dtype);
  HostMemoryPlan plan;
  if (gpu_optimizer) {
    plan.trainer_bytes = n * size;
    return plan;
  }
  plan.optimizer_state_bytes = 3 * n * int64_t{sizeof(float)};
  plan.trainer_bytes = 2 * n * size;
  plan.staging_bytes = 2 * pinned_staging_bytes;
  return plan;
}

absl::StatusOr<LargestTrainable> LargestTrainableGpt2(int64_t device_bytes, int B, int T,
                                                      DType dtype, bool gpu_optimizer,
                                                      const ParamPlacement& placement,
                                                      bool activation_checkpointing,
                                                      int64_t host_bytes,
                                                      int64_t gradient_bucket_elements) {
  // GPT-2 small ... XL, then GPT-3 2.7B ... 175B widths.
  static constexpr int kWidths[] = {768,  1024, 1280, 1600, 2048, 2560,
                                    4096, 5120, 6144, 8192, 12288};
  LargestTrainable best;
  for (const int C : kWidths) {
    Gpt2Config config;
    config.vocab_size = 50257;
    config.context_length = T;
    config.channels = C;
    config.num_heads = C <= 1280 ? C / 64 : C / 128;
    auto gpu_fits = [&](const Gpt2Config& c) {
      return PlanGpt2CudaMemory(c, B, T, dtype, gpu_optimizer, placement, activation_checkpointing,
                                gradient_bucket_elements)
                 .total_bytes() <= device_bytes;
    };
    auto host_fits = [&](const Gpt2Config& c) {
      return host_bytes <= 0 ||
             PlanHostMemory(c, dtype, gpu_optimizer, kDefaultPinnedStagingBytes).total_bytes() <=
                 host_bytes;
    };
    auto fits = [&](int layers) {
      config.num_layers = layers;
      return gpu_fits(config) && host_fits(config);
    };
    // Memory grows with depth, so the deepest model that fits is a binary search away.
    // Up to 2^16 layers: beyond any model a window of layers or the host could train.
    int lo = 0, hi = 1 << 16;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (fits(mid)) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    if (lo == 0) continue;
    config.num_layers = lo;
    const int64_t n = Gpt2NumParams(config);
    if (n > best.num_params) {
      best.config = config;
      best.num_params = n;
      best.plan = PlanGpt2CudaMemory(config, B, T, dtype, gpu_optimizer, placement,
                                     activation_checkpointing, gradient_bucket_elements);
      best.host = PlanHostMemory(config, dtype, gpu_optimizer, kDefaultPinnedStagingBytes);
      Gpt2Config deeper = config;
      ++deeper.num_layers;
      const bool gpu = !gpu_fits(deeper), host = !host_fits(deeper);
      best.binds = gpu && host ? "both" : host ? "host" : "gpu";
    }
  }
  if (best.num_params == 0) {
    return absl::NotFoundError(absl::StrCat("no GPT-2-shaped model fits in ", device_bytes >> 20,
                                            " MiB at batch ", B, ", sequence ", T));
  }
  return best;
}

std::string DescribeConfig(const Gpt2Config& c) {
  return absl::StrCat("L", c.num_layers, " C", c.channels, " H", c.num_heads, " V", c.vocab_size,
                      " T", c.context_length);
}

}  // namespace offload
