// The memory planner is host arithmetic: these tests run, and must pass, on any machine, GPU or
// not. They hold it to what follows from the model's layout (16-bit weights and gradients, 12
// bytes of fp32 optimizer state per parameter on the GPU without offload; the bucket slots and the
// parameter window summed here by hand from the units' sizes) and to what "largest that fits"
// means, not to numbers copied from its own output.
#include "gpu_trainer/cuda/memory_planner.h"

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "gtest/gtest.h"
#include "model_spec/gpt2_config.h"
#include "model_spec/param_layout.h"

namespace offload {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

Gpt2Config Gpt2Small() {
  Gpt2Config c;
  c.vocab_size = 50257;
  c.context_length = 1024;
  c.num_layers = 12;
  c.num_heads = 12;
  c.channels = 768;
  return c;
}

// Small enough to sum by hand, and with every unit a multiple of 64 elements (C = 128), so that
// the slots' 64-element alignment adds nothing: the embeddings (V + T) C = 73728, a block
// 12 C^2 + 13 C = 198272, ln_f 2 C = 256.
Gpt2Config Small() {
  return Gpt2Config{/*vocab=*/512, /*context=*/64, /*layers=*/4, /*heads=*/4, /*channels=*/128};
}
constexpr int64_t kSmallEmbeddings = 73728, kSmallBlock = 198272, kSmallLnf = 256;

int64_t SumOfParts(const CudaMemoryPlan& p) {
  return p.params_bytes + p.grads_bytes + p.activation_bytes + p.optimizer_bytes +
         p.reduce_scratch_bytes + p.workspace_bytes + p.reserved_bytes;
}

TEST(MemoryPlanner, Gpt2SmallIsTheHuggingFaceModel) {
  // GPT-2 124M as published (Hugging Face's gpt2: 124,439,808 parameters, tied head).
  EXPECT_EQ(Gpt2NumParams(Gpt2Small()), 124439808);
  EXPECT_EQ(DescribeConfig(Gpt2Small()), "L12 C768 H12 V50257 T1024");
}

TEST(MemoryPlanner, WeightsGradientsAndOptimizerStateOfGpt2Small) {
  const Gpt2Config c = Gpt2Small();
  const int64_t n = Gpt2NumParams(c);
  for (const bool gpu_optimizer : {false, true}) {
    SCOPED_TRACE(gpu_optimizer ? "GPU optimizer" : "offload");
    const CudaMemoryPlan plan = PlanGpt2CudaMemory(c, 1, 1024, DType::kBf16, gpu_optimizer);
    EXPECT_EQ(plan.params_bytes, 2 * n);
    EXPECT_EQ(plan.grads_bytes, 2 * n);
    // fp32 master, exp_avg and exp_avg_sq, only when they live on the GPU.
    EXPECT_EQ(plan.optimizer_bytes, gpu_optimizer ? 12 * n : 0);
    EXPECT_EQ(plan.reduce_scratch_bytes, 0);
    EXPECT_EQ(plan.workspace_bytes, kCublasWorkspaceBytes);
    EXPECT_EQ(plan.reserved_bytes, kCudaReservedBytes);
    EXPECT_EQ(plan.total_bytes(), SumOfParts(plan));
  }
  // Where the optimizer state lives changes nothing else.
  const CudaMemoryPlan offload = PlanGpt2CudaMemory(c, 1, 1024, DType::kBf16, false);
  const CudaMemoryPlan gpu_only = PlanGpt2CudaMemory(c, 1, 1024, DType::kBf16, true);
  EXPECT_EQ(offload.activation_bytes, gpu_only.activation_bytes);
  EXPECT_EQ(gpu_only.total_bytes() - offload.total_bytes(), 12 * n);
}

TEST(MemoryPlanner, Fp16AndBf16NeedTheSameMemory) {
  const CudaMemoryPlan bf16 = PlanGpt2CudaMemory(Gpt2Small(), 2, 1024, DType::kBf16, false);
  const CudaMemoryPlan fp16 = PlanGpt2CudaMemory(Gpt2Small(), 2, 1024, DType::kFp16, false);
  EXPECT_EQ(bf16.total_bytes(), fp16.total_bytes());
  EXPECT_EQ(bf16.activation_bytes, fp16.activation_bytes);
}

TEST(MemoryPlanner, ActivationsHoldAtLeastTheLogitsAndEveryLayerInput) {
  // Backward cannot run without the (B, T, V) logits (their gradient) and each layer's
  // (B, T, C) input, all 16-bit: a lower bound that any carve must meet.
  const Gpt2Config c = Gpt2Small();
  for (const int B : {1, 4}) {
    const int64_t BT = int64_t{B} * 1024;
    const CudaMemoryPlan plan = PlanGpt2CudaMemory(c, B, 1024, DType::kBf16, false);
    EXPECT_GE(plan.activation_bytes, 2 * (BT * c.vocab_size + c.num_layers * BT * c.channels))
        << "B=" << B;
  }
}

TEST(MemoryPlanner, ActivationsGrowAboutLinearlyWithBatch) {
  const Gpt2Config c = Gpt2Small();
  const int64_t a1 = PlanGpt2CudaMemory(c, 1, 1024, DType::kBf16, false).activation_bytes;
  const int64_t a2 = PlanGpt2CudaMemory(c, 2, 1024, DType::kBf16, false).activation_bytes;
  const int64_t a4 = PlanGpt2CudaMemory(c, 4, 1024, DType::kBf16, false).activation_bytes;
  EXPECT_GT(a2, a1);
  EXPECT_GT(a4, a2);
  // Every saved activation and activation gradient is (B, ...); what is not (reduction scratch,
  // the grad-norm result, 256-byte alignment) is a few MiB against the ~1 GiB of one sequence of
  // 1024 tokens through 12 layers. So doubling the batch nearly doubles the activations, and
  // nothing grows faster than the batch.
  EXPECT_GT(a2, a1 * 19 / 10);
  EXPECT_LE(a2, 2 * a1 + (int64_t{16} << 20));
  EXPECT_GT(a4, a2 * 19 / 10);
  EXPECT_LE(a4, 2 * a2 + (int64_t{16} << 20));
}

TEST(MemoryPlanner, ActivationsGrowWithSequenceLength) {
  const Gpt2Config c = Gpt2Small();
  EXPECT_GT(PlanGpt2CudaMemory(c, 1, 1024, DType::kBf16, false).activation_bytes,
            PlanGpt2CudaMemory(c, 1, 512, DType::kBf16, false).activation_bytes);
}

// What LargestTrainableGpt2 promises, for one device size and optimizer placement.
void ExpectLargestFits(int64_t device_bytes, bool gpu_optimizer, LargestTrainable* out) {
  absl::StatusOr<LargestTrainable> best =
      LargestTrainableGpt2(device_bytes, 1, 1024, DType::kBf16, gpu_optimizer);
  ASSERT_TRUE(best.ok()) << best.status();
  const Gpt2Config& c = best->config;
  ASSERT_TRUE(ValidateGpt2Config(c).ok()) << DescribeConfig(c);
  EXPECT_EQ(c.vocab_size, 50257);
  EXPECT_EQ(c.context_length, 1024);
  EXPECT_EQ(best->num_params, Gpt2NumParams(c));
  // The plan it reports is the planner's plan for that model, and it fits.
  const CudaMemoryPlan plan = PlanGpt2CudaMemory(c, 1, 1024, DType::kBf16, gpu_optimizer);
  EXPECT_EQ(best->plan.total_bytes(), plan.total_bytes());
  EXPECT_EQ(best->plan.optimizer_bytes, gpu_optimizer ? 12 * best->num_params : 0);
  EXPECT_LE(plan.total_bytes(), device_bytes);
  // As many layers as fit: one more of the same width does not.
  Gpt2Config deeper = c;
  ++deeper.num_layers;
  EXPECT_GT(PlanGpt2CudaMemory(deeper, 1, 1024, DType::kBf16, gpu_optimizer).total_bytes(),
            device_bytes)
      << DescribeConfig(c);
  *out = *best;
}

TEST(MemoryPlanner, LargestTrainableOn80GiBFitsAndIsAsDeepAsPossible) {
  LargestTrainable offload, gpu_only;
  ExpectLargestFits(80 * kGiB, /*gpu_optimizer=*/false, &offload);
  ExpectLargestFits(80 * kGiB, /*gpu_optimizer=*/true, &gpu_only);
  // Leaving 12 of every 16 bytes of per-parameter state on the CPU must buy a larger model.
  EXPECT_GT(offload.num_params, gpu_only.num_params);
  // And GPT-2 124M itself trains on 80 GiB either way, so neither answer can be smaller.
  EXPECT_GE(gpu_only.num_params, Gpt2NumParams(Gpt2Small()));
}

TEST(MemoryPlanner, LargestTrainableGrowsWithTheDevice) {
  LargestTrainable small, large;
  ExpectLargestFits(40 * kGiB, /*gpu_optimizer=*/false, &small);
  ExpectLargestFits(80 * kGiB, /*gpu_optimizer=*/false, &large);
  EXPECT_GT(large.num_params, small.num_params);
}

TEST(MemoryPlanner, Stage3HoldsThePartitionAndTheWindow) {
  const Gpt2Config c = Gpt2Small();
  const int64_t n = Gpt2NumParams(c);
  const int64_t window =
      Gpt2UnitRange(c, 0).size() + Gpt2UnitRange(c, 13).size() + 2 * Gpt2UnitRange(c, 1).size();
  EXPECT_EQ(DeviceParamElements(c, {}), n);
  EXPECT_EQ(DeviceParamElements(c, {3, 1, 2}), window);  // one rank: the model stays on the host
  // 124439808 = 4 x 64 x 486093: four partitions of whole blocks, no padding.
  EXPECT_EQ(DeviceParamElements(c, {3, 4, 2}), n / 4 + window);
  EXPECT_EQ(DeviceParamElements(c, {3, 1, 100}), n);  // a window as deep as the model

  // Padding: the small model's 867072 parameters (13548 blocks of 64) over 5 ranks are 2709.6
  // blocks a rank, so each partition is 2710 blocks, 173440 elements, and the padded space 867200.
  const Gpt2Config s = Small();
  ASSERT_EQ(Gpt2NumParams(s), kSmallEmbeddings + 4 * kSmallBlock + kSmallLnf);
  ASSERT_EQ(Gpt2NumParams(s), 867072);
  EXPECT_EQ(DeviceParamElements(s, {2, 1, 2}), 867072);
  EXPECT_EQ(DeviceParamElements(s, {2, 5, 2}), 867200);  // stage 2: the padded model
  const int64_t small_window = kSmallEmbeddings + kSmallLnf + 2 * kSmallBlock;
  EXPECT_EQ(DeviceParamElements(s, {3, 1, 2}), small_window);
  EXPECT_EQ(DeviceParamElements(s, {3, 5, 2}), small_window + 173440);
  EXPECT_EQ(DeviceParamElements(s, {3, 5, 1}), small_window - kSmallBlock + 173440);
  const CudaMemoryPlan stage2 = PlanGpt2CudaMemory(c, 1, 1024, DType::kBf16, false);
  const CudaMemoryPlan offloaded = PlanGpt2CudaMemory(c, 1, 1024, DType::kBf16, false, {3, 1, 2});
  EXPECT_EQ(offloaded.params_bytes, 2 * window);
  EXPECT_EQ(stage2.total_bytes() - offloaded.total_bytes(), 2 * (n - window));

  // The window frees the weights' 2 bytes per parameter, so a larger model fits, and still the
  // deepest that does.
  for (const int ranks : {1, 8}) {
    const ParamPlacement placement{3, ranks, 2};
    absl::StatusOr<LargestTrainable> zero3 =
        LargestTrainableGpt2(80 * kGiB, 1, 1024, DType::kBf16, false, placement);
    absl::StatusOr<LargestTrainable> zero2 =
        LargestTrainableGpt2(80 * kGiB, 1, 1024, DType::kBf16, false);
    ASSERT_TRUE(zero3.ok() && zero2.ok());
    EXPECT_GT(zero3->num_params, zero2->num_params) << ranks;
    EXPECT_LE(zero3->plan.total_bytes(), 80 * kGiB);
    Gpt2Config deeper = zero3->config;
    ++deeper.num_layers;
    EXPECT_GT(PlanGpt2CudaMemory(deeper, 1, 1024, DType::kBf16, false, placement).total_bytes(),
              80 * kGiB);
  }
}

TEST(MemoryPlanner, HostHoldsTheShardsStateAndTheTrainersCopies) {
  const Gpt2Config c = Gpt2Small();
  const int64_t n = Gpt2NumParams(c);
  const HostMemoryPlan offload = PlanHostMemory(c, DType::kBf16, false, 64 << 20);
  EXPECT_EQ(offload.optimizer_state_bytes, 12 * n);
  EXPECT_EQ(offload.trainer_bytes, 4 * n);
  EXPECT_EQ(offload.staging_bytes, 128 << 20);
  EXPECT_EQ(PlanHostMemory(c, DType::kBf16, true, 64 << 20).total_bytes(), 2 * n);
}

// With 80 GiB of GPU and 128 GiB of host (the lent H100 machine), offload's 16 host bytes a
// parameter bind first; without offload the GPU does. Either way the plan fits both, and one more
// layer does not fit the side named.
TEST(MemoryPlanner, TheHostCanBindFirst) {
  for (const bool gpu_optimizer : {false, true}) {
    absl::StatusOr<LargestTrainable> best = LargestTrainableGpt2(
        80 * kGiB, 1, 1024, DType::kBf16, gpu_optimizer, {}, false, 128 * kGiB);
    ASSERT_TRUE(best.ok()) << best.status();
    EXPECT_EQ(best->binds, gpu_optimizer ? "gpu" : "host");
    EXPECT_LE(best->plan.total_bytes(), 80 * kGiB);
    EXPECT_LE(best->host.total_bytes(), 128 * kGiB);
    Gpt2Config deeper = best->config;
    ++deeper.num_layers;
    if (gpu_optimizer) {
      EXPECT_GT(PlanGpt2CudaMemory(deeper, 1, 1024, DType::kBf16, true).total_bytes(), 80 * kGiB);
    } else {
      EXPECT_GT(
          PlanHostMemory(deeper, DType::kBf16, false, kDefaultPinnedStagingBytes).total_bytes(),
          128 * kGiB);
    }
  }
  // No host limit: the GPU binds, and the model is larger.
  absl::StatusOr<LargestTrainable> unlimited =
      LargestTrainableGpt2(80 * kGiB, 1, 1024, DType::kBf16, false);
  absl::StatusOr<LargestTrainable> limited =
      LargestTrainableGpt2(80 * kGiB, 1, 1024, DType::kBf16, false, {}, false, 128 * kGiB);
  ASSERT_TRUE(unlimited.ok() && limited.ok());
  EXPECT_EQ(unlimited->binds, "gpu");
  EXPECT_GT(unlimited->num_params, limited->num_params);
}

// Keeping one layer's activations instead of L buys depth. With the fused attention (the
// planner's default) a layer saves 16C 16-bit values a token, and the (B, T, V) logits stay
// whatever the depth, so GPT-2 small at batch 4 checkpointed needs under half the activations;
// with the reference attention each layer also saves its (B, NH, T, T) softmax, and under a third.
TEST(MemoryPlanner, CheckpointingShrinksTheActivations) {
  const Gpt2Config c = Gpt2Small();
  const CudaMemoryPlan plain = PlanGpt2CudaMemory(c, 4, 1024, DType::kBf16, false);
  const CudaMemoryPlan checkpointed = PlanGpt2CudaMemory(c, 4, 1024, DType::kBf16, false, {}, true);
  EXPECT_LT(checkpointed.activation_bytes * 2, plain.activation_bytes);
  AttentionMemory reference;
  reference.fused = false;
  const int64_t plain_reference =
      PlanGpt2CudaMemory(c, 4, 1024, DType::kBf16, false, {}, false, 0, reference).activation_bytes;
  const int64_t checkpointed_reference =
      PlanGpt2CudaMemory(c, 4, 1024, DType::kBf16, false, {}, true, 0, reference).activation_bytes;
  EXPECT_LT(checkpointed_reference * 3, plain_reference);
  EXPECT_EQ(checkpointed.params_bytes, plain.params_bytes);
  absl::StatusOr<LargestTrainable> a = LargestTrainableGpt2(80 * kGiB, 4, 1024, DType::kBf16, true);
  absl::StatusOr<LargestTrainable> b =
      LargestTrainableGpt2(80 * kGiB, 4, 1024, DType::kBf16, true, {}, true);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_GT(b->num_params, a->num_params);
}

// Gradients that leave bucket by bucket free the device of 2 bytes a parameter; with
// checkpointing the offloaded model then needs little beyond its weights' 2 bytes a parameter
// against GPU-only's 16: the ratio approaches 16 / 2 = 8 from below (the activations and the
// buckets are the rest). The parameter window takes the weights off the device too, and passes
// 8x (with unlimited host memory).
TEST(MemoryPlanner, BucketedGradientsAndCheckpointingApproachEightTimes) {
  const Gpt2Config c = Gpt2Small();
  const int64_t n = Gpt2NumParams(c);
  const int64_t bucket = int64_t{4} << 20;  // 8 MiB of bf16
  // GPT-2 small's buckets of 4M: ln_f with block 11 (1536 + 7087872), then each block (a block is
  // 12 x 768^2 + 13 x 768 = 7087872 >= 4M), then the embeddings, (50257 + 1024) x 768 = 39383808.
  // Every unit is a whole number of 64-element blocks, so the slots are their sizes.
  EXPECT_EQ(PlanGpt2CudaMemory(c, 1, 1024, DType::kBf16, false, {}, false, bucket).grads_bytes,
            2 * (39383808 + (1536 + 7087872) + 7087872));
  // The GPU optimizer needs every gradient at once.
  EXPECT_EQ(PlanGpt2CudaMemory(c, 1, 1024, DType::kBf16, true, {}, false, bucket).grads_bytes,
            2 * n);
  absl::StatusOr<LargestTrainable> offload =
      LargestTrainableGpt2(80 * kGiB, 1, 1024, DType::kBf16, false, {}, true, 0, bucket);
  absl::StatusOr<LargestTrainable> gpu_only =
      LargestTrainableGpt2(80 * kGiB, 1, 1024, DType::kBf16, true, {}, true, 0, bucket);
  ASSERT_TRUE(offload.ok() && gpu_only.ok());
  const double ratio = static_cast<double>(offload->num_params) / gpu_only->num_params;
  EXPECT_LT(ratio, 8.0);
  EXPECT_GT(ratio, 7.5);
  absl::StatusOr<LargestTrainable> window = LargestTrainableGpt2(
      80 * kGiB, 1, 1024, DType::kBf16, false, ParamPlacement{3, 1, 2}, true, 0, bucket);
  ASSERT_TRUE(window.ok());
  EXPECT_GE(static_cast<double>(window->num_params) / gpu_only->num_params, 8.0);
}

// The device holds the embeddings' bucket in a slot of its own and the other buckets in two slots
// taken in turn, each as large as the largest bucket it takes.
TEST(MemoryPlanner, GradientsAreTheEmbeddingsSlotAndTwoOthers) {
  const Gpt2Config s = Small();
  auto grads = [&](int64_t bucket, bool gpu_optimizer, DType dtype) {
    return PlanGpt2CudaMemory(s, 1, 64, dtype, gpu_optimizer, {}, false, bucket).grads_bytes;
  };
  for (const DType dtype : {DType::kBf16, DType::kFp16}) {
    EXPECT_EQ(grads(0, false, dtype), 2 * 867072);  // no buckets: every gradient
    // Each unit its own bucket (one rank): ln_f, blocks 3, 2, 1, 0 take slots 1 and 2 in turn.
    EXPECT_EQ(grads(1, false, dtype), 2 * (kSmallEmbeddings + 2 * kSmallBlock));
    // Two blocks a bucket: ln_f with blocks 3 and 2 (ln_f and one block are not yet two blocks),
    // then blocks 1 and 0.
    EXPECT_EQ(grads(2 * kSmallBlock, false, dtype),
              2 * (kSmallEmbeddings + (kSmallLnf + 2 * kSmallBlock) + 2 * kSmallBlock));
    // Three: ln_f with blocks 3, 2 and 1; block 0 is left to the embeddings' bucket, and the
    // third slot is never used.
    EXPECT_EQ(grads(3 * kSmallBlock, false, dtype),
              2 * ((kSmallEmbeddings + kSmallBlock) + (kSmallLnf + 3 * kSmallBlock)));
    EXPECT_EQ(grads(1, true, dtype), 2 * 867072);  // the GPU optimizer: every gradient
  }
}

// W > 1 ranks reduce-scatter each bucket through an fp32 scratch as large as the largest slot
// (here a block's or ln_f's with two blocks: the embeddings' is smaller); one rank, or no buckets,
// needs none.
TEST(MemoryPlanner, RanksReduceThroughAnFp32Scratch) {
  const Gpt2Config s = Small();
  auto plan = [&](int ranks, int64_t bucket, bool gpu_optimizer = false) {
    return PlanGpt2CudaMemory(s, 1, 64, DType::kBf16, gpu_optimizer, ParamPlacement{3, ranks, 2},
                              false, bucket);
  };
  EXPECT_EQ(plan(4, 1).reduce_scratch_bytes, 4 * kSmallBlock);
  EXPECT_EQ(plan(4, 2 * kSmallBlock).reduce_scratch_bytes, 4 * (kSmallLnf + 2 * kSmallBlock));
  EXPECT_EQ(plan(1, 1).reduce_scratch_bytes, 0);
  EXPECT_EQ(plan(4, 0).reduce_scratch_bytes, 0);
  EXPECT_EQ(plan(4, 1, /*gpu_optimizer=*/true).reduce_scratch_bytes, 0);
  const CudaMemoryPlan four = plan(4, 1);
  EXPECT_EQ(four.total_bytes(), SumOfParts(four));
  // Four ranks hold a partition each: 867072 / 4 = 3387 blocks of 64 a rank, no padding.
  EXPECT_EQ(four.params_bytes, 2 * (kSmallEmbeddings + kSmallLnf + 2 * kSmallBlock + 867072 / 4));
}

TEST(MemoryPlanner, NothingFitsInWhatTheCudaContextReserves) {
  for (const bool gpu_optimizer : {false, true}) {
    // kCudaReservedBytes (1 GiB) is held back before any model byte, so a 1 GiB device (or a
    // little more) has room for nothing.
    for (const int64_t device_bytes :
         {kCudaReservedBytes, kCudaReservedBytes + (int64_t{1} << 20)}) {
      absl::StatusOr<LargestTrainable> best =
          LargestTrainableGpt2(device_bytes, 1, 1024, DType::kBf16, gpu_optimizer);
      EXPECT_EQ(best.status().code(), absl::StatusCode::kNotFound)
          << device_bytes << " bytes: " << (best.ok() ? DescribeConfig(best->config) : "");
    }
  }
}

// The fused attention (the planner's default) saves (B, NH, T) fp32 statistics a layer where the
// reference saves the (B, NH, T, T) softmax, and needs a workspace instead of the reference's
// permute scratch; the model passes the attention it runs, so its carve is the plan either way.
TEST(MemoryPlanner, FusedAttentionNeverHoldsTheSoftmaxMatrix) {
  const Gpt2Config c = Gpt2Small();
  const int B = 4, T = 1024;
  AttentionMemory reference;
  reference.fused = false;
  const int64_t fused_bytes = PlanGpt2CudaMemory(c, B, T, DType::kBf16, false).activation_bytes;
  const int64_t reference_bytes =
      PlanGpt2CudaMemory(c, B, T, DType::kBf16, false, {}, false, 0, reference).activation_bytes;
  const int64_t softmax_bytes = int64_t{c.num_layers} * B * c.num_heads * T * T * 2;
  // The statistics (2.4 MB here) and the workspace (the fp32 dQ accumulator, 12.6 MB) are far
  // below the scratch the reference needs beside its softmax, so the difference is at least the
  // softmax itself.
  EXPECT_GT(reference_bytes - fused_bytes, softmax_bytes);
  // A workspace the plans asked for is carved as given.
  AttentionMemory measured;
  measured.cudnn_workspace_bytes = int64_t{64} << 20;
  const int64_t measured_bytes =
      PlanGpt2CudaMemory(c, B, T, DType::kBf16, false, {}, false, 0, measured).activation_bytes;
  EXPECT_GT(measured_bytes, fused_bytes);
  EXPECT_LE(measured_bytes - fused_bytes, int64_t{64} << 20);
}

}  // namespace
}  // namespace offload
