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

// The MLP's fused products (matmul.cc), column-major: the forward fc with GELU_AUX_BIAS (aux =
// fch, ld 4C), c_proj's dinp with DGELU_BGRAD (aux = fch again, ld 4C) and a weight gradient with
// BGRADA.
GemmSpec GeluForwardSpec(uintptr_t aux_offset, int64_t aux_ld) {
  GemmSpec s = FcSpec(At(0), At(1 << 24), AtMut(2 << 24), At(256));
  s.trans_a = false;
  s.lda = 3072;
  s.epilogue = GemmEpilogue::kGeluAuxBias;
  s.aux = AtMut((3 << 24) + aux_offset);
  s.aux_ld = aux_ld;
  return s;
}

GemmSpec DGeluSpec() {
  GemmSpec s = FcSpec(At(0), At(1 << 24), AtMut(2 << 24), nullptr);
  s.epilogue = GemmEpilogue::kDGeluBGrad;
  s.aux = AtMut(3 << 24);
  s.aux_ld = 3072;
  s.bias_grad = AtMut(4 << 24);
  return s;
}

GemmSpec BGradASpec() {
  GemmSpec s = FcSpec(At(0), At(1 << 24), AtMut(2 << 24), nullptr);
  s.trans_a = false;
  s.trans_b = true;
  s.lda = 3072;
  s.epilogue = GemmEpilogue::kBGradA;
  s.bias_grad = AtMut(4 << 24);
  return s;
}

TEST(GemmEpilogue, EachEpilogueHasItsOwnPlan) {
  const GemmSpec plain = FcSpec(At(0), At(1 << 24), AtMut(2 << 24), nullptr);
  GemmSpec bias = plain;
  bias.bias = At(256);
  GemmSpec gelu = bias;
  gelu.epilogue = GemmEpilogue::kGeluAuxBias;
  gelu.aux = AtMut(3 << 24);
  gelu.aux_ld = 3072;
  GemmSpec dgelu = plain;
  dgelu.epilogue = GemmEpilogue::kDGeluBGrad;
  dgelu.aux = AtMut(3 << 24);
  dgelu.aux_ld = 3072;
  dgelu.bias_grad = AtMut(4 << 24);
  GemmSpec bgrada = plain;
  bgrada.epilogue = GemmEpilogue::kBGradA;
  bgrada.bias_grad = AtMut(4 << 24);
  absl::flat_hash_set<GemmPlanKey> keys;
  for (const GemmSpec& s : {plain, bias, gelu, dgelu, bgrada}) {
    ASSERT_EQ(CheckEpilogue(s), nullptr) << GemmEpilogueName(EffectiveEpilogue(s));
    keys.insert(MakeGemmPlanKey(s, kBf16, 2));
  }
  EXPECT_EQ(keys.size(), 5u);
  EXPECT_EQ(MakeGemmPlanKey(bias, kBf16, 2).epilogue, GemmEpilogue::kBias);  // implied by bias
  EXPECT_EQ(MakeGemmPlanKey(plain, kBf16, 2).epilogue, GemmEpilogue::kDefault);
}

TEST(GemmEpilogue, AuxLeadingDimensionAndAlignmentsAreKeyedPointersAreNot) {
  const GemmPlanKey key = MakeGemmPlanKey(GeluForwardSpec(0, 3072), kBf16, 2);
  // Another layer's aux, as aligned: the same plan.
  EXPECT_TRUE(MakeGemmPlanKey(GeluForwardSpec(1 << 20, 3072), kBf16, 2) == key);
  // Aux only 16-byte aligned (a layer's slice at an odd token count), or another ld: another.
  EXPECT_FALSE(MakeGemmPlanKey(GeluForwardSpec(16, 3072), kBf16, 2) == key);
  EXPECT_FALSE(MakeGemmPlanKey(GeluForwardSpec(0, 3200), kBf16, 2) == key);
  EXPECT_EQ(key.align_aux, 256u);
  EXPECT_EQ(key.aux_ld, 3072);
  // The bias's alignment, in and out.
  GemmSpec low_bias = GeluForwardSpec(0, 3072);
  low_bias.bias = At(16);
  EXPECT_FALSE(MakeGemmPlanKey(low_bias, kBf16, 2) == key);
  GemmSpec dgelu = DGeluSpec();
  const GemmPlanKey dgelu_key = MakeGemmPlanKey(dgelu, kBf16, 2);
  EXPECT_EQ(dgelu_key.align_bias, 256u);
  dgelu.bias_grad = AtMut((4 << 24) + 32);
  EXPECT_EQ(MakeGemmPlanKey(dgelu, kBf16, 2).align_bias, 32u);
  // A plain product keeps zeros there, whatever was left in the unused fields' neighbours.
  const GemmPlanKey plain =
      MakeGemmPlanKey(FcSpec(At(0), At(1 << 24), AtMut(2 << 24), nullptr), kBf16, 2);
  EXPECT_EQ(plain.align_bias, 0u);
  EXPECT_EQ(plain.align_aux, 0u);
  EXPECT_EQ(plain.aux_ld, 0);
}

TEST(GemmEpilogue, CheckEpilogueAcceptsTheModelsSpecsAndRefusesTheRest) {
  EXPECT_EQ(CheckEpilogue(GeluForwardSpec(0, 3072)), nullptr);
  EXPECT_EQ(CheckEpilogue(DGeluSpec()), nullptr);
  EXPECT_EQ(CheckEpilogue(BGradASpec()), nullptr);
  std::vector<GemmSpec> bad;
  bad.push_back(GeluForwardSpec(0, 3076));  // aux_ld not a multiple of 8
  bad.push_back(GeluForwardSpec(0, 3064));  // aux_ld < m
  GemmSpec s = GeluForwardSpec(0, 3072);
  s.aux = nullptr;  // GELU without its aux
  bad.push_back(s);
  s = GeluForwardSpec(0, 3072);
  s.bias = nullptr;  // GELU_AUX_BIAS without the bias
  bad.push_back(s);
  s = GeluForwardSpec(0, 3072);
  s.beta = 1.0f;  // the GELU of alpha AB + beta C is no product of the model
  bad.push_back(s);
  s = DGeluSpec();
  s.bias_grad = nullptr;
  bad.push_back(s);
  s = DGeluSpec();
  s.batch = 2;
  s.stride_a = s.stride_b = s.stride_c = 1 << 20;
  bad.push_back(s);
  s = BGradASpec();
  s.aux = AtMut(3 << 24);  // aux on an epilogue without GELU
  s.aux_ld = 3072;
  bad.push_back(s);
  s = BGradASpec();
  s.bias = At(256);  // a gradient epilogue adds no bias
  bad.push_back(s);
  s = FcSpec(At(0), At(1 << 24), AtMut(2 << 24), nullptr);
  s.bias_grad = AtMut(4 << 24);  // a bias gradient without an epilogue to write it
  bad.push_back(s);
  for (size_t i = 0; i < bad.size(); ++i) EXPECT_NE(CheckEpilogue(bad[i]), nullptr) << i;
}

TEST(GemmEpilogue, OnlyTheFusedOnesMayBeDeclined) {
  EXPECT_FALSE(IsFusedEpilogue(GemmEpilogue::kDefault));
  EXPECT_FALSE(IsFusedEpilogue(GemmEpilogue::kBias));
  EXPECT_TRUE(IsFusedEpilogue(GemmEpilogue::kGeluAuxBias));
  EXPECT_TRUE(IsFusedEpilogue(GemmEpilogue::kDGeluBGrad));
  EXPECT_TRUE(IsFusedEpilogue(GemmEpilogue::kBGradA));
}

}  // namespace
}  // namespace offload
