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
#include "bf16.h"
#include "vmath.h"

#define KC_MAX_CHUNK 64
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

static inline __mmask16 tail_mask(int rem) { return rem >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << rem) - 1); }
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

/* y = silu(y) = y / (1 + exp(-y)) over n values. */
static void silu_inplace(float *y, int64_t n) {
#ifdef __AVX512F__
    for (int64_t d = 0; d < n; d += 16) {
        const __mmask16 m = tail_mask((int)(n - d < 16 ? n - d : 16));
        const __m512 v = _mm512_maskz_loadu_ps(m, y + d);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), v));
        _mm512_mask_storeu_ps(y + d, m, _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
    }
#else
    for (int64_t d = 0; d < n; ++d) y[d] = y[d] / (1.f + ds_exp(-y[d]));
#endif
}

/* (a . c, b . c) over n channels. */
static inline void dot2(const float *a, const float *b, const float *c, int n, float *ra, float *rb) {
#ifdef __AVX512F__
    __m512 sa = _mm512_setzero_ps(), sb = _mm512_setzero_ps();
    for (int d = 0; d < n; d += 16) {
        const __mmask16 m = tail_mask(n - d);
        const __m512 cv = _mm512_maskz_loadu_ps(m, c + d);
        sa = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + d), cv, sa);
        sb = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, b + d), cv, sb);
    }
    *ra = _mm512_reduce_add_ps(sa);
    *rb = _mm512_reduce_add_ps(sb);
#else
    *ra = *rb = 0.f;
    for (int d = 0; d < n; ++d) { *ra = fmaf(a[d], c[d], *ra); *rb = fmaf(b[d], c[d], *rb); }
#endif
}

/* Rows a, b against columns c[0..3] (row stride ldc): ra[j] = a . c_j, rb[j] = b . c_j. */
static inline void dot2x4(const float *a, const float *b, const float *c, int64_t ldc, int n, float *ra,
                          float *rb) {
#ifdef __AVX512F__
    __m512 sa[4], sb[4];
    for (int j = 0; j < 4; ++j) sa[j] = sb[j] = _mm512_setzero_ps();
    for (int d = 0; d < n; d += 16) {
        const __mmask16 m = tail_mask(n - d);
        const __m512 av = _mm512_maskz_loadu_ps(m, a + d), bv = _mm512_maskz_loadu_ps(m, b + d);
        for (int j = 0; j < 4; ++j) {
            const __m512 cv = _mm512_maskz_loadu_ps(m, c + j * ldc + d);
            sa[j] = _mm512_fmadd_ps(av, cv, sa[j]);
            sb[j] = _mm512_fmadd_ps(bv, cv, sb[j]);
        }
    }
    for (int j = 0; j < 4; ++j) {
        ra[j] = _mm512_reduce_add_ps(sa[j]);
        rb[j] = _mm512_reduce_add_ps(sb[j]);
    }
#else
    for (int j = 0; j < 4; ++j) dot2(a, b, c + j * ldc, n, ra + j, rb + j);
#endif
}

/* c[0..n) += sum_{d < D} coef[d] * B[d*ldb + 0..n). */
static void row_acc(int n, int D, const float *coef, const float *B, int64_t ldb, float *c) {
#ifdef __AVX512F__
    for (int j0 = 0; j0 < n; j0 += 128) {
        __mmask16 mk[8];
        __m512 acc[8];
        for (int u = 0; u < 8; ++u) {
            mk[u] = n - j0 - 16 * u <= 0 ? (__mmask16)0 : tail_mask(n - j0 - 16 * u);
            acc[u] = _mm512_maskz_loadu_ps(mk[u], c + j0 + 16 * u);
        }
        for (int d = 0; d < D; ++d) {
            const __m512 cf = _mm512_set1_ps(coef[d]);
            const float *b = B + (int64_t)d * ldb + j0;
            for (int u = 0; u < 8; ++u) acc[u] = _mm512_fmadd_ps(cf, _mm512_maskz_loadu_ps(mk[u], b + 16 * u), acc[u]);
        }
        for (int u = 0; u < 8; ++u) _mm512_mask_storeu_ps(c + j0 + 16 * u, mk[u], acc[u]);
    }
#else
    for (int d = 0; d < D; ++d)
        for (int j = 0; j < n; ++j) c[j] = fmaf(coef[d], B[(int64_t)d * ldb + j], c[j]);
#endif
}

static inline float dot(const float *a, const float *b, int n) {
    float r, unused;
    dot2(a, a, b, n, &r, &unused);
    return r;
}

/* C[M, N] = init (rows scaled by rs, or 0 when init is NULL) + A @ B, where A(i, d) is at
 * A[i*ars + d*acs], B row d at B + d*ldb, C and init rows at stride ldc / ldi (init may be C).
 * tri: A is lower-triangular incl. the diagonal (entries above it are zeros in memory). */
static void mm(int M, int N, int D, const float *A, int64_t ars, int64_t acs, const float *B,
               int64_t ldb, float *C, int64_t ldc, const float *init, int64_t ldi, const float *rs,
               int tri) {
#ifdef __AVX512F__
    enum { MR = 6 };                 /* 6 x 64 register tile: 24 accumulators */
    for (int j0 = 0; j0 < N; j0 += 64) {
        const int nc = N - j0 < 64 ? N - j0 : 64;
        __mmask16 mk[4];
        for (int u = 0; u < 4; ++u) mk[u] = nc - 16 * u <= 0 ? (__mmask16)0 : tail_mask(nc - 16 * u);
        for (int i0 = 0; i0 < M; i0 += MR) {
            const int mr = M - i0 < MR ? M - i0 : MR;
            const float *ar[MR];
            __m512 acc[MR][4];
            for (int r = 0; r < MR; ++r) {
                const int i = i0 + (r < mr ? r : mr - 1);
                ar[r] = A + (int64_t)i * ars;
                const __m512 s = _mm512_set1_ps(rs ? rs[i] : 1.f);
                for (int u = 0; u < 4; ++u)
                    acc[r][u] = init ? _mm512_mul_ps(s, _mm512_maskz_loadu_ps(mk[u], init + i * ldi + j0 + 16 * u))
                                     : _mm512_setzero_ps();
            }
            const int dend = tri && i0 + MR < D ? i0 + MR : D;
            for (int d = 0; d < dend; ++d) {
                const float *b = B + (int64_t)d * ldb + j0;
                const __m512 b0 = _mm512_maskz_loadu_ps(mk[0], b), b1 = _mm512_maskz_loadu_ps(mk[1], b + 16);
                const __m512 b2 = _mm512_maskz_loadu_ps(mk[2], b + 32), b3 = _mm512_maskz_loadu_ps(mk[3], b + 48);
                for (int r = 0; r < MR; ++r) {
                    const __m512 av = _mm512_set1_ps(ar[r][(int64_t)d * acs]);
                    acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
                    acc[r][2] = _mm512_fmadd_ps(av, b2, acc[r][2]);
                    acc[r][3] = _mm512_fmadd_ps(av, b3, acc[r][3]);
                }
            }
            for (int r = 0; r < MR; ++r)      /* constant trip count keeps acc in registers */
                if (r < mr)
                    for (int u = 0; u < 4; ++u)
                        _mm512_mask_storeu_ps(C + (i0 + r) * ldc + j0 + 16 * u, mk[u], acc[r][u]);
        }
    }
#else
    for (int i = 0; i < M; ++i) {
        float *c = C + i * ldc;
        const float s = rs ? rs[i] : 1.f;
        for (int j = 0; j < N; ++j) c[j] = init ? s * init[i * ldi + j] : 0.f;
        const int dend = tri && i + 1 < D ? i + 1 : D;
        for (int d = 0; d < dend; ++d) {
            const float a = A[(int64_t)i * ars + (int64_t)d * acs];
            const float *b = B + (int64_t)d * ldb;
            for (int j = 0; j < N; ++j) c[j] = fmaf(a, b[j], c[j]);
        }
    }
#endif
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

/* One chunk of one (sequence, head): intra-chunk quantities, then o and the state update. */
static void kda_chunk(const kda_args *a, int h, int64_t t0, int Lc, float *S, float *o, float *ws) {
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
                int j = b0;
                for (; j + 4 <= r; j += 4)
                    dot2x4(rq + (i - r) * K, rk + (i - r) * K, col + (j - b0) * K, K, K, Aqk + i * C + j, Akk + i * C + j);
                for (; j < r; ++j)
                    dot2(rq + (i - r) * K, rk + (i - r) * K, col + (j - b0) * K, K, Aqk + i * C + j, Akk + i * C + j);
            }
        }
    }
    for (int d = 0; d < K; ++d) run[d] = 1.f;
    for (int i = 0; i < Lc; ++i) {
        const float bi = a->beta[(t0 + i) * a->sb + h], sc = a->scale;
        const float *vi = a->v + (t0 + i) * a->sv + (int64_t)h * V;
        float *wn = Wn + i * K, *u = U + i * V;
        for (int j = 0; j <= i; ++j) Aqk[i * C + j] *= sc;
        decay_rows(K, run, E + i * K, 1, ROW(q, sq, i), sc, Qg + i * K, ROW(k, sk, i), -bi, wn);
        for (int e = 0; e < V; ++e) u[e] = bi * vi[e];
        for (int j = 0; j < i; ++j) Akk[i * C + j] *= -bi;     /* row i of -L */
        row_acc(K, i, Akk + i * C, Wn, K, wn);           /* (I + L)^-1 by forward substitution */
        row_acc(V, i, Akk + i * C, U, V, u);
    }
    memcpy(egc, run, sizeof(float) * K);
    for (int d = 0; d < K; ++d) run[d] = 1.f;
    for (int i = Lc - 1; i >= 0; --i)                    /* exp(G_C - G_i), exclusive */
        decay_rows(K, run, E + i * K, 0, ROW(k, sk, i), 1.f, Kd + i * K, NULL, 0.f, NULL);
#undef ROW
    const int64_t ldo = (int64_t)a->H * V;
    mm(Lc, V, K, Wn, K, 1, S, V, dl, V, U, V, NULL, 0);                  /* delta = U - W S */
    mm(Lc, V, K, Qg, K, 1, S, V, o, ldo, NULL, 0, NULL, 0);              /* o = Qg S */
    mm(Lc, V, Lc, Aqk, C, 1, dl, V, o, ldo, o, ldo, NULL, 1);            /* o += A_qk delta */
    mm(K, V, Lc, Kd, 1, K, dl, V, S, V, S, V, egc, 0);                   /* S = eGC S + Kd^T delta */
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
                kda_chunk(&args, h, chunk_start[c], Lc, S, o + chunk_start[c] * H * V + (int64_t)h * V, ws);
                for (; e < e_end && ex_chunk[e] == c; ++e)
                    memcpy(exported + ((size_t)e * H + h) * KV, S, sizeof(float) * KV);
            }
        }
        free(ws);
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
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < N; ++t) {
        int lo = 0, hi = B;                                /* sequence b: cu[b] <= t < cu[b+1] */
        while (hi - lo > 1) { const int mid = (lo + hi) / 2; if (cu[mid] <= t) lo = mid; else hi = mid; }
        const int b = lo;
        float *yr = y + t * C;
        for (int c = 0; c < C; ++c) yr[c] = 0.f;
        for (int w = 0; w < W; ++w) {
            const int64_t pos = t - P + w;
            const uint16_t *src = pos >= cu[b] ? x + pos * ldx
                : initial_tail ? initial_tail + ((int64_t)b * P + P - (cu[b] - pos)) * C : NULL;
            if (!src) continue;
            const float *wr = wt + (size_t)w * C;
            for (int c = 0; c < C; ++c) yr[c] += wr[c] * bf16_to_f32(src[c]);
        }
        silu_inplace(yr, C);
        for (int gi = 0; gi < norm_groups; ++gi) {
            float *vg = yr + (int64_t)gi * group;
            const float r = 1.f / sqrtf(dot(vg, vg, group) + 1e-6f);
            for (int c = 0; c < group; ++c) vg[c] *= r;
        }
    }
    free(wt);
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
