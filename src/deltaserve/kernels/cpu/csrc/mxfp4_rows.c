/* deltaserve MXFP4 row kernels: x[m] . w[n] for M <= DS_MAX_M activation rows over MXFP4-packed
 * weight rows decoded in registers (ds_expert_rows: the routed experts' GEMV path, moe_decode.c / moe_row.c),
 * the exact MXFP4 -> bf16 dequantiser for large-M GEMMs, and the decode tables ds_init fills.
 *
 * Layout (spec/model.md §16): packed [N, K/2] uint8 with the LOW nibble the EARLIER element, scale
 * [N, K/32] uint8 E8M0 (2^(s-127)). fp32 accumulation; the AVX512-BF16 kernels sum each row's products
 * in the same chains as the bf16 kernels over the decoded weights (packed == dense, bit-identical);
 * the AVX2 (avx2.h) and portable paths agree up to summation order.
 */
#include <stdint.h>
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

#define DS_UNROLL(M) ((M) >= 4 ? 1 : 4 / (M))   /* accumulators per row along K (one row a pass) */

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
        ds_bf16_rows(x, M, K, (const uint16_t *)w + row0 * K, R, acc);
        return;
    }
    const uint8_t *p = (const uint8_t *)w + row0 * (K / 2);
    s += row0 * (K / DS_GROUP);
    int r = 0;
#ifdef DS_AVX512BF16
    for (const int nr = M <= 4 ? 4 : 3; r + nr <= R; r += nr) {   /* constant M and rows: registers */
        const uint8_t *wp = p + (int64_t)r * (K / 2), *sp = s + (int64_t)r * (K / DS_GROUP);
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
    if (ds_rows_mxfp4_avx2(x, M, K, p, s, R, acc) == 0)
        return;   /* else (no scratch): the portable rows, the same values up to summation order */
#endif
    for (; r < R; ++r)
        row_mxfp4(x, M, K, p + (int64_t)r * (K / 2), s + (int64_t)r * (K / DS_GROUP), acc + r * DS_MAX_M);
}
