/* deltaserve CPU kernels: small-M linear layers (batch-1..8 decode) for bf16 weights, the row
 * kernels of the fused routed experts (moe_decode.c) over bf16 or MXFP4-packed weights, and a fast
 * MXFP4 -> bf16 dequantiser for large-M (prefill) GEMMs.
 *
 * Every kernel computes y[m, n] = sum_k x[m, k] * w[n, k] with fp32 accumulation and writes
 * bf16 rounded to nearest-even (NaN kept quiet), the contract of torch's bf16 F.linear; only
 * the summation order differs. MXFP4 layout (spec/model.md §16): packed [N, K/2] uint8 with the
 * LOW nibble the EARLIER element, scale [N, K/32] uint8 E8M0 (2^(s-127)).
 * Built per ISA (build.py); without AVX512-BF16 the AVX2 + FMA kernels of avx2.h run (the `avx2`
 * build), below AVX2 the portable C path (same results up to summation order). Threads: OpenMP over
 * output rows, `nthreads` from torch.get_num_threads().
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "ds_abi.h"
#include "bf16.h"
#include "mxfp4.h"
#include "internal.h"
#include "avx2.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define DS_AVX512BF16 1
#endif

/* E2M1 code -> value; ds_scaled_lut[s][c] = bf16(E2M1[c] * 2^(s-127)), exact (truncation of an
 * exactly representable fp32 value; the top scales overflow to +-inf as the formula does). */
static const float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                               -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
uint16_t ds_scaled_lut[256][32];
#ifdef DS_AVX2
uint32_t ds_mx8[256][8];
#endif
/* Fills the tables; the loader calls it once before any kernel runs. */
void ds_init(void) {
    for (int s = 0; s < 256; ++s) {
        uint32_t bits = s == 0 ? 0x00400000u : (uint32_t)s << 23;   /* 2^-127 is subnormal */
        float sc;
        memcpy(&sc, &bits, 4);
        for (int c = 0; c < 32; ++c) {
            float v = E2M1[c & 15] * sc;
            uint32_t u;
            memcpy(&u, &v, 4);
            ds_scaled_lut[s][c] = (uint16_t)(u >> 16);
#ifdef DS_AVX2
            if (c < 8) ds_mx8[s][c] = u ^ (uint32_t)c << 28;
#endif
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
 * latency and keep R memory streams in flight); each row is prefetched DS_PREFETCH elements (8 KB)
 * ahead into L2 (T1). Against 512 B into L1 (T0), 512 MB of rows on AMD EPYC Zen 4 streaming ~60
 * GB/s: M = 2 24 -> 39-41 GB/s, M = 4 20 -> 42-43, M = 6 29 -> 35-37 (4 KB), M = 8 23 -> 32-33. */
#define DS_UNROLL(M) ((M) >= 4 ? 1 : 4 / (M))   /* MXFP4: accumulators per row along K */
#define DS_PREFETCH 4096

static inline __attribute__((always_inline)) void
rows_bf16_avx(const uint16_t *x, const int M, int K, const uint16_t *w, const int R, float *acc) {
    __m512 a[8][DS_MAX_M];
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) a[r][m] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        for (int r = 0; r < R; ++r) {
            const uint16_t *wr = w + (int64_t)r * K + k;
            _mm_prefetch((const char *)(wr + DS_PREFETCH), _MM_HINT_T1);
            __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)wr);
            for (int m = 0; m < M; ++m) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (int64_t)m * K + k));
                a[r][m] = _mm512_dpbf16_ps(a[r][m], wv, xv);
            }
        }
    }
    __m512 v[16];
    float sums[16];
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) v[r * M + m] = a[r][m];
    ds_reduce_add_n(v, R * M, sums);   /* R * M <= 8: R is DS_ROWS(M) or 1 */
    for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) {
            float s = sums[r * M + m];
            for (int j = k; j < K; ++j) s += bf16_to_f32(x[(int64_t)m * K + j]) * bf16_to_f32(w[(int64_t)r * K + j]);
            acc[r * DS_MAX_M + m] = s;
        }
}

/* M = 1: the R rows one after another, so each thread reads its weights as ONE sequential stream
 * (interleaving the rows along K made R short streams, which the hardware prefetchers follow worse),
 * prefetched DS_SEQ_PREFETCH elements (4 KB) ahead into L2 (hint T1: the same distance into L1 read
 * 40 GB/s where T1 reads 49-53 on a host streaming ~62, AMD EPYC Zen 4). Each row's sum is the same
 * chain of products as rows_bf16_avx's (bit-identical results); its latency is far below a row's
 * memory time. */
#define DS_SEQ_PREFETCH 2048
static inline __attribute__((always_inline)) void
rows_bf16_seq1(const uint16_t *x, int K, const uint16_t *w, const int R, float *acc) {
    for (int r = 0; r < R; ++r) {
        const uint16_t *wr = w + (int64_t)r * K;
        __m512 a = _mm512_setzero_ps();
        int k = 0;
        for (; k + 32 <= K; k += 32) {
            _mm_prefetch((const char *)((uintptr_t)(wr + k) + 2 * DS_SEQ_PREFETCH), _MM_HINT_T1);
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512((const void *)(wr + k)),
                                 (__m512bh)_mm512_loadu_si512((const void *)(x + k)));
        }
        float s = _mm512_reduce_add_ps(a);
        for (int j = k; j < K; ++j) s += bf16_to_f32(x[j]) * bf16_to_f32(wr[j]);
        acc[r * DS_MAX_M] = s;
    }
}
#endif

/* acc[r * DS_MAX_M + m] = x[m] . w[r] for r < R; R is DS_ROWS(M) or fewer at the matrix end. */
static void rows_bf16(const uint16_t *x, int M, int K, const uint16_t *w, int R, float *acc) {
#ifdef DS_AVX512BF16
    if (R == DS_ROWS(M)) {
        switch (M) {   /* constant M and R so the accumulators live in registers */
        case 1: rows_bf16_seq1(x, K, w, 8, acc); return;
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
#elif defined(DS_AVX2)
    ds_rows_bf16_avx2(x, M, K, w, R, acc);
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
 * out together, so small projections share the threads' memory streams. Returns -1 if nw > DS_MAX_MULTI. */
int ds_linear_bf16_multi(const uint16_t *x, int M, int K, const uint16_t *const *w, const int *N,
                         const int *f32, void *const *y, int nw, int nthreads) {
    enum { MAXW = DS_MAX_MULTI };
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
        const uint16_t *lut = ds_scaled_lut[s[g]];
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
static inline __attribute__((always_inline)) void
row_mxfp4_avx(const uint16_t *x, const int M, int K, const uint8_t *p, const uint8_t *s, float *acc) {
    const int U = DS_UNROLL(M), groups = K / DS_GROUP;
    __m512 a[4][DS_MAX_M];
    for (int u = 0; u < U; ++u)
        for (int m = 0; m < M; ++m) a[u][m] = _mm512_setzero_ps();
    int g = 0;
    for (; g + U <= groups; g += U) {
        for (int u = 0; u < U; ++u) {
            __m512bh wv = (__m512bh)mxfp4_group(p + (g + u) * (DS_GROUP / 2), s[g + u]);
            for (int m = 0; m < M; ++m) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (int64_t)m * K + (g + u) * DS_GROUP));
                a[u][m] = _mm512_dpbf16_ps(a[u][m], wv, xv);
            }
        }
    }
    for (; g < groups; ++g) {
        __m512bh wv = (__m512bh)mxfp4_group(p + g * (DS_GROUP / 2), s[g]);
        for (int m = 0; m < M; ++m) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (int64_t)m * K + g * DS_GROUP));
            a[0][m] = _mm512_dpbf16_ps(a[0][m], wv, xv);
        }
    }
    for (int m = 0; m < M; ++m)
        for (int u = 1; u < U; ++u) a[0][m] = _mm512_add_ps(a[0][m], a[u][m]);
    ds_reduce_add_n(a[0], M, acc);
}
/* NR consecutive rows at once (NR * M <= 16 accumulator chains, independent; M <= 4): each group's activations
 * are loaded once for the NR rows. acc as rows_bf16. The packed rows DS_MX_PREFETCH_ROWS ahead are
 * prefetched (measured ~15% faster on DRAM-resident experts). */
#define DS_MX_PREFETCH_ROWS 16
static inline __attribute__((always_inline)) void
rows_mxfp4_avx(const uint16_t *x, const int M, int K, const uint8_t *p, const uint8_t *s, const int NR, float *acc) {
    const int groups = K / DS_GROUP;
    __m512 a[4][DS_MAX_M];
    for (int r = 0; r < NR; ++r)
        for (int m = 0; m < M; ++m) a[r][m] = _mm512_setzero_ps();
    for (int g = 0; g < groups; ++g) {
        __m512bh xv[DS_MAX_M];
        for (int m = 0; m < M; ++m)
            xv[m] = (__m512bh)_mm512_loadu_si512((const void *)(x + (int64_t)m * K + g * DS_GROUP));
        if (g % 4 == 0)   /* one line per row every 4 groups; addresses past the matrix are harmless hints */
            for (int r = 0; r < NR; ++r)
                _mm_prefetch((const char *)((uintptr_t)p + (uintptr_t)((r + DS_MX_PREFETCH_ROWS) * (K / 2) + g * 16)),
                             _MM_HINT_T0);
        for (int r = 0; r < NR; ++r) {
            const __m512bh wv = (__m512bh)mxfp4_group(p + (int64_t)r * (K / 2) + g * (DS_GROUP / 2),
                                                      s[(int64_t)r * groups + g]);
            for (int m = 0; m < M; ++m) a[r][m] = _mm512_dpbf16_ps(a[r][m], wv, xv[m]);
        }
    }
    __m512 v[4 * DS_MAX_M];
    float sums[4 * DS_MAX_M];
    for (int r = 0; r < NR; ++r)
        for (int m = 0; m < M; ++m) v[r * M + m] = a[r][m];
    ds_reduce_add_n(v, NR * M, sums);   /* NR * M <= 16 */
    for (int r = 0; r < NR; ++r)
        for (int m = 0; m < M; ++m) acc[r * DS_MAX_M + m] = sums[r * M + m];
}
/* Five to eight activation rows: three weight rows a pass (up to 24 accumulators), each group's three
 * rows decoded into registers, then each activation row loaded once beside them (holding all M
 * activations as above left room for only two rows: more loads a product, on a core that loads ~0.8
 * zmm a cycle; Zen 4, 1.07-1.14x at 5-8 rows). Each sum is the same chain as above (bit-identical). */
static inline __attribute__((always_inline)) void
rows3_mxfp4_avx(const uint16_t *x, const int M, int K, const uint8_t *p, const uint8_t *s, float *acc) {
    const int groups = K / DS_GROUP;
    __m512 a[3][DS_MAX_M];
    for (int r = 0; r < 3; ++r)
        for (int m = 0; m < M; ++m) a[r][m] = _mm512_setzero_ps();
    for (int g = 0; g < groups; ++g) {
        if (g % 4 == 0)
            for (int r = 0; r < 3; ++r)
                _mm_prefetch((const char *)((uintptr_t)p + (uintptr_t)((r + DS_MX_PREFETCH_ROWS) * (K / 2) + g * 16)),
                             _MM_HINT_T0);
        __m512bh wv[3];
        for (int r = 0; r < 3; ++r)
            wv[r] = (__m512bh)mxfp4_group(p + (int64_t)r * (K / 2) + g * (DS_GROUP / 2), s[(int64_t)r * groups + g]);
        for (int m = 0; m < M; ++m) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (int64_t)m * K + g * DS_GROUP));
            for (int r = 0; r < 3; ++r) a[r][m] = _mm512_dpbf16_ps(a[r][m], wv[r], xv);
        }
    }
    for (int r = 0; r < 3; ++r) ds_reduce_add_n(a[r], M, acc + r * DS_MAX_M);
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
            uint16_t *o = out + n * K + g * DS_GROUP;
#ifdef DS_AVX512BF16
            _mm512_storeu_si512((void *)o, mxfp4_group(p, scale[n * groups + g]));
#else
            const uint16_t *lut = ds_scaled_lut[scale[n * groups + g]];
            for (int i = 0; i < DS_GROUP / 2; ++i) {
                o[2 * i] = lut[p[i] & 15];
                o[2 * i + 1] = lut[p[i] >> 4];
            }
#endif
        }
    }
}

/* acc[r * DS_MAX_M + m] = x[m] . w[row0 + r], r < R (R <= DS_ROWS(M), or DS_MX_ROWS(M) when packed). */
void ds_expert_rows(const void *w, const uint8_t *s, int packed, int64_t row0, int R, int K,
                    const uint16_t *x, int M, float *acc) {
    if (!packed) {
        rows_bf16(x, M, K, (const uint16_t *)w + row0 * K, R, acc);
        return;
    }
    int r = 0;
#ifdef DS_AVX512BF16
    for (const int nr = M <= 4 ? 4 : 3; r + nr <= R; r += nr) {   /* constant M and rows: registers */
        const uint8_t *wp = (const uint8_t *)w + (row0 + r) * (K / 2), *sp = s + (row0 + r) * (K / DS_GROUP);
        float *ar = acc + r * DS_MAX_M;
        switch (M) {
        case 1: rows_mxfp4_avx(x, 1, K, wp, sp, 4, ar); break;
        case 2: rows_mxfp4_avx(x, 2, K, wp, sp, 4, ar); break;
        case 3: rows_mxfp4_avx(x, 3, K, wp, sp, 4, ar); break;
        case 4: rows_mxfp4_avx(x, 4, K, wp, sp, 4, ar); break;
        case 5: rows3_mxfp4_avx(x, 5, K, wp, sp, ar); break;
        case 6: rows3_mxfp4_avx(x, 6, K, wp, sp, ar); break;
        case 7: rows3_mxfp4_avx(x, 7, K, wp, sp, ar); break;
        default: rows3_mxfp4_avx(x, 8, K, wp, sp, ar); break;
        }
    }
#elif defined(DS_AVX2)
    if (ds_rows_mxfp4_avx2(x, M, K, (const uint8_t *)w + row0 * (K / 2), s + row0 * (K / DS_GROUP), R, acc) == 0)
        return;   /* else (no scratch): the portable rows, the same values up to summation order */
#endif
    for (; r < R; ++r)
        row_mxfp4(x, M, K, (const uint8_t *)w + (row0 + r) * (K / 2), s + (row0 + r) * (K / DS_GROUP),
                  acc + r * DS_MAX_M);
}

