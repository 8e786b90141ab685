/* deltaserve CPU kernel: one KDA decode token per sequence for one layer (spec/model.md §6),
 * updating the conv tails and recurrent states of the engine's slot pool IN PLACE.
 *
 * Per sequence b and head h, with P = H*K channels per q/k/v block and the state S [K, V] fp32:
 *   y_c = silu(sum_w tail[w][c] * cw[c][w] + x_c * cw[c][W-1])   (tail shifts left, x appended)
 *   q, k = l2norm(y_q), l2norm(y_k) (eps 1e-6 inside the sqrt);  v = y_v
 *   g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias))  or  -exp(A_log[h]) * softplus(f + dt_bias)
 *   beta = sigmoid(b);  S <- diag(exp(g)) S;  S <- S + beta k (v - S^T k)^T;  o = scale S^T q
 *   out = bf16(o * rsqrt(mean(o^2) + eps) * w_norm * sigmoid(gate))
 * Same math and rounding points as the PyTorch path in ops.kda / model.kda_layer (fp32
 * throughout); the summation order may differ. The tail is stored bf16 as the pool holds it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "ds_abi.h"
#include "bf16.h"

static inline float sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }

/* Conv over `n` channels starting at channel c0 of the 3P-wide tail row; writes fp32 y. */
static void conv_step(const uint16_t *x, uint16_t *tail, const float *cw, int W, int C3, int c0,
                      int n, float *y) {
    for (int i = 0; i < n; ++i) {
        const int c = c0 + i;
        float acc = 0.f;
        for (int w = 0; w < W - 1; ++w) acc += bf16_to_f32(tail[(int64_t)w * C3 + c]) * cw[(int64_t)c * W + w];
        acc += bf16_to_f32(x[i]) * cw[(int64_t)c * W + W - 1];
        y[i] = acc / (1.f + expf(-acc));
        for (int w = 0; w < W - 2; ++w) tail[(int64_t)w * C3 + c] = tail[(int64_t)(w + 1) * C3 + c];
        if (W >= 2) tail[(int64_t)(W - 2) * C3 + c] = x[i];
    }
}

static void l2norm(float *v, int n) {
    float s = 0.f;
    for (int i = 0; i < n; ++i) s += v[i] * v[i];
    const float r = 1.f / sqrtf(s + 1e-6f);
    for (int i = 0; i < n; ++i) v[i] *= r;
}

int ds_kda_decode(int B, int H, int K, int W, const uint16_t *xq, const uint16_t *xk,
                  const uint16_t *xv, const float *conv_w, uint16_t *tails, float *states,
                  const int64_t *slots, const uint16_t *f, const float *a_log, const float *dt_bias,
                  int gate_kind, float lower_bound, const uint16_t *b_logit, const uint16_t *gate,
                  const float *norm_w, float eps, float scale, uint16_t *out, int nthreads) {
    const int P = H * K, C3 = 3 * P;
    int bad = 0;
    #pragma omp parallel for num_threads(nthreads) schedule(static) reduction(| : bad)
    for (int t = 0; t < B * H; ++t) {
        const int b = t / H, h = t % H;
        float *q = malloc(sizeof(float) * (size_t)K * 5);
        if (!q) { bad |= 1; continue; }
        float *k = q + K, *v = k + K, *g = v + K, *o = g + K;
        uint16_t *tail = tails + slots[b] * (int64_t)(W - 1) * C3;
        float *S = states + (slots[b] * (int64_t)H + h) * (int64_t)K * K;
        const int64_t row = (int64_t)b * P + (int64_t)h * K;
        conv_step(xq + row, tail, conv_w, W, C3, h * K, K, q);
        conv_step(xk + row, tail, conv_w, W, C3, P + h * K, K, k);
        conv_step(xv + row, tail, conv_w, W, C3, 2 * P + h * K, K, v);
        l2norm(q, K);
        l2norm(k, K);
        const float a = expf(a_log[h]);
        for (int i = 0; i < K; ++i) {
            const float z = bf16_to_f32(f[row + i]) + dt_bias[h * K + i];
            if (gate_kind == DS_GATE_SIGMOID) {
                g[i] = lower_bound * sigmoidf(a * z);
            } else {
                const float sp = z > 20.f ? z : log1pf(expf(z));
                g[i] = -a * sp;
            }
        }
        const float beta = sigmoidf(bf16_to_f32(b_logit[(int64_t)b * H + h]));
        float *kv = o;                                   /* o doubles as S^T k before the update */
        for (int j = 0; j < K; ++j) kv[j] = 0.f;
        for (int i = 0; i < K; ++i) {
            const float d = expf(g[i]);
            float *Si = S + (int64_t)i * K;
            for (int j = 0; j < K; ++j) { Si[j] *= d; kv[j] += k[i] * Si[j]; }
        }
        for (int j = 0; j < K; ++j) v[j] = beta * (v[j] - kv[j]);   /* v becomes delta */
        for (int j = 0; j < K; ++j) o[j] = 0.f;
        for (int i = 0; i < K; ++i) {
            float *Si = S + (int64_t)i * K;
            for (int j = 0; j < K; ++j) { Si[j] += k[i] * v[j]; o[j] += q[i] * Si[j]; }
        }
        float ms = 0.f;
        for (int j = 0; j < K; ++j) { o[j] *= scale; ms += o[j] * o[j]; }
        const float r = 1.f / sqrtf(ms / (float)K + eps);
        for (int j = 0; j < K; ++j)
            out[row + j] = f32_to_bf16(o[j] * r * norm_w[j] * sigmoidf(bf16_to_f32(gate[row + j])));
        free(q);
    }
    return bad ? -1 : 0;
}
