/* deltaserve CPU kernels: small-M linear layers (batch-1..8 decode) for bf16 weights, the fused
 * routed experts over bf16 or MXFP4-packed weights, and a fast MXFP4 -> bf16 dequantiser for
 * large-M (prefill) GEMMs.
 *
 * Every kernel computes y[m, n] = sum_k x[m, k] * w[n, k] with fp32 accumulation and writes
 * bf16 rounded to nearest-even (NaN kept quiet), the contract of torch's bf16 F.linear; only
 * the summation order differs. MXFP4 layout (spec/model.md §16): packed [N, K/2] uint8 with the
 * LOW nibble the EARLIER element, scale [N, K/32] uint8 E8M0 (2^(s-127)).
 * Built with -march=native; without AVX512-BF16 the portable C path runs (same results up to
 * summation order). Threads: OpenMP over output rows, `nthreads` from torch.get_num_threads().
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "bf16.h"
#include "vmath.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define DS_AVX512BF16 1
#endif

#define DS_MAX_M 8
#define DS_GROUP 32

/* E2M1 code -> value; scaled_lut[s][c] = bf16(E2M1[c] * 2^(s-127)), exact (truncation of an
 * exactly representable fp32 value; the top scales overflow to +-inf as the formula does). */
static const float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                               -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
static uint16_t scaled_lut[256][32];
static float scale_f32[256];
/* Fills the tables; the loader calls it once before any kernel runs. */
void ds_init(void) {
    for (int s = 0; s < 256; ++s) {
        uint32_t bits = s == 0 ? 0x00400000u : (uint32_t)s << 23;   /* 2^-127 is subnormal */
        float sc;
        memcpy(&sc, &bits, 4);
        scale_f32[s] = sc;
        for (int c = 0; c < 32; ++c) {
            float v = E2M1[c & 15] * sc;
            uint32_t u;
            memcpy(&u, &v, 4);
            scaled_lut[s][c] = (uint16_t)(u >> 16);
        }
    }
}

int ds_has_avx512bf16(void) {
#ifdef DS_AVX512BF16
    return 1;
#else
    return 0;
#endif
}

/* ---- bf16 weights ------------------------------------------------------------------------ */

static __attribute__((unused)) void row_bf16_portable(const uint16_t *x, int M, int K, const uint16_t *w, float *acc) {
    for (int m = 0; m < M; ++m) {
        float s = 0.f;
        const uint16_t *xm = x + (int64_t)m * K;
        for (int k = 0; k < K; ++k) s += bf16_to_f32(xm[k]) * bf16_to_f32(w[k]);
        acc[m] = s;
    }
}

#ifdef DS_AVX512BF16
/* R weight rows are streamed together (R * M independent accumulators hide the dot-product
 * latency and keep R memory streams in flight); rows are prefetched DS_PREFETCH elements ahead. */
#define DS_ROWS(M) ((M) >= 8 ? 1 : 8 / (M))
#define DS_UNROLL(M) ((M) >= 4 ? 1 : 4 / (M))   /* MXFP4: accumulators per row along K */
#define DS_PREFETCH 256

static inline __attribute__((always_inline)) void
rows_bf16_avx(const uint16_t *x, const int M, int K, const uint16_t *w, const int R, float *acc) {
    __m512 a[8][DS_MAX_M];
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) a[r][m] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        for (int r = 0; r < R; ++r) {
            const uint16_t *wr = w + (int64_t)r * K + k;
            _mm_prefetch((const char *)(wr + DS_PREFETCH), _MM_HINT_T0);
            __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)wr);
            for (int m = 0; m < M; ++m) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (int64_t)m * K + k));
                a[r][m] = _mm512_dpbf16_ps(a[r][m], wv, xv);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) {
            float s = _mm512_reduce_add_ps(a[r][m]);
            for (int j = k; j < K; ++j) s += bf16_to_f32(x[(int64_t)m * K + j]) * bf16_to_f32(w[(int64_t)r * K + j]);
            acc[r * DS_MAX_M + m] = s;
        }
}
#else
#define DS_ROWS(M) 1
#endif

/* acc[r * DS_MAX_M + m] = x[m] . w[r] for r < R; R is DS_ROWS(M) or fewer at the matrix end. */
static void rows_bf16(const uint16_t *x, int M, int K, const uint16_t *w, int R, float *acc) {
#ifdef DS_AVX512BF16
    if (R == DS_ROWS(M)) {
        switch (M) {   /* constant M and R so the accumulators live in registers */
        case 1: rows_bf16_avx(x, 1, K, w, 8, acc); return;
        case 2: rows_bf16_avx(x, 2, K, w, 4, acc); return;
        case 3: rows_bf16_avx(x, 3, K, w, 2, acc); return;
        case 4: rows_bf16_avx(x, 4, K, w, 2, acc); return;
        case 5: rows_bf16_avx(x, 5, K, w, 1, acc); return;
        case 6: rows_bf16_avx(x, 6, K, w, 1, acc); return;
        case 7: rows_bf16_avx(x, 7, K, w, 1, acc); return;
        case 8: rows_bf16_avx(x, 8, K, w, 1, acc); return;
        default: break;
        }
    }
    for (int r = 0; r < R; ++r) rows_bf16_avx(x, M, K, w + (int64_t)r * K, 1, acc + r * DS_MAX_M);
#else
    for (int r = 0; r < R; ++r) row_bf16_portable(x, M, K, w + (int64_t)r * K, acc + r * DS_MAX_M);
#endif
}

/* y[M, N] (row stride ldy) = x[M, K] @ w[N, K]^T; M <= DS_MAX_M. */
void ds_linear_bf16(const uint16_t *x, int M, int K, const uint16_t *w, int N, uint16_t *y,
                    int64_t ldy, int nthreads) {
    const int R = DS_ROWS(M);
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (N >= 256)
    for (int n0 = 0; n0 < N; n0 += R) {
        float acc[8 * DS_MAX_M];
        const int rows = N - n0 < R ? N - n0 : R;
        rows_bf16(x, M, K, w + (int64_t)n0 * K, rows, acc);
        for (int r = 0; r < rows; ++r)
            for (int m = 0; m < M; ++m) y[(int64_t)m * ldy + n0 + r] = f32_to_bf16(acc[r * DS_MAX_M + m]);
    }
}

/* Several linears of one input in one parallel region: y_i[M, N_i] = x[M, K] @ w_i[N_i, K]^T for
 * i < nw (each y_i contiguous; fp32 when f32[i], else bf16). Row blocks of all weights are dealt
 * out together, so small projections share the threads' memory streams. Returns -1 if nw > 16. */
int ds_linear_bf16_multi(const uint16_t *x, int M, int K, const uint16_t *const *w, const int *N,
                         const int *f32, void *const *y, int nw, int nthreads) {
    enum { MAXW = 16 };
    if (nw > MAXW) return -1;
    const int R = DS_ROWS(M);
    int first[MAXW + 1];
    first[0] = 0;
    for (int i = 0; i < nw; ++i) first[i + 1] = first[i] + (N[i] + R - 1) / R;
    const int blocks = first[nw];
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (blocks * R >= 256)
    for (int b = 0; b < blocks; ++b) {
        int i = 0;
        while (first[i + 1] <= b) ++i;
        const int n0 = (b - first[i]) * R, rows = N[i] - n0 < R ? N[i] - n0 : R;
        float acc[8 * DS_MAX_M];
        rows_bf16(x, M, K, w[i] + (int64_t)n0 * K, rows, acc);
        for (int r = 0; r < rows; ++r)
            for (int m = 0; m < M; ++m) {
                const int64_t at = (int64_t)m * N[i] + n0 + r;
                if (f32[i]) ((float *)y[i])[at] = acc[r * DS_MAX_M + m];
                else ((uint16_t *)y[i])[at] = f32_to_bf16(acc[r * DS_MAX_M + m]);
            }
    }
    return 0;
}

/* Per-head linear: y[h, M, N] = x[h, M, K] @ w[h, N, K]^T, all contiguous; M <= DS_MAX_M. */
void ds_linear_bf16_heads(const uint16_t *x, int H, int M, int K, const uint16_t *w, int N, uint16_t *y,
                          int nthreads) {
    const int R = DS_ROWS(M), blocks = (N + R - 1) / R;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if ((int64_t)H * N >= 256)
    for (int t = 0; t < H * blocks; ++t) {
        const int h = t / blocks, n0 = (t % blocks) * R;
        float acc[8 * DS_MAX_M];
        const int rows = N - n0 < R ? N - n0 : R;
        rows_bf16(x + (int64_t)h * M * K, M, K, w + ((int64_t)h * N + n0) * K, rows, acc);
        for (int r = 0; r < rows; ++r)
            for (int m = 0; m < M; ++m) y[((int64_t)h * M + m) * N + n0 + r] = f32_to_bf16(acc[r * DS_MAX_M + m]);
    }
}

/* ---- MXFP4 weights ----------------------------------------------------------------------- */

static __attribute__((unused)) void row_mxfp4_portable(const uint16_t *x, int M, int K, const uint8_t *p, const uint8_t *s,
                               float *acc) {
    for (int m = 0; m < M; ++m) acc[m] = 0.f;
    for (int g = 0; g < K / DS_GROUP; ++g) {
        const uint16_t *lut = scaled_lut[s[g]];
        for (int m = 0; m < M; ++m) {
            const uint16_t *xm = x + (int64_t)m * K + g * DS_GROUP;
            float part = 0.f;
            for (int i = 0; i < DS_GROUP / 2; ++i) {
                uint8_t b = p[g * (DS_GROUP / 2) + i];
                part += bf16_to_f32(lut[b & 15]) * bf16_to_f32(xm[2 * i])
                      + bf16_to_f32(lut[b >> 4]) * bf16_to_f32(xm[2 * i + 1]);
            }
            acc[m] += part;
        }
    }
}

#ifdef DS_AVX512BF16
/* 16 packed bytes -> the 32 nibbles in element order (low nibble of byte i is element 2i). */
static inline __m512i nibbles_in_order(const uint8_t *p) {
    const __m512i dup = _mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8,
                                         7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i shift = _mm512_set_epi16(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0,
                                           4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
    __m512i wide = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)));
    __m512i both = _mm512_permutexvar_epi16(dup, wide);
    return _mm512_and_si512(_mm512_srlv_epi16(both, shift), _mm512_set1_epi16(15));
}

static inline __attribute__((always_inline)) void
row_mxfp4_avx(const uint16_t *x, const int M, int K, const uint8_t *p, const uint8_t *s, float *acc) {
    const int U = DS_UNROLL(M), groups = K / DS_GROUP;
    __m512 a[4][DS_MAX_M];
    for (int u = 0; u < U; ++u)
        for (int m = 0; m < M; ++m) a[u][m] = _mm512_setzero_ps();
    int g = 0;
    for (; g + U <= groups; g += U) {
        for (int u = 0; u < U; ++u) {
            __m512i lut = _mm512_loadu_si512((const void *)scaled_lut[s[g + u]]);
            __m512bh wv = (__m512bh)_mm512_permutexvar_epi16(nibbles_in_order(p + (g + u) * (DS_GROUP / 2)), lut);
            for (int m = 0; m < M; ++m) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (int64_t)m * K + (g + u) * DS_GROUP));
                a[u][m] = _mm512_dpbf16_ps(a[u][m], wv, xv);
            }
        }
    }
    for (; g < groups; ++g) {
        __m512i lut = _mm512_loadu_si512((const void *)scaled_lut[s[g]]);
        __m512bh wv = (__m512bh)_mm512_permutexvar_epi16(nibbles_in_order(p + g * (DS_GROUP / 2)), lut);
        for (int m = 0; m < M; ++m) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (int64_t)m * K + g * DS_GROUP));
            a[0][m] = _mm512_dpbf16_ps(a[0][m], wv, xv);
        }
    }
    for (int m = 0; m < M; ++m) {
        for (int u = 1; u < U; ++u) a[0][m] = _mm512_add_ps(a[0][m], a[u][m]);
        acc[m] = _mm512_reduce_add_ps(a[0][m]);
    }
}
/* Four consecutive rows at once for M <= 2 (decode): each group's activations are loaded once
 * for the four rows, and the 4 * M accumulator chains are independent. acc as rows_bf16. */
static inline __attribute__((always_inline)) void
rows4_mxfp4_avx(const uint16_t *x, const int M, int K, const uint8_t *p, const uint8_t *s, float *acc) {
    const int groups = K / DS_GROUP;
    __m512 a[4][2];
    for (int r = 0; r < 4; ++r)
        for (int m = 0; m < M; ++m) a[r][m] = _mm512_setzero_ps();
    for (int g = 0; g < groups; ++g) {
        __m512bh xv[2];
        for (int m = 0; m < M; ++m)
            xv[m] = (__m512bh)_mm512_loadu_si512((const void *)(x + (int64_t)m * K + g * DS_GROUP));
        for (int r = 0; r < 4; ++r) {
            const __m512i lut = _mm512_loadu_si512((const void *)scaled_lut[s[(int64_t)r * groups + g]]);
            const __m512bh wv = (__m512bh)_mm512_permutexvar_epi16(
                nibbles_in_order(p + (int64_t)r * (K / 2) + g * (DS_GROUP / 2)), lut);
            for (int m = 0; m < M; ++m) a[r][m] = _mm512_dpbf16_ps(a[r][m], wv, xv[m]);
        }
    }
    for (int r = 0; r < 4; ++r)
        for (int m = 0; m < M; ++m) acc[r * DS_MAX_M + m] = _mm512_reduce_add_ps(a[r][m]);
}
#endif

static void row_mxfp4(const uint16_t *x, int M, int K, const uint8_t *p, const uint8_t *s, float *acc) {
#ifdef DS_AVX512BF16
    switch (M) {
    case 1: row_mxfp4_avx(x, 1, K, p, s, acc); return;
    case 2: row_mxfp4_avx(x, 2, K, p, s, acc); return;
    case 3: row_mxfp4_avx(x, 3, K, p, s, acc); return;
    case 4: row_mxfp4_avx(x, 4, K, p, s, acc); return;
    case 5: row_mxfp4_avx(x, 5, K, p, s, acc); return;
    case 6: row_mxfp4_avx(x, 6, K, p, s, acc); return;
    case 7: row_mxfp4_avx(x, 7, K, p, s, acc); return;
    default: row_mxfp4_avx(x, 8, K, p, s, acc); return;   /* M <= DS_MAX_M */
    }
#else
    row_mxfp4_portable(x, M, K, p, s, acc);
#endif
}

/* out[N, K] bf16 = decode(packed [N, K/2], scale [N, K/32]); exact. */
void ds_mxfp4_to_bf16(const uint8_t *packed, const uint8_t *scale, int64_t N, int K, uint16_t *out,
                      int nthreads) {
    const int groups = K / DS_GROUP;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (N * K >= (1 << 16))
    for (int64_t n = 0; n < N; ++n) {
        for (int g = 0; g < groups; ++g) {
            const uint8_t *p = packed + n * (K / 2) + g * (DS_GROUP / 2);
            const uint16_t *lut = scaled_lut[scale[n * groups + g]];
            uint16_t *o = out + n * K + g * DS_GROUP;
#ifdef DS_AVX512BF16
            __m512i l = _mm512_loadu_si512((const void *)lut);
            _mm512_storeu_si512((void *)o, _mm512_permutexvar_epi16(nibbles_in_order(p), l));
#else
            for (int i = 0; i < DS_GROUP / 2; ++i) {
                o[2 * i] = lut[p[i] & 15];
                o[2 * i + 1] = lut[p[i] >> 4];
            }
#endif
        }
    }
}

/* ---- fused routed experts (small batches) ------------------------------------------------ */

enum { DS_ACT_SILU = 0, DS_ACT_SITU = 1 };

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* h = act(gate, up) from bf16-rounded gate/up, rounded to bf16 where torch's ops round:
 * SiTU computes in fp32 and rounds once; SiLU rounds silu(gate), then the product (vmath.h
 * functions: within 1 bf16 ulp of torch's). */
static inline float glu_situ(float g, float u, float beta, float lbeta) {
    float left = beta * ds_tanh(g / beta) * ds_sigmoid(g);
    return left * (lbeta > 0.f ? lbeta * ds_tanh(u / lbeta) : u);
}

static inline float glu_silu(float g, float u) { return round_bf16(g * ds_sigmoid(g)) * u; }

/* h[m * I + i0 + r] = bf16(glu(bf16(g), bf16(u))) for r < rows, m < M (g, u as expert_rows' acc):
 * valid entries are packed so the activation loop runs vectorised over them. */
static void glu_block(const float *g, const float *u, int rows, int M, int act, float beta, float lbeta,
                      uint16_t *h, int64_t I, int i0) {
    float gg[8 * DS_MAX_M], uu[8 * DS_MAX_M], hv[8 * DS_MAX_M];
    const int n = rows * M;
    for (int r = 0; r < rows; ++r)
        for (int m = 0; m < M; ++m) {
            gg[r * M + m] = round_bf16(g[r * DS_MAX_M + m]);
            uu[r * M + m] = round_bf16(u[r * DS_MAX_M + m]);
        }
    if (act == DS_ACT_SITU) {
        #pragma omp simd
        for (int t = 0; t < n; ++t) hv[t] = glu_situ(gg[t], uu[t], beta, lbeta);
    } else {
        #pragma omp simd
        for (int t = 0; t < n; ++t) hv[t] = glu_silu(gg[t], uu[t]);
    }
    for (int r = 0; r < rows; ++r)
        for (int m = 0; m < M; ++m) h[(int64_t)m * I + i0 + r] = f32_to_bf16(hv[r * M + m]);
}

/* acc[r * DS_MAX_M + m] = x[m] . w[row0 + r], r < R (R <= DS_ROWS(M)). */
static void expert_rows(const void *w, const uint8_t *s, int packed, int64_t row0, int R, int K,
                        const uint16_t *x, int M, float *acc) {
    if (!packed) {
        rows_bf16(x, M, K, (const uint16_t *)w + row0 * K, R, acc);
        return;
    }
    int r = 0;
#ifdef DS_AVX512BF16
    if (M <= 2)
        for (; r + 4 <= R; r += 4) {
            const uint8_t *wp = (const uint8_t *)w + (row0 + r) * (K / 2), *sp = s + (row0 + r) * (K / DS_GROUP);
            if (M == 1) rows4_mxfp4_avx(x, 1, K, wp, sp, acc + r * DS_MAX_M);
            else rows4_mxfp4_avx(x, 2, K, wp, sp, acc + r * DS_MAX_M);
        }
#endif
    for (; r < R; ++r)
        row_mxfp4(x, M, K, (const uint8_t *)w + (row0 + r) * (K / 2), s + (row0 + r) * (K / DS_GROUP),
                  acc + r * DS_MAX_M);
}

/* One chunk: up to DS_MAX_M pairs routed to one expert. With `shared` the caller is inside a
 * parallel region and the row loops are split across its threads (xg, h shared). */
static void moe_chunk(const uint16_t *x, int D, int I, int k, const int *count, const int *order,
                      int start, const int64_t *ids, int packed, const void *w1, const uint8_t *s1,
                      const void *w3, const uint8_t *s3, const void *w2, const uint8_t *s2, int act,
                      float beta, float lbeta, uint16_t *xg, uint16_t *h, uint16_t *ys, int shared) {
    const int e = (int)ids[order[start]];
    const int M = count[e + 1] - start < DS_MAX_M ? count[e + 1] - start : DS_MAX_M;
    const int R = DS_ROWS(M);
    const int nt = shared ? omp_get_num_threads() : 1, me = shared ? omp_get_thread_num() : 0;
    if (me == 0)
        for (int m = 0; m < M; ++m)
            memcpy(xg + (int64_t)m * D, x + (int64_t)(order[start + m] / k) * D, sizeof(uint16_t) * D);
    if (shared) {
        #pragma omp barrier
    }
    const int iblocks = (I + R - 1) / R, dblocks = (D + R - 1) / R;   /* contiguous share per thread */
    for (int i0 = R * (iblocks * me / nt); i0 < I && i0 < R * (iblocks * (me + 1) / nt); i0 += R) {
        float g[8 * DS_MAX_M], u[8 * DS_MAX_M];
        const int rows = I - i0 < R ? I - i0 : R;
        expert_rows(w1, s1, packed, (int64_t)e * I + i0, rows, D, xg, M, g);
        expert_rows(w3, s3, packed, (int64_t)e * I + i0, rows, D, xg, M, u);
        glu_block(g, u, rows, M, act, beta, lbeta, h, I, i0);
    }
    if (shared) {
        #pragma omp barrier
    }
    for (int d0 = R * (dblocks * me / nt); d0 < D && d0 < R * (dblocks * (me + 1) / nt); d0 += R) {
        float y[8 * DS_MAX_M];
        const int rows = D - d0 < R ? D - d0 : R;
        expert_rows(w2, s2, packed, (int64_t)e * D + d0, rows, I, h, M, y);
        for (int r = 0; r < rows; ++r)
            for (int m = 0; m < M; ++m)
                ys[(int64_t)order[start + m] * D + d0 + r] = f32_to_bf16(y[r * DS_MAX_M + m]);
    }
}

int ds_moe_combine(const uint16_t *ys, const int64_t *pos, const float *w, int64_t n, int k, int d,
                   uint16_t *out, int nthreads);   /* moe_prefill.c */

/* out[N, D] = sum_j wts[n, j] * bf16(w2_e @ act(w1_e x_n, w3_e x_n)), e = ids[n, j], the fp32
 * sum over j in slot order, rounded to bf16 once: the contract of ops.moe.grouped_experts.
 * Weights bf16 [E, I, D] / [E, D, I], or MXFP4 (packed=1: [E, I, D/2] + scales [E, I, D/32]).
 * Pairs are grouped by expert, so each expert's weights are read once per MAX_M pairs. */
int ds_moe_experts(const uint16_t *x, int N, int D, const int64_t *ids, const float *wts, int k,
                   int E, int I, int packed, const void *w1, const uint8_t *s1, const void *w3,
                   const uint8_t *s3, const void *w2, const uint8_t *s2, int act, float beta,
                   float lbeta, uint16_t *out, int nthreads) {
    const int P = N * k;
    int *count = calloc((size_t)E + 1, sizeof(int));
    int *order = malloc(sizeof(int) * (size_t)(P > 0 ? P : 1));
    int *chunk = malloc(sizeof(int) * (size_t)(P > 0 ? P : 1));   /* first pair of each chunk */
    uint16_t *ys = malloc(sizeof(uint16_t) * (size_t)P * D + 2);
    if (!count || !order || !chunk || !ys) {
        free(count); free(order); free(chunk); free(ys);
        return -1;
    }
    for (int p = 0; p < P; ++p) {
        if (ids[p] < 0 || ids[p] >= E) { free(count); free(order); free(chunk); free(ys); return -2; }
        count[ids[p] + 1]++;
    }
    for (int e = 0; e < E; ++e) count[e + 1] += count[e];
    int *fill = malloc(sizeof(int) * (size_t)(E > 0 ? E : 1));
    if (!fill) { free(count); free(order); free(chunk); free(ys); return -1; }
    memcpy(fill, count, sizeof(int) * (size_t)E);
    for (int p = 0; p < P; ++p) order[fill[ids[p]]++] = p;       /* stable: pair order kept */
    free(fill);
    int chunks = 0;                                              /* <= DS_MAX_M pairs, one expert */
    for (int e = 0; e < E; ++e)
        for (int start = count[e]; start < count[e + 1]; start += DS_MAX_M) chunk[chunks++] = start;
    int bad = 0;
    if (chunks >= 2 * nthreads) {
        /* Each thread runs whole chunks (gate/up, activation, down) in private scratch: one
         * fork/join for all of the step's experts. */
        #pragma omp parallel num_threads(nthreads) reduction(| : bad)
        {
            uint16_t *xg = malloc(sizeof(uint16_t) * (size_t)DS_MAX_M * D);
            uint16_t *h = malloc(sizeof(uint16_t) * (size_t)DS_MAX_M * I);
            if (!xg || !h) bad |= 1;
            #pragma omp for schedule(dynamic, 1)
            for (int c = 0; c < chunks; ++c)
                if (xg && h) moe_chunk(x, D, I, k, count, order, chunk[c], ids, packed, w1, s1, w3, s3, w2, s2,
                                       act, beta, lbeta, xg, h, ys, 0);
            free(xg);
            free(h);
        }
    } else {
        /* Few chunks (a lone dense MLP, tiny batches): every thread shares each chunk's rows. */
        uint16_t *xg = malloc(sizeof(uint16_t) * (size_t)DS_MAX_M * D);
        uint16_t *h = malloc(sizeof(uint16_t) * (size_t)DS_MAX_M * I);
        if (!xg || !h) bad = 1;
        for (int c = 0; c < chunks && !bad; ++c) {
            #pragma omp parallel num_threads(nthreads)
            moe_chunk(x, D, I, k, count, order, chunk[c], ids, packed, w1, s1, w3, s3, w2, s2, act, beta,
                      lbeta, xg, h, ys, 1);
        }
        free(xg);
        free(h);
    }
    if (!bad) ds_moe_combine(ys, NULL, wts, N, k, D, out, nthreads);
    free(count); free(order); free(chunk); free(ys);
    return bad ? -1 : 0;
}
