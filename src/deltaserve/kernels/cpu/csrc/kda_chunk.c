/* deltaserve CPU kernels: the chunked KDA prefill (WY/UT form, spec/model.md §6.3) and the
 * depthwise causal conv + SiLU (optionally with the per-head L2 norm of q and k) of one layer,
 * over packed varlen sequences. Same semantics as ops.kda.kda_chunked / causal_conv1d.
 *
 * Chunked KDA, per (sequence, head) with state S [K, V] fp32, for each chunk of Lc <= 64 tokens
 * (cut by the caller's chunk plan, so exported offsets always end a chunk), G_i = sum_{t<=i} g_t:
 *   A_qk[i,j] = scale q_i . (k_j exp(G_i - G_j)),  j <= i;   L[i,j] = beta_i k_i . (k_j exp(..)), j < i
 *   (I + L) [W | U] = beta [k exp(G) | v]     (unit lower-triangular forward substitution)
 *   Qg = scale q exp(G);  Kd = k exp(G_C - G);  delta = U - W S
 *   o = Qg S + A_qk delta;  S <- diag(exp(G_C)) S + Kd^T delta
 * Decay factors are never ratios or exps of differences of cumulative sums: a pair (i > j) is
 * split by recursive halving at the boundary r between sibling halves, exp(G_i - G_{r-1}) *
 * exp(G_{r-1} - G_j), each exponent a same-sign sum of g (<= 0) inside one half; factors below
 * exp(-30) are flushed to exactly 0 (as ops.kda._decay). Each factor is formed as a running
 * product of the per-token decays exp(g_t) <= 1 (one exp per token and channel), so exp() of a
 * positive number is never formed on the decay path. All math fp32; summation order differs from the PyTorch path.
 * Inputs are read in place: q, k, g [N, H, K] and v [N, H, V] with heads contiguous and any token
 * stride, beta [N, H] likewise. Return 0, -1 on allocation failure, -2 on bad sizes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#ifdef __SSE__
#include <xmmintrin.h>
#endif
#include "ds_abi.h"
#include "bf16.h"
#include "vmath.h"
#include "kda_chunk.h"

#define KC_FLUSH 30.f
#define KC_FLUSH_MIN 9.35762297e-14f   /* exp(-30) */

/* exp(x) for a log-decay x <= 0, flushed to 0 below exp(-30). */
static inline float decay(float x) { return x < -KC_FLUSH ? 0.f : ds_exp(x); }

#ifdef __AVX512F__
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                     _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    static const float c[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                               1.6666665459e-1f, 5.0000001201e-1f};
    __m512 p = _mm512_set1_ps(c[0]);
    for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c[i]));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

#endif

/* out[0..n) = decay(g[0..n)): the per-token decay factors exp(g), flushed below exp(-30). */
static void decay_vec(int n, const float *g, float *out) {
#ifdef __AVX512F__
    for (int d = 0; d < n; d += 16) {
        const __mmask16 m = tail_mask(n - d);
        const __m512 gv = _mm512_maskz_loadu_ps(m, g + d);
        const __mmask16 keep = _mm512_cmp_ps_mask(gv, _mm512_set1_ps(-KC_FLUSH), _CMP_GE_OQ);
        _mm512_mask_storeu_ps(out + d, m, _mm512_maskz_mov_ps(keep, exp16(gv)));
    }
#else
    for (int d = 0; d < n; ++d) out[d] = decay(g[d]);
#endif
}

/* Over K channels, with run the running decay product since a boundary (1 there) and E the
 * row's per-token factors: e = run after (mul_first) or before run *= E, a product below
 * exp(-30) flushed to 0; then y1 = s1 x1 e and, when x2 is not NULL, y2 = s2 x2 e. */
static void decay_rows(int K, float *run, const float *E, int mul_first, const float *x1, float s1,
                       float *y1, const float *x2, float s2, float *y2) {
#ifdef __AVX512F__
    const __m512 lo = _mm512_set1_ps(KC_FLUSH_MIN);
    for (int d = 0; d < K; d += 16) {
        const __mmask16 m = tail_mask(K - d);
        const __m512 rv = _mm512_maskz_loadu_ps(m, run + d), ev = _mm512_maskz_loadu_ps(m, E + d);
        __m512 pv = _mm512_mul_ps(rv, ev);
        pv = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(pv, lo, _CMP_GE_OQ), pv);
        const __m512 e = mul_first ? pv : rv;
        _mm512_mask_storeu_ps(run + d, m, pv);
        _mm512_mask_storeu_ps(y1 + d, m, _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(s1), _mm512_maskz_loadu_ps(m, x1 + d)), e));
        if (x2)
            _mm512_mask_storeu_ps(y2 + d, m, _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(s2), _mm512_maskz_loadu_ps(m, x2 + d)), e));
    }
#else
    for (int d = 0; d < K; ++d) {
        float p = run[d] * E[d];
        p = p < KC_FLUSH_MIN ? 0.f : p;
        const float e = mul_first ? p : run[d];
        run[d] = p;
        y1[d] = s1 * x1[d] * e;
        if (x2) y2[d] = s2 * x2[d] * e;
    }
#endif
}

/* y[0..n) = silu(sum_w wt[w*ldw + c] * src[w][off + c]) (src[w] NULL: a zero row); returns sum y^2. */
static float conv_span(int n, int W, const uint16_t *const *src, int64_t off, const float *wt, int64_t ldw,
                       float *y) {
#ifdef __AVX512F__
    __m512 ss = _mm512_setzero_ps();
    for (int c = 0; c < n; c += 16) {
        const __mmask16 m = tail_mask(n - c);
        __m512 acc = _mm512_setzero_ps();
        for (int w = 0; w < W; ++w)
            if (src[w])
                acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, wt + w * ldw + c),
                                      bf16_to_f32_x16(_mm256_maskz_loadu_epi16(m, src[w] + off + c)), acc);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), acc));
        const __m512 v = _mm512_div_ps(acc, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        ss = _mm512_fmadd_ps(v, v, ss);
        _mm512_mask_storeu_ps(y + c, m, v);
    }
    return _mm512_reduce_add_ps(ss);
#else
    float ss = 0.f;
    for (int c = 0; c < n; ++c) {
        float acc = 0.f;
        for (int w = 0; w < W; ++w)
            if (src[w]) acc += wt[w * ldw + c] * bf16_to_f32(src[w][off + c]);
        y[c] = acc / (1.f + ds_exp(-acc));
        ss += y[c] * y[c];
    }
    return ss;
#endif
}

static inline float dot(const float *a, const float *b, int n) {
    float r, unused;
    ds_kc_dot2(a, a, b, n, &r, &unused);
    return r;
}

typedef struct {
    int H, K, V;
    const float *q, *k, *v, *g, *beta;
    int64_t sq, sk, sv, sg, sb;
    float scale;
} kda_args;

/* Per-thread scratch, in floats. */
static size_t scratch_floats(int K, int V) {
    const size_t C = KC_MAX_CHUNK;
    return 2 * C * C + 7 * C * (size_t)K + 2 * C * (size_t)V + 2 * (size_t)K + 64;
}

/* One chunk of one (sequence, head): intra-chunk quantities, then o and the state update. The
 * next chunk of the same (sequence, head), tokens [n0, n0 + nLc) (nLc = 0: none), is prefetched. */
static void kda_chunk(const kda_args *a, int h, int64_t t0, int Lc, int64_t n0, int nLc, float *S, float *o,
                      float *ws) {
    const int K = a->K, V = a->V, C = KC_MAX_CHUNK;
    float *Aqk = ws, *Akk = Aqk + C * C, *Wn = Akk + C * C, *Qg = Wn + C * K, *Kd = Qg + C * K;
    float *rq = Kd + C * K, *rk = rq + C * K, *col = rk + C * K, *U = col + C * K, *dl = U + C * V;
    float *run = dl + C * V, *egc = run + K, *E = egc + K;   /* E [C, K]: exp(g), flushed */
#define ROW(p, s, i) (a->p + (t0 + (i)) * a->s + (int64_t)h * K)
    for (int i = 0; i < Lc; ++i) decay_vec(K, ROW(g, sg, i), E + i * K);
    memset(Aqk, 0, sizeof(float) * (size_t)C * Lc);
    for (int i = 0; i < Lc; ++i) Aqk[i * C + i] = dot(ROW(q, sq, i), ROW(k, sk, i), K);
    for (int m = 1; m < Lc; m *= 2) {
        for (int b0 = 0; b0 + m < Lc; b0 += 2 * m) {
            const int r = b0 + m, iend = b0 + 2 * m < Lc ? b0 + 2 * m : Lc;
            for (int d = 0; d < K; ++d) run[d] = 1.f;
            for (int j = r - 1; j >= b0; --j)            /* exp(G_{r-1} - G_j), left half */
                decay_rows(K, run, E + j * K, 0, ROW(k, sk, j), 1.f, col + (j - b0) * K, NULL, 0.f, NULL);
            for (int d = 0; d < K; ++d) run[d] = 1.f;
            for (int i = r; i < iend; ++i)               /* exp(G_i - G_{r-1}), right half */
                decay_rows(K, run, E + i * K, 1, ROW(q, sq, i), 1.f, rq + (i - r) * K, ROW(k, sk, i), 1.f,
                           rk + (i - r) * K);
            for (int i = r; i < iend; ++i) {
                const float *qi = rq + (i - r) * K, *ki = rk + (i - r) * K;
                float *aq = Aqk + i * C, *ak = Akk + i * C;
                int j = b0;
#ifdef __AVX512F__
                for (; j + 8 <= r; j += 8) ds_kc_dot2x8(qi, ki, col + (j - b0) * K, K, K, aq + j, ak + j);
#endif
                for (; j + 4 <= r; j += 4) ds_kc_dot2x4(qi, ki, col + (j - b0) * K, K, K, aq + j, ak + j);
                for (; j < r; ++j) ds_kc_dot2(qi, ki, col + (j - b0) * K, K, aq + j, ak + j);
            }
        }
    }
    for (int d = 0; d < K; ++d) run[d] = 1.f;
    for (int i = 0; i < Lc; ++i) {
        const float bi = a->beta[(t0 + i) * a->sb + h], sc = a->scale;
        const float *vi = a->v + (t0 + i) * a->sv + (int64_t)h * V;
        float *u = U + i * V;
        for (int j = 0; j <= i; ++j) Aqk[i * C + j] *= sc;
        decay_rows(K, run, E + i * K, 1, ROW(q, sq, i), sc, Qg + i * K, ROW(k, sk, i), -bi, Wn + i * K);
        for (int e = 0; e < V; ++e) u[e] = bi * vi[e];
        for (int j = 0; j < i; ++j) Akk[i * C + j] *= -bi;     /* row i of -L */
    }
    for (int b = 0; b < Lc; b += 16) {       /* (I + L)^-1 by forward substitution, in row blocks */
        const int nb = Lc - b < 16 ? Lc - b : 16;
        if (b) {                              /* the block's rows get all rows before it at once */
            ds_kc_mm(nb, K, b, Akk + b * C, C, 1, Wn, K, Wn + b * K, K, Wn + b * K, K, NULL, 0, NULL);
            ds_kc_mm(nb, V, b, Akk + b * C, C, 1, U, V, U + b * V, V, U + b * V, V, NULL, 0, NULL);
        }
        for (int i = b + 1; i < b + nb; ++i) {
            ds_kc_row_acc(K, i - b, Akk + i * C + b, Wn + b * K, K, Wn + i * K);
            ds_kc_row_acc(V, i - b, Akk + i * C + b, U + b * V, V, U + i * V);
        }
    }
    memcpy(egc, run, sizeof(float) * K);
    for (int d = 0; d < K; ++d) run[d] = 1.f;
    for (int i = Lc - 1; i >= 0; --i)                    /* exp(G_C - G_i), exclusive */
        decay_rows(K, run, E + i * K, 0, ROW(k, sk, i), 1.f, Kd + i * K, NULL, 0.f, NULL);
#undef ROW
    const int64_t ldo = (int64_t)a->H * V;
    prefetch_queue pq = {{a->q + n0 * a->sq + (int64_t)h * K, a->k + n0 * a->sk + (int64_t)h * K,
                          a->g + n0 * a->sg + (int64_t)h * K, a->v + n0 * a->sv + (int64_t)h * V},
                         {a->sq, a->sk, a->sg, a->sv}, {K, K, K, V}, 4 * nLc, 0, 0};
    const int steps = (V + 63) / 64 * (3 * ((Lc + 5) / 6) + (K + 5) / 6);   /* mm tiles (6 x 64) below */
    pq.quota = (pq.n + steps - 1) / steps;
    for (int j0 = 0; j0 < V; j0 += 64) {      /* by value-column blocks: S[:, j0 + 0..64) stays in L1 */
        const int nc = V - j0 < 64 ? V - j0 : 64;
        float *Sb = S + j0, *db = dl + j0, *ob = o + j0;
        ds_kc_mm(Lc, nc, K, Wn, K, 1, Sb, V, db, V, U + j0, V, NULL, 0, &pq);         /* delta = U - W S */
        ds_kc_mm(Lc, nc, K, Qg, K, 1, Sb, V, ob, ldo, NULL, 0, NULL, 0, &pq);         /* o = Qg S */
        ds_kc_mm(Lc, nc, Lc, Aqk, C, 1, db, V, ob, ldo, ob, ldo, NULL, 1, &pq);       /* o += A_qk delta */
        ds_kc_mm(K, nc, Lc, Kd, 1, K, db, V, Sb, V, Sb, V, egc, 0, &pq);              /* S = eGC S + Kd^T delta */
    }
    prefetch_step(&pq, pq.n);
}

int ds_kda_chunked(int B, int H, int K, int V, const float *q, int64_t sq, const float *k,
                   int64_t sk, const float *v, int64_t sv, const float *g, int64_t sg,
                   const float *beta, int64_t sb, float scale, const int64_t *chunk_first,
                   const int64_t *chunk_start, const int64_t *chunk_len, const int64_t *ex_first,
                   const int64_t *ex_chunk, const float *initial_state, float *o, float *final_state,
                   float *exported, int nthreads) {
    if (B < 0 || H < 1 || K < 1 || V < 1) return -2;
    const kda_args args = {H, K, V, q, k, v, g, beta, sq, sk, sv, sg, sb, scale};
    const size_t KV = (size_t)K * V, bytes = ((sizeof(float) * scratch_floats(K, V)) + 63) / 64 * 64;
    int bad = 0;
    #pragma omp parallel num_threads(nthreads) reduction(| : bad)
    {
#ifdef __SSE__
        /* Subnormals flushed (FTZ | DAZ) for the call: products of several decays and small W
         * entries fall below 1e-38 where whole chunks decay fast, and subnormal operands slow
         * every FMA 10-100x; a flushed value is < 1e-38 of the O(1) terms it is summed with. */
        const unsigned csr = _mm_getcsr();
        _mm_setcsr(csr | 0x8040);
#endif
        float *ws = aligned_alloc(64, bytes);
        if (!ws) bad |= 1;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < (int64_t)B * H; ++t) {
            if (!ws) continue;
            const int64_t b = t / H;
            const int h = (int)(t % H);
            float *S = final_state + (size_t)t * KV;
            if (initial_state) memcpy(S, initial_state + (size_t)t * KV, sizeof(float) * KV);
            else memset(S, 0, sizeof(float) * KV);
            int64_t e = ex_first ? ex_first[b] : 0;
            const int64_t e_end = ex_first ? ex_first[b + 1] : 0;
            for (int64_t c = chunk_first[b]; c < chunk_first[b + 1]; ++c) {
                const int Lc = (int)chunk_len[c];
                if (Lc < 1 || Lc > KC_MAX_CHUNK) { bad |= 2; break; }
                const int nLc = c + 1 < chunk_first[b + 1] ? (int)chunk_len[c + 1] : 0;
                kda_chunk(&args, h, chunk_start[c], Lc, nLc ? chunk_start[c + 1] : 0, nLc, S,
                          o + chunk_start[c] * H * V + (int64_t)h * V, ws);
                for (; e < e_end && ex_chunk[e] == c; ++e)
                    memcpy(exported + ((size_t)e * H + h) * KV, S, sizeof(float) * KV);
            }
        }
        free(ws);
#ifdef __SSE__
        _mm_setcsr(csr);
#endif
    }
    return bad & 1 ? -1 : bad ? -2 : 0;
}

/* Depthwise causal conv + SiLU: y[t, c] = silu(sum_w weight[c, w] * u[t - (W-1) + w, c]) over
 * u = (initial tail or zeros) ++ x per sequence; x bf16 rows at stride ldx, weight fp32 [C, W],
 * tails bf16 [B, W-1, C]. Then channels [0, norm_groups * group) are L2-normalised in groups of
 * `group` (x / sqrt(sum x^2 + 1e-6)). final_tail gets each sequence's last W-1 inputs. */
int ds_causal_conv1d(int64_t N, int C, int W, const uint16_t *x, int64_t ldx, const float *weight,
                     int B, const int64_t *cu, const uint16_t *initial_tail, int norm_groups,
                     int group, float *y, uint16_t *final_tail, int nthreads) {
    if (W < 1 || C < 1 || B < 0 || norm_groups < 0 || (norm_groups && (group < 1 || (int64_t)norm_groups * group > C)))
        return -2;
    const int P = W - 1;
    float *wt = malloc(sizeof(float) * (size_t)C * W);
    if (!wt) return -1;
    for (int c = 0; c < C; ++c)
        for (int w = 0; w < W; ++w) wt[(size_t)w * C + c] = weight[(size_t)c * W + w];
    int bad = 0;
    #pragma omp parallel num_threads(nthreads) reduction(| : bad)
    {
        const uint16_t **src = malloc(sizeof(*src) * (size_t)W);   /* the W input rows of token t */
        bad |= !src;
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < N; ++t) {
            if (!src) continue;
            int lo = 0, hi = B;                            /* sequence b: cu[b] <= t < cu[b+1] */
            while (hi - lo > 1) { const int mid = (lo + hi) / 2; if (cu[mid] <= t) lo = mid; else hi = mid; }
            const int b = lo;
            for (int w = 0; w < W; ++w) {
                const int64_t pos = t - P + w;
                src[w] = pos >= cu[b] ? x + pos * ldx
                    : initial_tail ? initial_tail + ((int64_t)b * P + P - (cu[b] - pos)) * C : NULL;
            }
            float *yr = y + t * C;
            for (int gi = 0; gi < norm_groups; ++gi) {
                const int64_t c0 = (int64_t)gi * group;
                const float r = 1.f / sqrtf(conv_span(group, W, src, c0, wt + c0, C, yr + c0) + 1e-6f);
                for (int c = 0; c < group; ++c) yr[c0 + c] *= r;
            }
            const int64_t c0 = (int64_t)norm_groups * group;
            conv_span((int)(C - c0), W, src, c0, wt + c0, C, yr + c0);
        }
        free(src);
    }
    free(wt);
    if (bad) return -1;
    for (int b = 0; b < B; ++b)
        for (int r = 0; r < P; ++r) {
            const int64_t pos = cu[b + 1] - P + r;
            uint16_t *dst = final_tail + ((int64_t)b * P + r) * C;
            const uint16_t *src = pos >= cu[b] ? x + pos * ldx
                : initial_tail ? initial_tail + ((int64_t)b * P + P - (cu[b] - pos)) * C : NULL;
            if (src) memcpy(dst, src, sizeof(uint16_t) * (size_t)C);
            else memset(dst, 0, sizeof(uint16_t) * (size_t)C);
        }
    return 0;
}
