// Every fast kernel against its naive reference, forward and backward, on odd sizes (nothing a
// multiple of a vector width or a BLAS block). Outputs the contract says are accumulated start
// from the same random values in both runs, so both must add to them; outputs it says are
// overwritten start as NaN, so a kernel that reads them fails. Error measure: MaxRelError
// (max |fast - naive| / max |naive| per tensor), at most kTol.
#include <cmath>
#include <cstdint>
#include <vector>

#include "gpu_trainer/model/layer_kernels.h"
#include "gpu_trainer/model/layers_fast.h"
#include "gpu_trainer/model/layers_naive.h"
#include "gpu_trainer/model/model_test_util.h"
#include "gpu_trainer/model/vec_math.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

using testing_util::MaxRelError;
using testing_util::RandomTokens;
using testing_util::RandomVector;
using Tensors = std::vector<std::vector<float>>;

constexpr double kTol = 1e-5;
constexpr int B = 2, T = 7, C = 24, NH = 3, OC = 40, V = 37, kMaxT = 9;

// The starting value of an output the kernel must overwrite.
std::vector<float> Nans(int64_t n) { return std::vector<float>(n, NAN); }

// Runs `call` once per kernel set, each on its own copy of `initial`, and compares every tensor.
template <typename Call>
void CompareKernels(const Tensors& initial, const std::vector<const char*>& names, Call call) {
  Tensors naive = initial, fast = initial;
  call(NaiveKernels(), naive);
  call(FastKernels(), fast);
  for (size_t i = 0; i < names.size(); i++) {
    const double err = MaxRelError(fast[i], naive[i]);
    EXPECT_LE(err, kTol) << names[i];
    ::testing::Test::RecordProperty(names[i], testing_util::Sci(err));
  }
}

TEST(LayerKernels, EncoderForwardBackward) {
  // Few distinct tokens, so several positions add into the same row of dwte.
  const std::vector<int32_t> inp = RandomTokens(B * T, 5, 1);
  const std::vector<float> wte = RandomVector(V * C, 2), wpe = RandomVector(kMaxT * C, 3);
  CompareKernels({Nans(B * T * C)}, {"out"}, [&](const CpuLayerKernels& k, Tensors& o) {
    k.encoder_forward(o[0].data(), inp.data(), wte.data(), wpe.data(), B, T, C);
  });
  const std::vector<float> dout = RandomVector(B * T * C, 4);
  CompareKernels({RandomVector(V * C, 5), RandomVector(kMaxT * C, 6)}, {"dwte", "dwpe"},
                 [&](const CpuLayerKernels& k, Tensors& o) {
                   k.encoder_backward(o[0].data(), o[1].data(), dout.data(), inp.data(), B, T, C);
                 });
}

TEST(LayerKernels, LayerNormForwardBackward) {
  const std::vector<float> inp = RandomVector(B * T * C, 1, 3.0f);
  const std::vector<float> weight = RandomVector(C, 2), bias = RandomVector(C, 3);
  CompareKernels({Nans(B * T * C), Nans(B * T), Nans(B * T)}, {"out", "mean", "rstd"},
                 [&](const CpuLayerKernels& k, Tensors& o) {
                   k.layernorm_forward(o[0].data(), o[1].data(), o[2].data(), inp.data(),
                                       weight.data(), bias.data(), B, T, C);
                 });
  std::vector<float> out(B * T * C), mean(B * T), rstd(B * T);
  NaiveKernels().layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(),
                                   bias.data(), B, T, C);
  const std::vector<float> dout = RandomVector(B * T * C, 4);
  CompareKernels({RandomVector(B * T * C, 5), RandomVector(C, 6), RandomVector(C, 7)},
                 {"dinp", "dweight", "dbias"}, [&](const CpuLayerKernels& k, Tensors& o) {
                   k.layernorm_backward(o[0].data(), o[1].data(), o[2].data(), dout.data(),
                                        inp.data(), weight.data(), mean.data(), rstd.data(), B, T,
                                        C);
                 });
}

TEST(LayerKernels, MatmulForwardBackward) {
  const std::vector<float> inp = RandomVector(B * T * C, 1);
  const std::vector<float> weight = RandomVector(C * OC, 2), bias = RandomVector(OC, 3);
  for (const bool with_bias : {true, false}) {
    SCOPED_TRACE(with_bias ? "with bias" : "without bias");
    const float* b = with_bias ? bias.data() : nullptr;
    CompareKernels({Nans(B * T * OC)}, {"out"}, [&](const CpuLayerKernels& k, Tensors& o) {
      k.matmul_forward(o[0].data(), inp.data(), weight.data(), b, B, T, C, OC);
    });
    const std::vector<float> dout = RandomVector(B * T * OC, 4);
    CompareKernels({Nans(B * T * C), RandomVector(C * OC, 6), RandomVector(OC, 7)},
                   {"dinp", "dweight", "dbias"}, [&](const CpuLayerKernels& k, Tensors& o) {
                     k.matmul_backward(o[0].data(), o[1].data(), with_bias ? o[2].data() : nullptr,
                                       dout.data(), inp.data(), weight.data(), B, T, C, OC);
                   });
  }
}

TEST(LayerKernels, AttentionForwardBackward) {
  const std::vector<float> qkv = RandomVector(B * T * 3 * C, 1, 2.0f);
  const int64_t BHTT = int64_t{B} * NH * T * T;
  CompareKernels(
      {Nans(B * T * C), Nans(BHTT)}, {"out", "att"}, [&](const CpuLayerKernels& k, Tensors& o) {
        std::vector<float> preatt(BHTT);
        k.attention_forward(o[0].data(), preatt.data(), o[1].data(), qkv.data(), B, T, C, NH);
      });
  std::vector<float> out(B * T * C), preatt(BHTT), att(BHTT);
  NaiveKernels().attention_forward(out.data(), preatt.data(), att.data(), qkv.data(), B, T, C, NH);
  const std::vector<float> dout = RandomVector(B * T * C, 4);
  CompareKernels({Nans(B * T * 3 * C)}, {"dqkv"}, [&](const CpuLayerKernels& k, Tensors& o) {
    // Scratch starts as garbage: neither set may depend on its contents.
    std::vector<float> dpreatt = RandomVector(BHTT, 6), datt = RandomVector(BHTT, 7);
    k.attention_backward(o[0].data(), dpreatt.data(), datt.data(), dout.data(), qkv.data(),
                         att.data(), B, T, C, NH);
  });
}

TEST(LayerKernels, GeluForwardBackward) {
  const int64_t N = B * T * 4 * C + 3;
  // Scale 6 reaches both saturated tails, where tanh's derivative is tiny.
  const std::vector<float> inp = RandomVector(N, 1, 6.0f);
  CompareKernels({Nans(N)}, {"out"}, [&](const CpuLayerKernels& k, Tensors& o) {
    k.gelu_forward(o[0].data(), inp.data(), N);
  });
  const std::vector<float> dout = RandomVector(N, 2);
  CompareKernels({Nans(N)}, {"dinp"}, [&](const CpuLayerKernels& k, Tensors& o) {
    k.gelu_backward(o[0].data(), inp.data(), dout.data(), N);
  });
}

TEST(LayerKernels, ResidualForward) {
  const int64_t N = B * T * C + 1;
  const std::vector<float> a = RandomVector(N, 1), b = RandomVector(N, 2);
  CompareKernels({Nans(N)}, {"out"}, [&](const CpuLayerKernels& k, Tensors& o) {
    k.residual_forward(o[0].data(), a.data(), b.data(), N);
  });
}

TEST(LayerKernels, TiedHeadForwardBackward) {
  const std::vector<float> inp = RandomVector(B * T * C, 1), wte = RandomVector(V * C, 2);
  CompareKernels({Nans(B * T * V)}, {"logits"}, [&](const CpuLayerKernels& k, Tensors& o) {
    k.tied_head_forward(o[0].data(), inp.data(), wte.data(), B, T, C, V);
  });
  const std::vector<float> dlogits = RandomVector(B * T * V, 3);
  CompareKernels({Nans(B * T * C), RandomVector(V * C, 5)}, {"dinp", "dwte"},
                 [&](const CpuLayerKernels& k, Tensors& o) {
                   k.tied_head_backward(o[0].data(), o[1].data(), dlogits.data(), inp.data(),
                                        wte.data(), B, T, C, V);
                 });
}

TEST(LayerKernels, CrossEntropyForwardBackward) {
  const std::vector<float> logits = RandomVector(B * T * V, 1, 8.0f);
  const std::vector<int32_t> targets = RandomTokens(B * T, V, 2);
  CompareKernels({Nans(B * T), Nans(B * T * V)}, {"losses", "probs"},
                 [&](const CpuLayerKernels& k, Tensors& o) {
                   k.crossentropy_forward(o[0].data(), o[1].data(), logits.data(), targets.data(),
                                          B, T, V);
                 });
  std::vector<float> losses(B * T), probs(B * T * V);
  NaiveKernels().crossentropy_forward(losses.data(), probs.data(), logits.data(), targets.data(), B,
                                      T, V);
  CompareKernels({Nans(B * T * V)}, {"dlogits"}, [&](const CpuLayerKernels& k, Tensors& o) {
    k.crossentropy_backward(o[0].data(), probs.data(), targets.data(), 0.37f, B, T, V);
  });
}

TEST(VecMath, ExpMatchesLibmWithinFewUlp) {
  double worst = 0.0;
  for (float x = -87.0f; x <= 88.0f; x += 0.0137f) {
    const double ref = std::exp(double{x});
    worst = std::max(worst, std::fabs(VecExp(x) - ref) / ref);
  }
  EXPECT_LE(worst, 3.0 * 0x1.0p-24) << "relative error";  // ~2 ulp of fp32
  EXPECT_EQ(VecExp(0.0f), 1.0f);
  EXPECT_GT(VecExp(-1000.0f), 0.0f);  // clamped, still a normal number
  EXPECT_TRUE(std::isfinite(VecExp(1000.0f)));
}

TEST(VecMath, TanhSech2MatchLibm) {
  double worst_tanh = 0.0, worst_sech2 = 0.0;
  for (float u = -20.0f; u <= 20.0f; u += 0.00731f) {
    const TanhSech2 th = VecTanhSech2(u);
    const float t = th.tanh, s = th.sech2;
    const double ref_t = std::tanh(double{u});
    const double ref_s = 1.0 / (std::cosh(double{u}) * std::cosh(double{u}));
    worst_tanh = std::max(worst_tanh, std::fabs(t - ref_t));
    worst_sech2 = std::max(worst_sech2, std::fabs(s - ref_s) / ref_s);
  }
  EXPECT_LE(worst_tanh, 2e-7) << "absolute";
  EXPECT_LE(worst_sech2, 2e-6) << "relative";
}

}  // namespace
}  // namespace offload
