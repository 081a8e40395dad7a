// Plain loops after llm.c's train_gpt2.c, adapted to (in, out) weights. Two deliberate
// differences from a literal port, both so this stays an honest baseline: llm.c builds with
// -Ofast, which lets the compiler vectorise float reductions; we build without fast-math, so the
// dot-product loops say `omp simd reduction` to grant the same reassociation for that loop only.
// And the attention softmax backward uses the O(T) form of the Jacobian product instead of
// llm.c's O(T^2) double loop. One difference is left in the fast set's favour: GELU calls libm's
// scalar tanhf/coshf, where an -Ofast build could use glibc's vector variants; it is ~18% of a
// naive step at the benchmark's size.
#include "gpu_trainer/model/layers_naive.h"

#include <cmath>
#include <cstdint>

#include "gpu_trainer/model/layer_kernels.h"

namespace offload {
namespace {

constexpr float kLayerNormEps = 1e-5f;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)

void EncoderForward(float* out, const int32_t* inp, const float* wte, const float* wpe, int B,
                    int T, int C) {
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < T; t++) {
      float* out_bt = out + (int64_t{b} * T + t) * C;  // (C,)
      const int64_t ix = inp[b * T + t];
      const float* wte_ix = wte + ix * C;         // (C,)
      const float* wpe_t = wpe + int64_t{t} * C;  // (C,)
      for (int i = 0; i < C; i++) out_bt[i] = wte_ix[i] + wpe_t[i];
    }
  }
}

// Serial: positions holding the same token add into the same row of dwte.
void EncoderBackward(float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B, int T,
                     int C) {
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < T; t++) {
      const float* dout_bt = dout + (int64_t{b} * T + t) * C;  // (C,)
      const int64_t ix = inp[b * T + t];
      float* dwte_ix = dwte + ix * C;         // (C,)
      float* dwpe_t = dwpe + int64_t{t} * C;  // (C,)
      for (int i = 0; i < C; i++) {
        dwte_ix[i] += dout_bt[i];
        dwpe_t[i] += dout_bt[i];
      }
    }
  }
}

void LayerNormForward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                      const float* bias, int B, int T, int C) {
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < T; t++) {
      const float* x = inp + (int64_t{b} * T + t) * C;  // (C,)
      float m = 0.0f;
#pragma omp simd reduction(+ : m)
      for (int i = 0; i < C; i++) m += x[i];
      m = m / C;
      float v = 0.0f;
#pragma omp simd reduction(+ : v)
      for (int i = 0; i < C; i++) {
        const float xshift = x[i] - m;
        v += xshift * xshift;
      }
      v = v / C;
      const float s = 1.0f / std::sqrt(v + kLayerNormEps);
      float* out_bt = out + (int64_t{b} * T + t) * C;  // (C,)
      for (int i = 0; i < C; i++) out_bt[i] = (s * (x[i] - m)) * weight[i] + bias[i];
      mean[b * T + t] = m;
      rstd[b * T + t] = s;
    }
  }
}

// Serial, as in llm.c: every row adds into dweight and dbias.
void LayerNormBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                       const float* inp, const float* weight, const float* mean, const float* rstd,
                       int B, int T, int C) {
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < T; t++) {
      const float* dout_bt = dout + (int64_t{b} * T + t) * C;  // (C,)
      const float* inp_bt = inp + (int64_t{b} * T + t) * C;    // (C,)
      float* dinp_bt = dinp + (int64_t{b} * T + t) * C;        // (C,)
      const float mean_bt = mean[b * T + t];
      const float rstd_bt = rstd[b * T + t];
      // The two reductions of the LayerNorm Jacobian: mean(dnorm) and mean(dnorm * norm).
      float dnorm_mean = 0.0f;
      float dnorm_norm_mean = 0.0f;
#pragma omp simd reduction(+ : dnorm_mean, dnorm_norm_mean)
      for (int i = 0; i < C; i++) {
        const float norm_bti = (inp_bt[i] - mean_bt) * rstd_bt;
        const float dnorm_i = weight[i] * dout_bt[i];
        dnorm_mean += dnorm_i;
        dnorm_norm_mean += dnorm_i * norm_bti;
      }
      dnorm_mean = dnorm_mean / C;
      dnorm_norm_mean = dnorm_norm_mean / C;
      for (int i = 0; i < C; i++) {
        const float norm_bti = (inp_bt[i] - mean_bt) * rstd_bt;
        const float dnorm_i = weight[i] * dout_bt[i];
        dbias[i] += dout_bt[i];
        dweight[i] += norm_bti * dout_bt[i];
        dinp_bt[i] += (dnorm_i - dnorm_mean - norm_bti * dnorm_norm_mean) * rstd_bt;
      }
    }
  }
}

void MatmulForward(float* out, const float* inp, const float* weight, const float* bias, int B,
                   int T, int C, int OC) {
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < T; t++) {
      float* out_bt = out + (int64_t{b} * T + t) * OC;       // (OC,)
      const float* inp_bt = inp + (int64_t{b} * T + t) * C;  // (C,)
      for (int o = 0; o < OC; o++) out_bt[o] = bias != nullptr ? bias[o] : 0.0f;
      // Row by row of the (in, out) weight, so the inner loop is a contiguous axpy.
      for (int i = 0; i < C; i++) {
        const float x = inp_bt[i];
        const float* w_i = weight + int64_t{i} * OC;  // (OC,)
        for (int o = 0; o < OC; o++) out_bt[o] += x * w_i[o];
      }
    }
  }
}

void MatmulBackward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                    const float* weight, int B, int T, int C, int OC) {
  // dinp = dout @ weight^T: rows are independent.
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < T; t++) {
      const float* dout_bt = dout + (int64_t{b} * T + t) * OC;  // (OC,)
      float* dinp_bt = dinp + (int64_t{b} * T + t) * C;         // (C,)
      for (int i = 0; i < C; i++) {
        const float* w_i = weight + int64_t{i} * OC;  // (OC,)
        float d = 0.0f;
#pragma omp simd reduction(+ : d)
        for (int o = 0; o < OC; o++) d += w_i[o] * dout_bt[o];
        dinp_bt[i] = d;
      }
    }
  }
  // dweight = inp^T @ dout: each thread owns whole rows of dweight.
#pragma omp parallel for
  for (int i = 0; i < C; i++) {
    float* dw_i = dweight + int64_t{i} * OC;  // (OC,)
    for (int b = 0; b < B; b++) {
      for (int t = 0; t < T; t++) {
        const float* dout_bt = dout + (int64_t{b} * T + t) * OC;  // (OC,)
        const float x = inp[(int64_t{b} * T + t) * C + i];
        for (int o = 0; o < OC; o++) dw_i[o] += x * dout_bt[o];
      }
    }
  }
  if (dbias != nullptr) {
    for (int b = 0; b < B; b++) {
      for (int t = 0; t < T; t++) {
        const float* dout_bt = dout + (int64_t{b} * T + t) * OC;  // (OC,)
        for (int o = 0; o < OC; o++) dbias[o] += dout_bt[o];
      }
    }
  }
}

void AttentionForward(float* out, float* preatt, float* att, const float* qkv, int B, int T, int C,
                      int NH) {
  const int C3 = C * 3;
  const int hs = C / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
#pragma omp parallel for collapse(3)
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < T; t++) {
      for (int h = 0; h < NH; h++) {
        const float* query_t = qkv + (int64_t{b} * T + t) * C3 + h * hs;  // (hs,)
        const int64_t row = ((int64_t{b} * NH + h) * T + t) * T;
        float* preatt_bth = preatt + row;  // (T,)
        float* att_bth = att + row;        // (T,)

        // Pass 1: scaled scores against keys 0..t and their max, for a stable softmax.
        float maxval = -INFINITY;
        for (int t2 = 0; t2 <= t; t2++) {
          const float* key_t2 = qkv + (int64_t{b} * T + t2) * C3 + h * hs + C;  // (hs,)
          float val = 0.0f;
#pragma omp simd reduction(+ : val)
          for (int i = 0; i < hs; i++) val += query_t[i] * key_t2[i];
          val *= scale;
          if (val > maxval) maxval = val;
          preatt_bth[t2] = val;
        }
        // Pass 2: softmax over 0..t; zero above the diagonal is the causal mask.
        float expsum = 0.0f;
        for (int t2 = 0; t2 <= t; t2++) {
          const float expv = std::exp(preatt_bth[t2] - maxval);
          expsum += expv;
          att_bth[t2] = expv;
        }
        const float expsum_inv = 1.0f / expsum;
        for (int t2 = 0; t2 < T; t2++) att_bth[t2] = t2 <= t ? att_bth[t2] * expsum_inv : 0.0f;

        // Pass 3: weighted sum of the values.
        float* out_bth = out + (int64_t{b} * T + t) * C + h * hs;  // (hs,)
        for (int i = 0; i < hs; i++) out_bth[i] = 0.0f;
        for (int t2 = 0; t2 <= t; t2++) {
          const float* value_t2 = qkv + (int64_t{b} * T + t2) * C3 + h * hs + 2 * C;  // (hs,)
          const float a = att_bth[t2];
          for (int i = 0; i < hs; i++) out_bth[i] += a * value_t2[i];
        }
      }
    }
  }
}

void AttentionBackward(float* dqkv, float* dpreatt, float* datt, const float* dout,
                       const float* qkv, const float* att, int B, int T, int C, int NH) {
  const int C3 = C * 3;
  const int hs = C / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  // Parallel over (b, h) only: every position t adds into the keys and values of 0..t.
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < NH; h++) {
      for (int t = 0; t < T; t++) {
        float* dqkv_bth = dqkv + (int64_t{b} * T + t) * C3 + h * hs;  // this head's q, k, v grads
        for (int i = 0; i < hs; i++) dqkv_bth[i] = dqkv_bth[i + C] = dqkv_bth[i + 2 * C] = 0.0f;
      }
      for (int t = 0; t < T; t++) {
        const int64_t row = ((int64_t{b} * NH + h) * T + t) * T;
        const float* att_bth = att + row;                                  // (T,)
        float* datt_bth = datt + row;                                      // (T,)
        float* dpreatt_bth = dpreatt + row;                                // (T,)
        const float* query_t = qkv + (int64_t{b} * T + t) * C3 + h * hs;   // (hs,)
        float* dquery_t = dqkv + (int64_t{b} * T + t) * C3 + h * hs;       // (hs,)
        const float* dout_bth = dout + (int64_t{b} * T + t) * C + h * hs;  // (hs,)

        // Through the weighted sum of values.
        for (int t2 = 0; t2 <= t; t2++) {
          const float* value_t2 = qkv + (int64_t{b} * T + t2) * C3 + h * hs + 2 * C;  // (hs,)
          float* dvalue_t2 = dqkv + (int64_t{b} * T + t2) * C3 + h * hs + 2 * C;      // (hs,)
          float d = 0.0f;
#pragma omp simd reduction(+ : d)
          for (int i = 0; i < hs; i++) d += value_t2[i] * dout_bth[i];
          datt_bth[t2] = d;
          for (int i = 0; i < hs; i++) dvalue_t2[i] += att_bth[t2] * dout_bth[i];
        }
        // Through the softmax: dpreatt = att * (datt - sum(att * datt)).
        float dot = 0.0f;
        for (int t2 = 0; t2 <= t; t2++) dot += att_bth[t2] * datt_bth[t2];
        for (int t2 = 0; t2 <= t; t2++) dpreatt_bth[t2] = att_bth[t2] * (datt_bth[t2] - dot);

        // Through the scaled scores q . k.
        for (int t2 = 0; t2 <= t; t2++) {
          const float* key_t2 = qkv + (int64_t{b} * T + t2) * C3 + h * hs + C;  // (hs,)
          float* dkey_t2 = dqkv + (int64_t{b} * T + t2) * C3 + h * hs + C;      // (hs,)
          const float d = dpreatt_bth[t2] * scale;
          for (int i = 0; i < hs; i++) {
            dquery_t[i] += key_t2[i] * d;
            dkey_t2[i] += query_t[i] * d;
          }
        }
      }
    }
  }
}

void GeluForward(float* out, const float* inp, int64_t N) {
#pragma omp parallel for
  for (int64_t i = 0; i < N; i++) {
    const float x = inp[i];
    const float cube = 0.044715f * x * x * x;
    out[i] = 0.5f * x * (1.0f + std::tanh(kGeluScale * (x + cube)));
  }
}

void GeluBackward(float* dinp, const float* inp, const float* dout, int64_t N) {
#pragma omp parallel for
  for (int64_t i = 0; i < N; i++) {
    const float x = inp[i];
    const float cube = 0.044715f * x * x * x;
    const float tanh_arg = kGeluScale * (x + cube);
    const float tanh_out = std::tanh(tanh_arg);
    const float cosh_out = std::cosh(tanh_arg);
    const float sech_out = 1.0f / (cosh_out * cosh_out);
    const float local_grad = 0.5f * (1.0f + tanh_out) +
                             x * 0.5f * sech_out * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] = local_grad * dout[i];
  }
}

void ResidualForward(float* out, const float* inp1, const float* inp2, int64_t N) {
#pragma omp parallel for
  for (int64_t i = 0; i < N; i++) out[i] = inp1[i] + inp2[i];
}

void TiedHeadForward(float* logits, const float* inp, const float* wte, int B, int T, int C,
                     int V) {
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < T; t++) {
      const float* inp_bt = inp + (int64_t{b} * T + t) * C;  // (C,)
      float* logits_bt = logits + (int64_t{b} * T + t) * V;  // (V,)
      for (int v = 0; v < V; v++) {
        const float* wte_v = wte + int64_t{v} * C;  // (C,)
        float val = 0.0f;
#pragma omp simd reduction(+ : val)
        for (int i = 0; i < C; i++) val += inp_bt[i] * wte_v[i];
        logits_bt[v] = val;
      }
    }
  }
}

void TiedHeadBackward(float* dinp, float* dwte, const float* dlogits, const float* inp,
                      const float* wte, int B, int T, int C, int V) {
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < T; t++) {
      const float* dlogits_bt = dlogits + (int64_t{b} * T + t) * V;  // (V,)
      float* dinp_bt = dinp + (int64_t{b} * T + t) * C;              // (C,)
      for (int i = 0; i < C; i++) dinp_bt[i] = 0.0f;
      for (int v = 0; v < V; v++) {
        const float* wte_v = wte + int64_t{v} * C;  // (C,)
        const float d = dlogits_bt[v];
        for (int i = 0; i < C; i++) dinp_bt[i] += wte_v[i] * d;
      }
    }
  }
#pragma omp parallel for
  for (int v = 0; v < V; v++) {
    float* dwte_v = dwte + int64_t{v} * C;  // (C,)
    for (int b = 0; b < B; b++) {
      for (int t = 0; t < T; t++) {
        const float* inp_bt = inp + (int64_t{b} * T + t) * C;  // (C,)
        const float d = dlogits[(int64_t{b} * T + t) * V + v];
        for (int i = 0; i < C; i++) dwte_v[i] += inp_bt[i] * d;
      }
    }
  }
}

void CrossEntropyForward(float* losses, float* probs, const float* logits, const int32_t* targets,
                         int B, int T, int V) {
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < T; t++) {
      const float* logits_bt = logits + (int64_t{b} * T + t) * V;  // (V,)
      float* probs_bt = probs + (int64_t{b} * T + t) * V;          // (V,)
      float maxval = -INFINITY;
      for (int i = 0; i < V; i++) maxval = logits_bt[i] > maxval ? logits_bt[i] : maxval;
      float sum = 0.0f;
      for (int i = 0; i < V; i++) {
        probs_bt[i] = std::exp(logits_bt[i] - maxval);
        sum += probs_bt[i];
      }
      for (int i = 0; i < V; i++) probs_bt[i] /= sum;
      // log-sum-exp rather than -log(prob): finite even when the target's prob underflows.
      losses[b * T + t] = std::log(sum) - (logits_bt[targets[b * T + t]] - maxval);
    }
  }
}

void CrossEntropyBackward(float* dlogits, const float* probs, const int32_t* targets, float dloss,
                          int B, int T, int V) {
#pragma omp parallel for collapse(2)
  for (int b = 0; b < B; b++) {
    for (int t = 0; t < T; t++) {
      float* dlogits_bt = dlogits + (int64_t{b} * T + t) * V;    // (V,)
      const float* probs_bt = probs + (int64_t{b} * T + t) * V;  // (V,)
      const int ix = targets[b * T + t];
      for (int i = 0; i < V; i++) {
        const float indicator = i == ix ? 1.0f : 0.0f;
        dlogits_bt[i] = (probs_bt[i] - indicator) * dloss;
      }
    }
  }
}

}  // namespace

const CpuLayerKernels& NaiveKernels() {
  static const CpuLayerKernels kKernels = [] {
    CpuLayerKernels k;
    k.name = "naive";
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
