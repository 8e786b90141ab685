/* AVX2 + FMA row kernels (the `avx2` build, -march=x86-64-v3: no AVX-512) behind rows_bf16 and
 * ds_expert_rows (cpu_kernels.c, mxfp4_rows.c), for CPUs without AVX512-BF16.
 *
 * bf16 -> fp32 by shifts: a 16-element block loads as 8 dwords (pairs), `<< 16` gives the even
 * elements and `& 0xffff0000` the odd ones, each as 8 fp32 lanes. Each (weight row, activation row)
 * dot product has ONE fixed summation order, whatever M, R or the weights' format:
 *   a[0] += w_e * x_e and a[1] += w_o * x_o over the first 16 elements of every 32-element block,
 *   a[2], a[3] the same over its second 16 (a lone trailing 16-block goes to a[0], a[1]);
 *   sum = hsum((a[0] + a[2]) + (a[1] + a[3])), then the K % 16 tail in order, scalar.
 * An MXFP4 group (32 elements) is one such block, decoded to the exact fp32 values of the bf16
 * ds_scaled_lut holds (an 8-entry fp32 table per scale, indexed by vpermd, the sign by an XOR),
 * so packed and decoded weights give bit-identical sums, and one token's row is the batch's
 * (tests/ops/test_cpu_kernels.py and tests/kernels/test_isa.py hold both). At most 2 (weight row,
 * activation row) dot products run together (8 accumulators stay in registers): bf16 weight rows one
 * after another (one sequential stream) with activation rows in pairs; MXFP4 rows in pairs against
 * one activation row (its split fp32 copy in cache), or, for more activation rows, each weight row
 * decoded once to fp32 and the activation rows in pairs over it.
 * L2-resident, one thread (AMD EPYC Zen 4): bf16 40 GB/s, MXFP4 ~7.6 GB/s at M = 1 (~8 cycles a group;
 * the AVX512-BF16 kernels: ~3.5).
 */
#ifndef DELTASERVE_AVX2_H
#define DELTASERVE_AVX2_H
#include <stdint.h>
#include <stdlib.h>
#include "bf16.h"
#include "ds_abi.h"

#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512BF16__) && defined(__AVX512BW__))
#define DS_AVX2 1
#include <immintrin.h>

/* ds_mx8[s][j] = the bits of E2M1[j] * 2^(s-127) (j < 8, the magnitudes; exactly the values of
 * ds_scaled_lut[s]) XOR j << 28: a nibble c looked up by its low 3 bits (vpermd) and XORed with c << 28
 * gets those bits back and c's sign bit (bit 3) into bit 31. Filled by ds_init (mxfp4_rows.c). */
extern uint32_t ds_mx8[256][8];

/* The 16 bf16 at p as fp32: *e = elements 0, 2, .., 14, *o = 1, 3, .., 15. */
static inline void ds_split16(const uint16_t *p, __m256 *e, __m256 *o) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *o = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

static inline float ds_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One MXFP4 group (16 packed bytes, scale byte s) as ds_split16 lays out its two 16-blocks:
 * v[0], v[1] = even, odd elements of 0..15; v[2], v[3] = those of 16..31. Exact (see above). */
static inline void ds_mxfp4_group8(const uint8_t *p, uint8_t s, __m256 v[4]) {
    const __m256i t = _mm256_loadu_si256((const __m256i *)ds_mx8[s]);
    for (int h = 0; h < 2; ++h) {
        const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h)));   /* byte i: dword i */
        const __m256i hi = _mm256_srli_epi32(lo, 4);
        v[2 * h] = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_permutevar8x32_epi32(t, lo), _mm256_slli_epi32(lo, 28)));
        v[2 * h + 1] = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_permutevar8x32_epi32(t, hi), _mm256_slli_epi32(hi, 28)));
    }
}

/* a[m][..] += the block products of weights v[4] (one 32-block) with x[m][k..k+32), m < MM. */
static inline __attribute__((always_inline)) void
ds_fma32(const uint16_t *x, int64_t K, const int MM, int k, const __m256 v[4], __m256 a[][4]) {
    for (int m = 0; m < MM; ++m) {
        __m256 xe, xo;
        ds_split16(x + m * K + k, &xe, &xo);
        a[m][0] = _mm256_fmadd_ps(v[0], xe, a[m][0]);
        a[m][1] = _mm256_fmadd_ps(v[1], xo, a[m][1]);
        ds_split16(x + m * K + k + 16, &xe, &xo);
        a[m][2] = _mm256_fmadd_ps(v[2], xe, a[m][2]);
        a[m][3] = _mm256_fmadd_ps(v[3], xo, a[m][3]);
    }
}

#define DS_AVX2_PREFETCH 2048   /* bf16 rows: bytes ahead of the read */

/* out[m] = x[m] . w for m < MM (1 or 2), x rows K apart; w one bf16 row of K. */
static inline __attribute__((always_inline)) void
ds_row_bf16_avx2(const uint16_t *x, const int MM, int K, const uint16_t *w, float *out) {
    __m256 a[2][4], v[4];
    for (int m = 0; m < MM; ++m)
        for (int j = 0; j < 4; ++j) a[m][j] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch((const char *)(w + k) + DS_AVX2_PREFETCH, _MM_HINT_T0);
        ds_split16(w + k, &v[0], &v[1]);
        ds_split16(w + k + 16, &v[2], &v[3]);
        ds_fma32(x, K, MM, k, v, a);
    }
    if (k + 16 <= K) {
        ds_split16(w + k, &v[0], &v[1]);
        for (int m = 0; m < MM; ++m) {
            __m256 xe, xo;
            ds_split16(x + (int64_t)m * K + k, &xe, &xo);
            a[m][0] = _mm256_fmadd_ps(v[0], xe, a[m][0]);
            a[m][1] = _mm256_fmadd_ps(v[1], xo, a[m][1]);
        }
        k += 16;
    }
    for (int m = 0; m < MM; ++m) {
        float s = ds_hsum8(_mm256_add_ps(_mm256_add_ps(a[m][0], a[m][2]), _mm256_add_ps(a[m][1], a[m][3])));
        for (int j = k; j < K; ++j) s += bf16_to_f32(x[(int64_t)m * K + j]) * bf16_to_f32(w[j]);
        out[m] = s;
    }
}

/* The same over NR MXFP4 rows (NR * MM <= 2 rows x activation rows, so 8 independent FMA chains):
 * p their packed bytes (K/2 a row), s their scales (K/32 a row), K % 32 == 0; xf the MM activation rows
 * already split (ds_split16 of each 16-block stored as its 8 even then 8 odd floats, rows K floats
 * apart), so each weight group is decoded once and the FMAs take their other operand from cache.
 * out[r * DS_MAX_M + m]. */
static inline __attribute__((always_inline)) void
ds_rows_mxfp4_kern(const float *xf, const int MM, const int NR, int K, const uint8_t *p, const uint8_t *s,
                   float *out) {
    __m256 a[2][4], v[4];
    const int groups = K / DS_GROUP;
    for (int i = 0; i < NR * MM; ++i)
        for (int j = 0; j < 4; ++j) a[i][j] = _mm256_setzero_ps();
    for (int g = 0; g < groups; ++g)
        for (int r = 0; r < NR; ++r) {
            const uint8_t *pg = p + (int64_t)r * (K / 2) + g * (DS_GROUP / 2);
            if (g % 4 == 0) _mm_prefetch((const char *)pg + 1024, _MM_HINT_T0);
            ds_mxfp4_group8(pg, s[(int64_t)r * groups + g], v);
            for (int m = 0; m < MM; ++m) {
                const float *xg = xf + (int64_t)m * K + g * DS_GROUP;
                for (int j = 0; j < 4; ++j)
                    a[r * MM + m][j] = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(xg + 8 * j), a[r * MM + m][j]);
            }
        }
    for (int r = 0; r < NR; ++r)
        for (int m = 0; m < MM; ++m) {
            const __m256 *q = a[r * MM + m];
            out[r * DS_MAX_M + m] = ds_hsum8(_mm256_add_ps(_mm256_add_ps(q[0], q[2]), _mm256_add_ps(q[1], q[3])));
        }
}

/* acc[r * DS_MAX_M + m] = x[m] . w[r] for r < R, m < M: rows one after another (one sequential
 * stream), activation rows two at a time. */
static inline void ds_rows_bf16_avx2(const uint16_t *x, int M, int K, const uint16_t *w, int R, float *acc) {
    for (int r = 0; r < R; ++r) {
        const uint16_t *wr = w + (int64_t)r * K;
        int m = 0;
        for (; m + 2 <= M; m += 2) ds_row_bf16_avx2(x + (int64_t)m * K, 2, K, wr, acc + r * DS_MAX_M + m);
        if (m < M) ds_row_bf16_avx2(x + (int64_t)m * K, 1, K, wr, acc + r * DS_MAX_M + m);
    }
}

/* The same with the weight row already decoded to the split layout (wf, K floats): MM activation rows. */
static inline __attribute__((always_inline)) void
ds_row_split_kern(const float *xf, const int MM, int K, const float *wf, float *out) {
    __m256 a[2][4];
    for (int m = 0; m < MM; ++m)
        for (int j = 0; j < 4; ++j) a[m][j] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += DS_GROUP)
        for (int j = 0; j < 4; ++j) {
            const __m256 v = _mm256_loadu_ps(wf + k + 8 * j);
            for (int m = 0; m < MM; ++m) a[m][j] = _mm256_fmadd_ps(v, _mm256_loadu_ps(xf + (int64_t)m * K + k + 8 * j), a[m][j]);
        }
    for (int m = 0; m < MM; ++m)
        out[m] = ds_hsum8(_mm256_add_ps(_mm256_add_ps(a[m][0], a[m][2]), _mm256_add_ps(a[m][1], a[m][3])));
}

#define DS_AVX2_XF 8192   /* stack floats for split activations (and one decoded weight row when M > 1) */

/* The same over MXFP4 rows (packed p [R, K/2], scales s [R, K/32]), the activations split once a call.
 * One activation row takes the weight rows in pairs, decoding as it goes; more decode each weight row
 * once into the split layout and take the activation rows in pairs over it, as many activation rows a
 * pass as the stack holds (the heap only where not even one fits: K > DS_AVX2_XF / 2). Returns 0, or -1
 * (nothing written) where that heap scratch cannot be had: the caller then runs the portable rows. */
static inline int ds_rows_mxfp4_avx2(const uint16_t *x, int M, int K, const uint8_t *p, const uint8_t *s, int R,
                                     float *acc) {
    float stack[DS_AVX2_XF], *xf = stack;
    const int dec = M > 1 ? K : 0;   /* floats of the decoded row */
    int per = K + dec <= DS_AVX2_XF ? (DS_AVX2_XF - dec) / K : 0;   /* activation rows a pass */
    if (per == 0) {
        if (!(xf = malloc(sizeof(float) * (size_t)(K + dec)))) return -1;
        per = 1;
    }
    const int64_t rb = K / 2, sb = K / DS_GROUP;
    for (int m0 = 0; m0 < M; m0 += per) {
        const int mm = M - m0 < per ? M - m0 : per;
        for (int64_t i = 0; i < (int64_t)mm * K; i += 16) {
            __m256 e, o;
            ds_split16(x + (int64_t)m0 * K + i, &e, &o);
            _mm256_storeu_ps(xf + i, e);
            _mm256_storeu_ps(xf + i + 8, o);
        }
        int r = 0;
        if (M == 1) {
            for (; r + 2 <= R; r += 2) ds_rows_mxfp4_kern(xf, 1, 2, K, p + r * rb, s + r * sb, acc + r * DS_MAX_M);
            if (r < R) ds_rows_mxfp4_kern(xf, 1, 1, K, p + r * rb, s + r * sb, acc + r * DS_MAX_M);
            continue;
        }
        float *wf = xf + (int64_t)mm * K;
        for (; r < R; ++r) {
            for (int g = 0; g < K / DS_GROUP; ++g) {
                __m256 v[4];
                ds_mxfp4_group8(p + r * rb + g * (DS_GROUP / 2), s[r * sb + g], v);
                for (int j = 0; j < 4; ++j) _mm256_storeu_ps(wf + g * DS_GROUP + 8 * j, v[j]);
            }
            float *ar = acc + r * DS_MAX_M + m0;
            int m = 0;
            for (; m + 2 <= mm; m += 2) ds_row_split_kern(xf + (int64_t)m * K, 2, K, wf, ar + m);
            if (m < mm) ds_row_split_kern(xf + (int64_t)m * K, 1, K, wf, ar + m);
        }
    }
    if (xf != stack) free(xf);
    return 0;
}
#endif

#endif
