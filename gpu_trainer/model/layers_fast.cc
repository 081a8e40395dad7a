// Every matrix product goes to OpenBLAS sgemm; the rest are row-parallel loops written so the
// compiler vectorises them (vec_math.h for exp and tanh). OpenBLAS is Debian's OpenMP build: a
// sgemm called inside one of our parallel regions runs on its calling thread, and one called
// outside uses the same OpenMP pool, so the two never oversubscribe the cores.
#include "gpu_trainer/model/layers_fast.h"

#include <cblas.h>
#include <omp.h>

#include <cmath>
#include <cstdint>

#include "gpu_trainer/model/layer_kernels.h"
#include "gpu_trainer/model/vec_math.h"

namespace offload {
namespace {

constexpr float kLayerNormEps = 1e-5f;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)

// Columns [*begin, *end) of a width-n row owned by this thread inside a parallel region: for
// reductions over rows into one vector (dweight, dbias, dwte), where splitting the vector instead
// of the rows needs neither atomics nor per-thread copies.
void ThreadSlice(int64_t n, int64_t* begin, int64_t* end) {
  const int64_t tid = omp_get_thread_num(), nt = omp_get_num_threads();
  *begin = n * tid / nt;
  *end = n * (tid + 1) / nt;
}

void EncoderForward(float* out, const int32_t* inp, const float* wte, const float* wpe, int B,
                    int T, int C) {
#pragma omp parallel for
  for (int64_t bt = 0; bt < int64_t{B} * T; bt++) {
    const float* wte_ix = wte + int64_t{inp[bt]} * C;  // (C,)
    const float* wpe_t = wpe + (bt % T) * C;           // (C,)
    float* out_bt = out + bt * C;                      // (C,)
    for (int i = 0; i < C; i++) out_bt[i] = wte_ix[i] + wpe_t[i];
  }
}

void EncoderBackward(float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B, int T,
                     int C) {
#pragma omp parallel
  {
    int64_t c0, c1;
    ThreadSlice(C, &c0, &c1);
    for (int64_t bt = 0; bt < int64_t{B} * T; bt++) {
      const float* dout_bt = dout + bt * C;          // (C,)
      float* dwte_ix = dwte + int64_t{inp[bt]} * C;  // (C,)
      float* dwpe_t = dwpe + (bt % T) * C;           // (C,)
      for (int64_t i = c0; i < c1; i++) {
        dwte_ix[i] += dout_bt[i];
        dwpe_t[i] += dout_bt[i];
      }
    }
  }
}

void LayerNormForward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                      const float* bias, int B, int T, int C) {
#pragma omp parallel for
  for (int64_t bt = 0; bt < int64_t{B} * T; bt++) {
    const float* x = inp + bt * C;  // (C,)
    float* y = out + bt * C;        // (C,)
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < C; i++) sum += x[i];
    const float m = sum / C;
    float var = 0.0f;
#pragma omp simd reduction(+ : var)
    for (int i = 0; i < C; i++) var += (x[i] - m) * (x[i] - m);
    const float s = 1.0f / std::sqrt(var / C + kLayerNormEps);
    for (int i = 0; i < C; i++) y[i] = (s * (x[i] - m)) * weight[i] + bias[i];
    mean[bt] = m;
    rstd[bt] = s;
  }
}

void LayerNormBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                       const float* inp, const float* weight, const float* mean, const float* rstd,
                       int B, int T, int C) {
  const int64_t N = int64_t{B} * T;
#pragma omp parallel
  {
    // dinp: rows are independent.
#pragma omp for
    for (int64_t bt = 0; bt < N; bt++) {
      const float* dy = dout + bt * C;  // (C,)
      const float* x = inp + bt * C;    // (C,)
      float* dx = dinp + bt * C;        // (C,)
      const float m = mean[bt], s = rstd[bt];
      float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
#pragma omp simd reduction(+ : dnorm_mean, dnorm_norm_mean)
      for (int i = 0; i < C; i++) {
        const float dnorm = weight[i] * dy[i];
        dnorm_mean += dnorm;
        dnorm_norm_mean += dnorm * ((x[i] - m) * s);
      }
      dnorm_mean /= C;
      dnorm_norm_mean /= C;
      for (int i = 0; i < C; i++) {
        const float norm = (x[i] - m) * s;
        dx[i] += (weight[i] * dy[i] - dnorm_mean - norm * dnorm_norm_mean) * s;
      }
    }
    // dweight, dbias: sums over rows, each thread owning a slice of the channels.
    int64_t c0, c1;
    ThreadSlice(C, &c0, &c1);
    for (int64_t bt = 0; bt < N; bt++) {
      const float* dy = dout + bt * C;  // (C,)
      const float* x = inp + bt * C;    // (C,)
      const float m = mean[bt], s = rstd[bt];
      for (int64_t i = c0; i < c1; i++) {
        dbias[i] += dy[i];
        dweight[i] += ((x[i] - m) * s) * dy[i];
      }
    }
  }
}

void MatmulForward(float* out, const float* inp, const float* weight, const float* bias, int B,
                   int T, int C, int OC) {
  const int BT = B * T;
  if (bias != nullptr) {
    // Seed out with the bias so sgemm adds the product onto it (beta = 1): no second pass.
#pragma omp parallel for
    for (int64_t bt = 0; bt < BT; bt++) {
      for (int o = 0; o < OC; o++) out[bt * OC + o] = bias[o];
    }
  }
  // out (BT, OC) [+]= inp (BT, C) @ weight (C, OC)
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, BT, OC, C, 1.0f, inp, C, weight, OC,
              bias != nullptr ? 1.0f : 0.0f, out, OC);
}

void MatmulBackward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                    const float* weight, int B, int T, int C, int OC) {
  const int BT = B * T;
  // dinp (BT, C) = dout (BT, OC) @ weight (C, OC)^T
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, BT, C, OC, 1.0f, dout, OC, weight, OC, 0.0f,
              dinp, C);
  // dweight (C, OC) += inp (BT, C)^T @ dout (BT, OC)
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, C, OC, BT, 1.0f, inp, C, dout, OC, 1.0f,
              dweight, OC);
  if (dbias != nullptr) {
#pragma omp parallel
    {
      int64_t o0, o1;
      ThreadSlice(OC, &o0, &o1);
      for (int64_t bt = 0; bt < BT; bt++) {
        const float* dy = dout + bt * OC;  // (OC,)
        for (int64_t o = o0; o < o1; o++) dbias[o] += dy[o];
      }
    }
  }
}

// One (batch, head) pair per sgemm: Q.K^T computes the whole T x T block (BLAS has no triangular
// output), and the zeros the softmax leaves above the diagonal make att.V causal.
void AttentionForward(float* out, float* preatt, float* att, const float* qkv, int B, int T, int C,
                      int NH) {
  const int C3 = C * 3;
  const int hs = C / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < NH; h++) {
      const float* q = qkv + int64_t{b} * T * C3 + h * hs;        // (T, hs), row stride 3C
      const float* k = q + C;                                     // (T, hs), row stride 3C
      const float* v = q + 2 * C;                                 // (T, hs), row stride 3C
      float* preatt_bh = preatt + (int64_t{b} * NH + h) * T * T;  // (T, T)
      float* att_bh = att + (int64_t{b} * NH + h) * T * T;        // (T, T)
      float* out_bh = out + int64_t{b} * T * C + h * hs;          // (T, hs), row stride C

      // preatt = scale * Q @ K^T
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hs, scale, q, C3, k, C3, 0.0f,
                  preatt_bh, T);
      for (int t = 0; t < T; t++) {
        const float* s = preatt_bh + int64_t{t} * T;  // (T,)
        float* a = att_bh + int64_t{t} * T;           // (T,)
        float maxval = s[0];
#pragma omp simd reduction(max : maxval)
        for (int t2 = 1; t2 <= t; t2++) maxval = s[t2] > maxval ? s[t2] : maxval;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int t2 = 0; t2 <= t; t2++) {
          a[t2] = VecExp(s[t2] - maxval);
          sum += a[t2];
        }
        const float inv = 1.0f / sum;
        for (int t2 = 0; t2 <= t; t2++) a[t2] *= inv;
        for (int t2 = t + 1; t2 < T; t2++) a[t2] = 0.0f;
      }
      // out = att @ V
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hs, T, 1.0f, att_bh, T, v, C3, 0.0f,
                  out_bh, C);
    }
  }
}

void AttentionBackward(float* dqkv, float* dpreatt, float* datt, const float* dout,
                       const float* qkv, const float* att, int B, int T, int C, int NH) {
  const int C3 = C * 3;
  const int hs = C / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < NH; h++) {
      const float* q = qkv + int64_t{b} * T * C3 + h * hs;          // (T, hs), row stride 3C
      const float* k = q + C;                                       // (T, hs), row stride 3C
      const float* v = q + 2 * C;                                   // (T, hs), row stride 3C
      float* dq = dqkv + int64_t{b} * T * C3 + h * hs;              // (T, hs), row stride 3C
      float* dk = dq + C;                                           // (T, hs), row stride 3C
      float* dv = dq + 2 * C;                                       // (T, hs), row stride 3C
      const float* att_bh = att + (int64_t{b} * NH + h) * T * T;    // (T, T)
      float* datt_bh = datt + (int64_t{b} * NH + h) * T * T;        // (T, T)
      float* dpreatt_bh = dpreatt + (int64_t{b} * NH + h) * T * T;  // (T, T)
      const float* dout_bh = dout + int64_t{b} * T * C + h * hs;    // (T, hs), row stride C

      // datt = dout @ V^T
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hs, 1.0f, dout_bh, C, v, C3, 0.0f,
                  datt_bh, T);
      // dV = att^T @ dout
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hs, T, 1.0f, att_bh, T, dout_bh, C,
                  0.0f, dv, C3);
      // Softmax backward, row by row: dpreatt = att * (datt - sum(att * datt)); zero above the
      // diagonal so the two products below stay causal.
      for (int t = 0; t < T; t++) {
        const float* a = att_bh + int64_t{t} * T;    // (T,)
        const float* da = datt_bh + int64_t{t} * T;  // (T,)
        float* dp = dpreatt_bh + int64_t{t} * T;     // (T,)
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int t2 = 0; t2 <= t; t2++) dot += a[t2] * da[t2];
        for (int t2 = 0; t2 <= t; t2++) dp[t2] = a[t2] * (da[t2] - dot);
        for (int t2 = t + 1; t2 < T; t2++) dp[t2] = 0.0f;
      }
      // dQ = scale * dpreatt @ K
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hs, T, scale, dpreatt_bh, T, k, C3,
                  0.0f, dq, C3);
      // dK = scale * dpreatt^T @ Q
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hs, T, scale, dpreatt_bh, T, q, C3,
                  0.0f, dk, C3);
    }
  }
}

// GELU is the one loop outside BLAS where vector width shows (~30 flops per element of every
// layer's (B, T, 4C) hidden activations, forward and backward), so its chunks are also compiled
// for AVX2 and AVX-512 and the loader picks the widest the CPU has (GCC/Clang function
// multiversioning, glibc ifunc). The baseline build alone would use 4-wide SSE. Not under
// ThreadSanitizer: the ifunc resolver runs while the loader relocates, before TSan's runtime is
// up, and TSan's instrumentation of the resolver crashes the program there.
// GCC says TSan with __SANITIZE_THREAD__; clang (14) only through __has_feature.
#if defined(__SANITIZE_THREAD__)
#define OFFLOAD_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define OFFLOAD_UNDER_TSAN 1
#endif
#endif
#if defined(__x86_64__) && defined(__ELF__) && !defined(OFFLOAD_UNDER_TSAN)
#define OFFLOAD_VECTOR_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define OFFLOAD_VECTOR_CLONES
#endif

OFFLOAD_VECTOR_CLONES void GeluForwardChunk(float* out, const float* inp, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    const float x = inp[i];
    const TanhSech2 th = VecTanhSech2(kGeluScale * (x + 0.044715f * x * x * x));
    out[i] = 0.5f * x * (1.0f + th.tanh);
  }
}

OFFLOAD_VECTOR_CLONES void GeluBackwardChunk(float* dinp, const float* inp, const float* dout,
                                             int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    const float x = inp[i];
    const TanhSech2 th = VecTanhSech2(kGeluScale * (x + 0.044715f * x * x * x));
    const float local_grad =
        0.5f * (1.0f + th.tanh) + 0.5f * x * th.sech2 * kGeluScale * (1.0f + 0.134145f * x * x);
    dinp[i] = local_grad * dout[i];
  }
}

void GeluForward(float* out, const float* inp, int64_t N) {
#pragma omp parallel
  {
    int64_t i0, i1;
    ThreadSlice(N, &i0, &i1);
    GeluForwardChunk(out + i0, inp + i0, i1 - i0);
  }
}

void GeluBackward(float* dinp, const float* inp, const float* dout, int64_t N) {
#pragma omp parallel
  {
    int64_t i0, i1;
    ThreadSlice(N, &i0, &i1);
    GeluBackwardChunk(dinp + i0, inp + i0, dout + i0, i1 - i0);
  }
}

void ResidualForward(float* out, const float* inp1, const float* inp2, int64_t N) {
#pragma omp parallel for simd
  for (int64_t i = 0; i < N; i++) out[i] = inp1[i] + inp2[i];
}

void TiedHeadForward(float* logits, const float* inp, const float* wte, int B, int T, int C,
                     int V) {
  // logits (BT, V) = inp (BT, C) @ wte (V, C)^T
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, B * T, V, C, 1.0f, inp, C, wte, C, 0.0f,
              logits, V);
}

void TiedHeadBackward(float* dinp, float* dwte, const float* dlogits, const float* inp,
                      const float* wte, int B, int T, int C, int V) {
  // dinp (BT, C) = dlogits (BT, V) @ wte (V, C)
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, B * T, C, V, 1.0f, dlogits, V, wte, C,
              0.0f, dinp, C);
  // dwte (V, C) += dlogits (BT, V)^T @ inp (BT, C)
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, V, C, B * T, 1.0f, dlogits, V, inp, C, 1.0f,
              dwte, C);
}

void CrossEntropyForward(float* losses, float* probs, const float* logits, const int32_t* targets,
                         int B, int T, int V) {
#pragma omp parallel for
  for (int64_t bt = 0; bt < int64_t{B} * T; bt++) {
    const float* z = logits + bt * V;  // (V,)
    float* p = probs + bt * V;         // (V,)
    float maxval = z[0];
#pragma omp simd reduction(max : maxval)
    for (int i = 1; i < V; i++) maxval = z[i] > maxval ? z[i] : maxval;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < V; i++) {
      p[i] = VecExp(z[i] - maxval);
      sum += p[i];
    }
    const float inv = 1.0f / sum;
    for (int i = 0; i < V; i++) p[i] *= inv;
    losses[bt] = std::log(sum) - (z[targets[bt]] - maxval);
  }
}

void CrossEntropyBackward(float* dlogits, const float* probs, const int32_t* targets, float dloss,
                          int B, int T, int V) {
#pragma omp parallel for
  for (int64_t bt = 0; bt < int64_t{B} * T; bt++) {
    float* dz = dlogits + bt * V;     // (V,)
    const float* p = probs + bt * V;  // (V,)
    for (int i = 0; i < V; i++) dz[i] = p[i] * dloss;
    dz[targets[bt]] -= dloss;
  }
}

}  // namespace

const CpuLayerKernels& FastKernels() {
  static const CpuLayerKernels kKernels = [] {
    CpuLayerKernels k;
    k.name = "fast";
    k.encoder_forward = EncoderForward;
    k.encoder_backward = EncoderBackward;
    k.layernorm_forward = LayerNormForward;
    k.layernorm_backward = LayerNormBackward;
    k.matmul_forward = MatmulForward;
    k.matmul_backward = MatmulBackward;
    k.attention_forward = AttentionForward;
    k.attention_backward = AttentionBackward;
    k.gelu_forward = GeluForward;
    k.gelu_backward = GeluBackward;
    k.residual_forward = ResidualForward;
    k.tied_head_forward = TiedHeadForward;
    k.tied_head_backward = TiedHeadBackward;
    k.crossentropy_forward = CrossEntropyForward;
    k.crossentropy_backward = CrossEntropyBackward;
    return k;
  }();
  return kKernels;
}

}  // namespace offload
