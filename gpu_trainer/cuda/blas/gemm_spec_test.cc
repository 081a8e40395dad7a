// The key of a product's cuBLASLt plan (gemm_spec.h): products that differ only in their
// pointers (the same layer on another micro-batch, another layer of the same shape) share a plan;
// anything that changes the descriptors, layouts or the heuristic's choice makes another. No GPU
// is needed: the key is host arithmetic.
#include "gpu_trainer/cuda/blas/gemm_spec.h"

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

constexpr int kBf16 = 14;  // CUDA_R_16BF's value; the key only compares it

// The fc product of a GPT-2 block, row-major (B*T, C) @ (C, 4C): column-major m=4C, n=B*T, k=C.
GemmSpec FcSpec(const void* a, const void* b, void* c, const void* bias) {
  GemmSpec s;
  s.trans_a = true;
  s.m = 3072;
  s.n = 8192;
  s.k = 768;
  s.a = a;
  s.lda = 768;
  s.b = b;
  s.ldb = 768;
  s.c = c;
  s.ldc = 3072;
  s.bias = bias;
  return s;
}

// 256-byte aligned addresses (what the device allocation's views are), never dereferenced.
const void* At(uintptr_t offset) { return reinterpret_cast<const void*>(0x7f0000000000 + offset); }
void* AtMut(uintptr_t offset) { return reinterpret_cast<void*>(0x7f0000000000 + offset); }

TEST(GemmPlanKey, LayersOfOneShapeShareAPlan) {
  absl::flat_hash_set<GemmPlanKey> keys;
  for (int layer = 0; layer < 12; ++layer) {
    const uintptr_t base = static_cast<uintptr_t>(layer) << 26;
    GemmSpec s = FcSpec(At(base), At(base + (1 << 24)), AtMut(base + (2 << 24)), At(base + 256));
    s.alpha = layer == 0 ? 1.0f : 0.5f;  // given per call, not part of the plan
    keys.insert(MakeGemmPlanKey(s, kBf16, 2));
  }
  EXPECT_EQ(keys.size(), 1u);
}

TEST(GemmPlanKey, WhatChangesTheDescriptorsOrTheAlgorithmMakesAnotherPlan) {
  const GemmSpec base = FcSpec(At(0), At(1 << 24), AtMut(2 << 24), At(256));
  const GemmPlanKey key = MakeGemmPlanKey(base, kBf16, 2);
  std::vector<GemmSpec> others(10, base);
  others[0].trans_a = false;
  others[1].n = 4096;  // another batch size
  others[2].ldc = 3200;
  others[3].bias = nullptr;  // no epilogue
  others[4].a = At(2);       // 2-byte aligned: the heuristic must be told
  others[5].c = AtMut(64);
  others[6].batch = 12;
  others[6].stride_a = 768 * 64;
  others[7].b = At(128);
  others[8].k = 1024;
  others[9].lda = 1024;
  absl::flat_hash_set<GemmPlanKey> keys = {key};
  for (const GemmSpec& s : others) keys.insert(MakeGemmPlanKey(s, kBf16, 2));
  EXPECT_EQ(keys.size(), others.size() + 1);
  // The storage type too.
  EXPECT_FALSE(MakeGemmPlanKey(base, 2, 2) == key);
}

TEST(GemmPlanKey, AStrideMattersOnlyForBatches) {
  GemmSpec one = FcSpec(At(0), At(1 << 24), AtMut(2 << 24), nullptr);
  GemmSpec other = one;
  other.stride_a = 77;  // ignored by a single matrix's layout
  EXPECT_TRUE(MakeGemmPlanKey(one, kBf16, 2) == MakeGemmPlanKey(other, kBf16, 2));
  one.batch = other.batch = 4;
  one.stride_a = 256 * 64;
  EXPECT_FALSE(MakeGemmPlanKey(one, kBf16, 2) == MakeGemmPlanKey(other, kBf16, 2));
}

TEST(GemmPlanKey, AlignmentIsThePowerOfTwoOfEveryMatrixOfTheBatch) {
  EXPECT_EQ(AlignmentBytes(At(0), 0, 2, 1), 256u);
  EXPECT_EQ(AlignmentBytes(At(96), 0, 2, 1), 32u);
  EXPECT_EQ(AlignmentBytes(At(0), 64, 2, 4), 128u);  // matrix i at i * 128 bytes
  EXPECT_EQ(AlignmentBytes(At(0), 3, 2, 4), 2u);
  EXPECT_EQ(AlignmentBytes(At(0), 3, 2, 1), 256u);  // no second matrix
}

}  // namespace
}  // namespace offload
