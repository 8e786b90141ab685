/* deltaserve CPU kernels: the per-token elementwise/reduction ops of a decoder layer, fused so a
 * decode step pays one call instead of a dozen tensor ops (spec/model.md §3, §5).
 * Same formulas and rounding points as ops.norms.rms_norm and ops.attn_res.attn_res_mix (fp32
 * math on bf16 inputs, bf16 results); reductions run in a different order.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include "ds_abi.h"
#include "bf16.h"
#include "vmath.h"

#define LANES 16   /* independent partial sums: lets the compiler vectorise the reductions */

/* (sum_d v[d] * q[d], sum_d v[d]^2) of a bf16 row v, in LANES interleaved partial sums. */
static inline void dot_and_square(const uint16_t *v, const float *q, int n, float *dot, float *sq) {
    float pd[LANES] = {0}, ps[LANES] = {0};
    int d = 0;
#ifdef __AVX512F__
    __m512 vd = _mm512_setzero_ps(), vs = _mm512_setzero_ps();
    for (; d + LANES <= n; d += LANES) {
        const __m512 x = bf16_to_f32_x16(_mm256_loadu_si256((const __m256i *)(v + d)));
        vs = _mm512_fmadd_ps(x, x, vs);
        if (q) vd = _mm512_fmadd_ps(x, _mm512_loadu_ps(q + d), vd);
    }
    _mm512_storeu_ps(pd, vd);
    _mm512_storeu_ps(ps, vs);
#else
    for (; d + LANES <= n; d += LANES)
        for (int l = 0; l < LANES; ++l) {
            const float x = bf16_to_f32(v[d + l]);
            ps[l] += x * x;
            if (q) pd[l] += x * q[d + l];
        }
#endif
    float sd = 0.f, ss = 0.f;
    for (int l = 0; l < LANES; ++l) { sd += pd[l]; ss += ps[l]; }
    for (; d < n; ++d) {
        const float x = bf16_to_f32(v[d]);
        ss += x * x;
        if (q) sd += x * q[d];
    }
    *dot = sd;
    *sq = ss;
}

/* KimiRMSNorm of one row: y = bf16(x * rsqrt(mean(x^2) + eps)); o = bf16(w * y), w fp32 [D]. */
static inline void norm_row(const uint16_t *xr, int D, const float *w, float eps, uint16_t *o) {
    float unused, ss;
    dot_and_square(xr, 0, D, &unused, &ss);
    const float r = 1.f / sqrtf(ss / (float)D + eps);
    for (int d = 0; d < D; ++d)
        o[d] = f32_to_bf16(w[d] * bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[d]) * r)));
}

/* x, out [N, D] with row strides ldx / ldo. */
void ds_rms_norm(const uint16_t *x, int64_t ldx, int N, int D, const float *w, float eps,
                 uint16_t *out, int64_t ldo, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if ((int64_t)N * D >= (1 << 15))
    for (int n = 0; n < N; ++n) norm_row(x + (int64_t)n * ldx, D, w, eps, out + (int64_t)n * ldo);
}

/* Row n of the Block AttnRes mix over S <= DS_MAX_MIX candidates xs[s] [N, D] bf16 (the current block sum
 * LAST): score_s = (x_s . q) * rsqrt(mean(x_s^2) + eps) with q = norm * proj (fp32), a = softmax_s,
 * o = bf16(sum_s a_s x_s), every column summed over s ascending. */
static inline void mix_row(const uint16_t *const *xs, int S, int64_t n, int D, const float *q, float eps,
                           uint16_t *o) {
    float score[DS_MAX_MIX], m = -INFINITY, sum = 0.f;
    for (int s = 0; s < S; ++s) {
        float dot, ss;
        dot_and_square(xs[s] + n * D, q, D, &dot, &ss);
        score[s] = dot * (1.f / sqrtf(ss / (float)D + eps));
        if (score[s] > m) m = score[s];
    }
    for (int s = 0; s < S; ++s) { score[s] = expf(score[s] - m); sum += score[s]; }
    for (int s = 0; s < S; ++s) score[s] /= sum;
    int d = 0;
#ifdef __AVX512F__
    for (; d + 16 <= D; d += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int s = 0; s < S; ++s)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(score[s]),
                                  bf16_to_f32_x16(_mm256_loadu_si256((const __m256i *)(xs[s] + n * D + d))), acc);
        _mm256_storeu_si256((__m256i *)(o + d), f32_to_bf16_x16(acc));
    }
#endif
    for (; d < D; ++d) {
        float acc = 0.f;
        for (int s = 0; s < S; ++s) acc = fmaf(score[s], bf16_to_f32(xs[s][n * D + d]), acc);
        o[d] = f32_to_bf16(acc);
    }
}

/* out [N, D] = the mix (mix_row; S <= DS_MAX_MIX); with norm_w, also normed [N, D] = KimiRMSNorm(out) with
 * norm_w fp32 [D] and norm_eps, exactly as ds_rms_norm computes it (the layer's next op, fused). */
void ds_attn_res_mix(const uint16_t *const *xs, int S, int N, int D, const float *q, float eps,
                     uint16_t *out, const float *norm_w, float norm_eps, uint16_t *normed, int nthreads) {
    const int s_cap = S < DS_MAX_MIX ? S : DS_MAX_MIX;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if ((int64_t)N * D * S >= (1 << 15))
    for (int n = 0; n < N; ++n) {
        uint16_t *o = out + (int64_t)n * D;
        mix_row(xs, s_cap, n, D, q, eps, o);
        if (norm_w) norm_row(o, D, norm_w, norm_eps, normed + (int64_t)n * D);
    }
}

/* K3's KDA decay over a prefill batch: g[n][h K + j] = lb * sigmoid(exp(a_log[h]) * (f + dt_bias[h K + j]))
 * with f bf16 [N, H K] (row stride ldf), g fp32 [N, H K] contiguous (ops.kda.kda_gate_sigmoid). */
void ds_kda_gate_sigmoid(const uint16_t *f, int64_t ldf, int N, int H, int K, const float *a_log,
                         const float *dt_bias, float lb, float *g, int nthreads) {
    const int64_t P = (int64_t)H * K;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if ((int64_t)N * P >= (1 << 15))
    for (int n = 0; n < N; ++n)
        for (int h = 0; h < H; ++h) {
            const float a = expf(a_log[h]);
            const uint16_t *fr = f + (int64_t)n * ldf + (int64_t)h * K;
            const float *dt = dt_bias + (int64_t)h * K;
            float *gr = g + n * P + (int64_t)h * K;
            #pragma omp simd
            for (int j = 0; j < K; ++j) gr[j] = lb * ds_sigmoid(a * (bf16_to_f32(fr[j]) + dt[j]));
        }
}

/* KDA output norm over [N, H] rows of K: out = bf16(o * rsqrt(mean(o^2) + eps) * w * sigmoid(gate)), o fp32
 * [N, H, K] contiguous, gate bf16 [N, H K] (row stride ldg), w fp32 [K] (ops.norms.gated_rms_norm). */
void ds_gated_rms_norm(const float *o, int N, int H, int K, const float *w, const uint16_t *gate, int64_t ldg,
                       float eps, uint16_t *out, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if ((int64_t)N * H * K >= (1 << 15))
    for (int64_t t = 0; t < (int64_t)N * H; ++t) {
        const int64_t n = t / H, h = t % H;
        const float *orow = o + t * K;
        const uint16_t *gr = gate + n * ldg + h * K;
        float ss = 0.f;
        #pragma omp simd reduction(+ : ss)
        for (int j = 0; j < K; ++j) ss += orow[j] * orow[j];
        const float r = 1.f / sqrtf(ss / (float)K + eps);
        uint16_t *dst = out + t * K;
        #pragma omp simd
        for (int j = 0; j < K; ++j) dst[j] = f32_to_bf16(orow[j] * r * w[j] * ds_sigmoid(bf16_to_f32(gr[j])));
    }
}

/* The index of the first largest value of one row of n floats, a NaN counting as the largest (the first
 * NaN wins): torch.argmax's choice. One pass for the maximum (and whether a NaN is there), one that stops
 * at the first element equal to it. */
static int64_t argmax_row(const float *x, int64_t n) {
    int64_t i = 0;
    float m = -INFINITY;
    int nan = 0;
#ifdef __AVX512F__
    __m512 mv = _mm512_set1_ps(-INFINITY);
    __mmask16 un = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        un |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mv = _mm512_max_ps(mv, v);
    }
    m = _mm512_reduce_max_ps(mv);
    nan = un != 0;
#endif
    for (; i < n; ++i) {
        nan |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    i = 0;
#ifdef __AVX512F__
    const __m512 target = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
#endif
    for (; i < n; ++i)
        if (nan ? x[i] != x[i] : x[i] == m) return i;
    return 0;   /* n == 0 */
}

/* out[r] = argmax_row(x + r * V, V) for r < N: the greedy token of each row of fp32 logits [N, V]. */
void ds_argmax_rows(const float *x, int64_t N, int64_t V, int64_t *out, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (N >= 4 && N * V >= (1 << 16))
    for (int64_t r = 0; r < N; ++r) out[r] = argmax_row(x + r * V, V);
}
