/* deltaserve CPU kernel: the score passes of the MLA decode attention (mla_decode.c): q_h . row_j
 * for every head h and context row j of a chunk, on `vdpbf16ps` over the bf16 queries (D % 32 == 0)
 * or in fp32 over the queries' fp32 copies (D % 16 == 0, H | 16), 16 (row, head) pairs at a time.
 * Each dot product's chain and reduction are fixed, so a row's scores are the same alone and in any
 * batch (bit-identical). */
#ifndef DELTASERVE_MLA_SCORES_H
#define DELTASERVE_MLA_SCORES_H
#include <stdint.h>
#include "ds_abi.h"
#include "internal.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ML_AVX512BF16 1
#endif

#define MLA_CHUNK 256
#define ML_GROUP 8   /* heads whose 32-column accumulators share the registers (16 of 32 zmm) */

#ifdef ML_AVX512BF16
/* The sums of 8 vectors, one each (halves added, then a horizontal-add tree). */
static inline void ml_sum8(const __m512 *a, float *out) {
    __m256 y[8];
    for (int k = 0; k < 8; ++k)
        y[k] = _mm256_add_ps(_mm512_castps512_ps256(a[k]),
                             _mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(a[k]), 1)));
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(y[0], y[1]), _mm256_hadd_ps(y[2], y[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(y[4], y[5]), _mm256_hadd_ps(y[6], y[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
}

/* dots[b][h] = q_h . r[b] for the NB rows r (D % 32 == 0): each query load feeds NB dot products. One
 * row a pass took ~1.1 zmm loads a `vdpbf16ps` (the 8 heads' query chunks and the row's), on a core
 * that loads ~0.8 zmm a cycle (Zen 4): the loads, not the dot products, bound it. Each row's sums are
 * the same chain of products and the same reduction as alone (bit-identical). */
static inline __attribute__((always_inline)) void ml_scores(const uint16_t *qb, int H, int D,
                                                           const uint16_t *const *r, const int NB,
                                                           float (*dots)[DS_MLA_MAX_HEADS]) {
    int h = 0;
    for (; h + ML_GROUP <= H; h += ML_GROUP) {   /* 8 heads per pass: each row chunk is loaded once */
        __m512 acc[3][ML_GROUP];
        for (int b = 0; b < NB; ++b)
            for (int k = 0; k < ML_GROUP; ++k) acc[b][k] = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 32) {
            __m512bh x[3];
            for (int b = 0; b < NB; ++b) x[b] = (__m512bh)_mm512_loadu_si512(r[b] + d);
            for (int k = 0; k < ML_GROUP; ++k) {
                const __m512bh q = (__m512bh)_mm512_loadu_si512(qb + (int64_t)(h + k) * D + d);
                for (int b = 0; b < NB; ++b) acc[b][k] = _mm512_dpbf16_ps(acc[b][k], q, x[b]);
            }
        }
        for (int b = 0; b < NB; ++b) ml_sum8(acc[b], dots[b] + h);
    }
    for (; h < H; ++h) {
        const uint16_t *qh = qb + (int64_t)h * D;
        for (int b = 0; b < NB; ++b) {
            __m512 a = _mm512_setzero_ps(), c = _mm512_setzero_ps();
            int d = 0;
            for (; d + 64 <= D; d += 64) {
                a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qh + d), (__m512bh)_mm512_loadu_si512(r[b] + d));
                c = _mm512_dpbf16_ps(c, (__m512bh)_mm512_loadu_si512(qh + d + 32),
                                     (__m512bh)_mm512_loadu_si512(r[b] + d + 32));
            }
            if (d < D)
                a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qh + d), (__m512bh)_mm512_loadu_si512(r[b] + d));
            dots[b][h] = _mm512_reduce_add_ps(_mm512_add_ps(a, c));
        }
    }
}
#endif

#ifdef ML_AVX512BF16
/* The fp32 scores (D % 16 == 0 and H | 16, not the vdpbf16ps path): s[h * MLA_CHUNK + j] = scale *
 * dot_f32(q_h, row_j) for the n rows of idx and every head, bit for bit: each (row, head) pair keeps
 * dot_f32's 16 lane sums (products then adds, in d order), each row block converted once for its H
 * heads; 16 / H rows at a time, their 16 pairs' lane sums are transposed and added lane after lane in
 * dot_f32's order (one vector add a lane, instead of 16 dependent scalar adds a pair). */
static inline __attribute__((always_inline)) void ml_scores_f32(const float *qf, const int H, int D,
                                                               const uint16_t *rows, const int64_t *idx, int n,
                                                               float scale, float *s) {
    const int P = 16 / H;
    const __m512 sc = _mm512_set1_ps(scale);
    float dot[16] __attribute__((aligned(64)));
    for (int j0 = 0; j0 < n; j0 += P) {
        const int np = n - j0 < P ? n - j0 : P;
        const uint16_t *r[16];
        for (int p = 0; p < P; ++p) r[p] = rows + idx[j0 + (p < np ? p : 0)] * (int64_t)D;   /* past np: unused */
        __m512 acc[16];
        __m512i lanes[16];
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 16)
            for (int p = 0; p < P; ++p) {
                const __m256i b = _mm256_loadu_si256((const __m256i *)(r[p] + d));
                const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
                for (int h = 0; h < H; ++h)
                    acc[p * H + h] = _mm512_add_ps(acc[p * H + h], _mm512_mul_ps(_mm512_loadu_ps(qf + h * D + d), x));
            }
        for (int i = 0; i < 16; ++i) lanes[i] = _mm512_castps_si512(acc[i]);
        ds_transpose16(lanes);   /* lanes[l] lane i: pair i's lane sum l */
        __m512 sum = _mm512_setzero_ps();
        for (int l = 0; l < 16; ++l) sum = _mm512_add_ps(sum, _mm512_castsi512_ps(lanes[l]));
        _mm512_store_ps(dot, _mm512_mul_ps(sc, sum));
        for (int p = 0; p < np; ++p)
            for (int h = 0; h < H; ++h) s[h * MLA_CHUNK + j0 + p] = dot[p * H + h];
    }
}

/* ml_scores_f32 for H in {1, 2, 4, 8, 16} (constant H: the accumulators stay in registers); 0 for
 * other H (the caller computes the scores row by row). */
static int ml_scores_pairs(const float *qf, int H, int D, const uint16_t *rows, const int64_t *idx, int n,
                           float scale, float *s) {
    switch (H) {
    case 1: ml_scores_f32(qf, 1, D, rows, idx, n, scale, s); return 1;
    case 2: ml_scores_f32(qf, 2, D, rows, idx, n, scale, s); return 1;
    case 4: ml_scores_f32(qf, 4, D, rows, idx, n, scale, s); return 1;
    case 8: ml_scores_f32(qf, 8, D, rows, idx, n, scale, s); return 1;
    case 16: ml_scores_f32(qf, 16, D, rows, idx, n, scale, s); return 1;
    default: return 0;
    }
}
#endif

#endif
