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
 * throughout); the summation order and the element-wise exps (vmath.h, a few ulp) may differ. The
 * tail is stored bf16 as the pool holds it.
 */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "ds_abi.h"
#include "bf16.h"
#include "vmath.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* The element-wise exps of a token (conv silu, the gate and its decay, beta, the output gate) by
 * vmath.h's ds_exp / ds_sigmoid / ds_softplus in vector loops: as scalar libm calls (~770 a head) they
 * cost more than the state update with the state in cache. Silu as the prefill's conv (kda_chunk.c)
 * computes it; the sigmoids as ds_kda_gate_sigmoid and ds_gated_rms_norm (small_ops.c) do. */
static inline float silu_v(float y) { return y / (1.f + ds_exp(-y)); }

/* Conv over `n` channels starting at channel c0 of the 3P-wide tail row; writes fp32 y. With AVX-512,
 * 16 channels a step (the weights [3P, W] gathered), the same products and sums in the same order. */
static void conv_step(const uint16_t *x, uint16_t *tail, const float *cw, int W, int C3, int c0,
                      int n, float *y) {
    int i = 0;
#ifdef __AVX512F__
    const __m512i lane = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(W));
    const int gathers = (int64_t)C3 * W < INT32_MAX;   /* the weight indices fit the gather's int32 */
    for (; gathers && i + 16 <= n; i += 16) {
        const int c = c0 + i;
        const __m512i at = _mm512_add_epi32(lane, _mm512_set1_epi32(c * W));
        __m512 acc = _mm512_setzero_ps();
        for (int w = 0; w < W - 1; ++w) {
            const __m256i t = _mm256_loadu_si256((const __m256i *)(tail + (int64_t)w * C3 + c));
            const __m512 wt = _mm512_i32gather_ps(_mm512_add_epi32(at, _mm512_set1_epi32(w)), cw, 4);
            acc = _mm512_add_ps(acc, _mm512_mul_ps(bf16_to_f32_x16(t), wt));
        }
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + i));
        const __m512 wl = _mm512_i32gather_ps(_mm512_add_epi32(at, _mm512_set1_epi32(W - 1)), cw, 4);
        _mm512_storeu_ps(y + i, _mm512_add_ps(acc, _mm512_mul_ps(bf16_to_f32_x16(xv), wl)));
        for (int w = 0; w < W - 2; ++w)
            _mm256_storeu_si256((__m256i *)(tail + (int64_t)w * C3 + c),
                                _mm256_loadu_si256((const __m256i *)(tail + (int64_t)(w + 1) * C3 + c)));
        if (W >= 2) _mm256_storeu_si256((__m256i *)(tail + (int64_t)(W - 2) * C3 + c), xv);
    }
    #pragma omp simd
    for (int j = 0; j < i; ++j) y[j] = silu_v(y[j]);
#endif
    for (; i < n; ++i) {
        const int c = c0 + i;
        float acc = 0.f;
        for (int w = 0; w < W - 1; ++w) acc += bf16_to_f32(tail[(int64_t)w * C3 + c]) * cw[(int64_t)c * W + w];
        acc += bf16_to_f32(x[i]) * cw[(int64_t)c * W + W - 1];
        y[i] = silu_v(acc);
        for (int w = 0; w < W - 2; ++w) tail[(int64_t)w * C3 + c] = tail[(int64_t)(w + 1) * C3 + c];
        if (W >= 2) tail[(int64_t)(W - 2) * C3 + c] = x[i];
    }
}

/* Prefetch (into L2) the conv tail lines of head channels [c0, c0 + n) of the q, k and v blocks (P apart). */
static inline void prefetch_tail(const uint16_t *tail, int W, int C3, int64_t c0, int64_t P, int n) {
#ifdef __AVX512F__
    for (int w = 0; w < W - 1; ++w)
        for (int part = 0; part < 3; ++part)
            for (int c = 0; c < n; c += 32)
                _mm_prefetch((const char *)(tail + (int64_t)w * C3 + part * P + c0 + c), _MM_HINT_T1);
#else
    (void)tail, (void)W, (void)C3, (void)c0, (void)P, (void)n;
#endif
}

/* The delta-rule update of one head's state S [K, K] fp32 in place, and o = S'^T q:
 *   S <- diag(d) S;  kv = S^T k;  delta = beta (v - kv);  S <- S + k delta^T;  o = S^T q
 * (v is overwritten with delta), row by row in two passes, each product and sum rounded on its own
 * (no fused multiply-adds: the build is ISO C, fp-contract off). With AVX-512 and K a multiple of 16
 * up to 128 the K-wide sums kv and o stay in registers (they went through memory: two stores a
 * vector where one is needed), and the first pass prefetches `next` (the state the thread updates
 * next, or NULL) into L2 a row at a time. The same operations in the same order either way: the
 * results are bit-identical. Measured with conv_step's 16-wide path (H = 8, K = 128, states from DRAM, AMD EPYC
 * Zen 4, 2 threads): 1.35x a layer at batch 1, 1.3-1.5x at 32. */
static void state_update(float *S, int K, const float *q, const float *k, float *v, const float *d, float beta,
                         const float *next, float *o) {
#ifdef __AVX512F__
    if (K % 16 == 0 && K <= 128) {
        const int V = K / 16;
        __m512 acc[8], delta[8];
        for (int c = 0; c < V; ++c) acc[c] = _mm512_setzero_ps();
        for (int i = 0; i < K; ++i) {
            const __m512 di = _mm512_set1_ps(d[i]), ki = _mm512_set1_ps(k[i]);
            float *Si = S + (int64_t)i * K;
            if (next)
                for (int c = 0; c < V; ++c) _mm_prefetch((const char *)(next + (int64_t)i * K + 16 * c), _MM_HINT_T1);
            for (int c = 0; c < V; ++c) {
                const __m512 sv = _mm512_mul_ps(_mm512_loadu_ps(Si + 16 * c), di);
                _mm512_storeu_ps(Si + 16 * c, sv);
                acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(ki, sv));
            }
        }
        const __m512 bv = _mm512_set1_ps(beta);
        for (int c = 0; c < V; ++c) {
            delta[c] = _mm512_mul_ps(bv, _mm512_sub_ps(_mm512_loadu_ps(v + 16 * c), acc[c]));
            _mm512_storeu_ps(v + 16 * c, delta[c]);
            acc[c] = _mm512_setzero_ps();
        }
        for (int i = 0; i < K; ++i) {
            const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
            float *Si = S + (int64_t)i * K;
            for (int c = 0; c < V; ++c) {
                const __m512 sv = _mm512_add_ps(_mm512_loadu_ps(Si + 16 * c), _mm512_mul_ps(ki, delta[c]));
                _mm512_storeu_ps(Si + 16 * c, sv);
                acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(qi, sv));
            }
        }
        for (int c = 0; c < V; ++c) _mm512_storeu_ps(o + 16 * c, acc[c]);
        return;
    }
#endif
    (void)next;
    float *kv = o;   /* o doubles as S^T k before the update */
    for (int j = 0; j < K; ++j) kv[j] = 0.f;
    for (int i = 0; i < K; ++i) {
        float *Si = S + (int64_t)i * K;
        for (int j = 0; j < K; ++j) { Si[j] *= d[i]; kv[j] += k[i] * Si[j]; }
    }
    for (int j = 0; j < K; ++j) v[j] = beta * (v[j] - kv[j]);
    for (int j = 0; j < K; ++j) o[j] = 0.f;
    for (int i = 0; i < K; ++i) {
        float *Si = S + (int64_t)i * K;
        for (int j = 0; j < K; ++j) { Si[j] += k[i] * v[j]; o[j] += q[i] * Si[j]; }
    }
}

static void l2norm(float *v, int n) {
    float s = 0.f;
    for (int i = 0; i < n; ++i) s += v[i] * v[i];
    const float r = 1.f / sqrtf(s + 1e-6f);
    for (int i = 0; i < n; ++i) v[i] *= r;
}

/* Row b's head h: its conv step, gate, delta-rule update and gated norm (`next`: the state the thread
 * updates after this one, prefetched, or NULL). Returns 0, -1 allocation. */
static int kda_item(int b, int h, int H, int K, int W, const uint16_t *xq, const uint16_t *xk, const uint16_t *xv,
                    const float *conv_w, uint16_t *tails, float *states, const int64_t *slots, const uint16_t *f,
                    const float *a_log, const float *dt_bias, int gate_kind, float lower_bound,
                    const uint16_t *b_logit, const uint16_t *gate, const float *norm_w, float eps, float scale,
                    uint16_t *out, const float *next) {
    const int P = H * K, C3 = 3 * P;
    float *q = malloc(sizeof(float) * (size_t)K * 5);
    if (!q) return -1;
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
    for (int i = 0; i < K; ++i) g[i] = bf16_to_f32(f[row + i]) + dt_bias[h * K + i];
    if (gate_kind == DS_GATE_SIGMOID) {
        #pragma omp simd
        for (int i = 0; i < K; ++i) g[i] = ds_exp(lower_bound * ds_sigmoid(a * g[i]));   /* the decay d */
    } else {
        #pragma omp simd
        for (int i = 0; i < K; ++i) g[i] = ds_exp(-a * ds_softplus(g[i]));
    }
    const float beta = ds_sigmoid(bf16_to_f32(b_logit[(int64_t)b * H + h]));
    state_update(S, K, q, k, v, g, beta, next, o);
    float ms = 0.f;
    for (int j = 0; j < K; ++j) { o[j] *= scale; ms += o[j] * o[j]; }
    const float r = 1.f / sqrtf(ms / (float)K + eps);
    float *y = g;   /* the decay is spent: the output's fp32 values */
    #pragma omp simd
    for (int j = 0; j < K; ++j) y[j] = o[j] * r * norm_w[j] * ds_sigmoid(bf16_to_f32(gate[row + j]));
    for (int j = 0; j < K; ++j) out[row + j] = f32_to_bf16(y[j]);
    free(q);
    return 0;
}

/* One token per row b, on slot slots[b]. Rows that share a slot must be adjacent (a speculative
 * verify's consecutive tokens of one sequence, engine/spec): they are applied in row order, each
 * reading the state its predecessor left, so such a run of rows equals that many decode steps. With
 * such a run the threads split the heads (rows in order within a head), else the (row, head) items. */
int ds_kda_decode(int B, int H, int K, int W, const uint16_t *xq, const uint16_t *xk,
                  const uint16_t *xv, const float *conv_w, uint16_t *tails, float *states,
                  const int64_t *slots, const uint16_t *f, const float *a_log, const float *dt_bias,
                  int gate_kind, float lower_bound, const uint16_t *b_logit, const uint16_t *gate,
                  const float *norm_w, float eps, float scale, uint16_t *out, int nthreads) {
    const int P = H * K, C3 = 3 * P;
    int bad = 0, chained = 0;
    for (int b = 1; b < B; ++b) chained |= slots[b] == slots[b - 1];
    if (chained) {
        #pragma omp parallel for num_threads(nthreads) schedule(static) reduction(| : bad)
        for (int h = 0; h < H; ++h)
            for (int b = 0; b < B; ++b)
                bad |= kda_item(b, h, H, K, W, xq, xk, xv, conv_w, tails, states, slots, f, a_log, dt_bias, gate_kind,
                                lower_bound, b_logit, gate, norm_w, eps, scale, out, NULL) != 0;
        return bad ? -1 : 0;
    }
    #pragma omp parallel for num_threads(nthreads) schedule(static) reduction(| : bad)
    for (int t = 0; t < B * H; ++t) {
        const float *next = NULL;   /* the next item's state, and its conv tail lines now: both come from memory */
        if (t + 1 < B * H) {
            const int64_t nb = slots[(t + 1) / H], nh = (t + 1) % H;
            next = states + (nb * H + nh) * (int64_t)K * K;
            prefetch_tail(tails + nb * (int64_t)(W - 1) * C3, W, C3, nh * K, P, K);
        }
        bad |= kda_item(t / H, t % H, H, K, W, xq, xk, xv, conv_w, tails, states, slots, f, a_log, dt_bias, gate_kind,
                        lower_bound, b_logit, gate, norm_w, eps, scale, out, next) != 0;
    }
    return bad ? -1 : 0;
}
