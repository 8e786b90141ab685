/* deltaserve CPU kernels: the fp32 dot-product and matmul helpers of the chunked KDA prefill
 * (kda_chunk.c); declarations and contracts in kda_chunk.h. */
#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include "ds_abi.h"
#include "kda_chunk.h"

/* (a . c, b . c) over n channels. */
void ds_kc_dot2(const float *a, const float *b, const float *c, int n, float *ra, float *rb) {
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
void ds_kc_dot2x4(const float *a, const float *b, const float *c, int64_t ldc, int n, float *ra, float *rb) {
#ifdef __AVX512F__
    __m512 sa[4], sb[4];
    KC_UNROLL(4) for (int j = 0; j < 4; ++j) sa[j] = sb[j] = _mm512_setzero_ps();
    for (int d = 0; d < n; d += 16) {
        const __mmask16 m = tail_mask(n - d);
        const __m512 av = _mm512_maskz_loadu_ps(m, a + d), bv = _mm512_maskz_loadu_ps(m, b + d);
        KC_UNROLL(4) for (int j = 0; j < 4; ++j) {
            const __m512 cv = _mm512_maskz_loadu_ps(m, c + j * ldc + d);
            sa[j] = _mm512_fmadd_ps(av, cv, sa[j]);
            sb[j] = _mm512_fmadd_ps(bv, cv, sb[j]);
        }
    }
    KC_UNROLL(4) for (int j = 0; j < 4; ++j) {
        ra[j] = _mm512_reduce_add_ps(sa[j]);
        rb[j] = _mm512_reduce_add_ps(sb[j]);
    }
#else
    for (int j = 0; j < 4; ++j) ds_kc_dot2(a, b, c + j * ldc, n, ra + j, rb + j);
#endif
}

#ifdef __AVX512F__
/* Rows a, b against columns c[0..7] (row stride ldc): ra[j] = a . c_j, rb[j] = b . c_j. The 16
 * accumulators are reduced together by a transposing add tree (lane j of the result: sum of
 * accumulator j), not one horizontal reduction each. */
void ds_kc_dot2x8(const float *a, const float *b, const float *c, int64_t ldc, int n, float *ra, float *rb) {
    __m512 v[16];
    KC_UNROLL(16) for (int j = 0; j < 16; ++j) v[j] = _mm512_setzero_ps();
    for (int d = 0; d < n; d += 16) {
        const __mmask16 m = tail_mask(n - d);
        const __m512 av = _mm512_maskz_loadu_ps(m, a + d), bv = _mm512_maskz_loadu_ps(m, b + d);
        KC_UNROLL(8) for (int j = 0; j < 8; ++j) {
            const __m512 cv = _mm512_maskz_loadu_ps(m, c + j * ldc + d);
            v[j] = _mm512_fmadd_ps(av, cv, v[j]);
            v[8 + j] = _mm512_fmadd_ps(bv, cv, v[8 + j]);
        }
    }
    KC_UNROLL(8) for (int j = 0; j < 8; ++j)     /* 128-bit lanes: [x y x y], x = v[2j], y = v[2j+1] */
        v[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
    KC_UNROLL(4) for (int j = 0; j < 4; ++j)     /* 128-bit lanes: sources 4j .. 4j+3 */
        v[j] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * j], v[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(v[2 * j], v[2 * j + 1], 0xEE));
    KC_UNROLL(2) for (int j = 0; j < 2; ++j)     /* 256-bit halves: sources 8j + 0..3, 8j + 4..7 */
        v[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xDD));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88), _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
    _mm256_storeu_ps(ra, _mm512_castps512_ps256(r));
    _mm256_storeu_ps(rb, _mm512_extractf32x8_ps(r, 1));
}
#endif

/* c[0..n) += sum_{d < D} coef[d] * B[d*ldb + 0..n). */
void ds_kc_row_acc(int n, int D, const float *coef, const float *B, int64_t ldb, float *c) {
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

#ifdef __AVX512F__
enum { MR = 6, NR = 64 };            /* register tile: MR rows x NR columns, 24 accumulators */

/* Rows i0 + [0, mr) (mr <= MR) and columns [0, nc) (nc <= NR) of mm's C, over d in [0, dend). */
static inline __attribute__((always_inline)) void mm_tile(int i0, int mr, int nc, int dend, const float *A,
                                                          int64_t ars, int64_t acs, const float *B, int64_t ldb,
                                                          float *C, int64_t ldc, const float *init, int64_t ldi,
                                                          const float *rs) {
    __mmask16 mk[4];
    KC_UNROLL(4) for (int u = 0; u < 4; ++u) mk[u] = nc - 16 * u <= 0 ? (__mmask16)0 : tail_mask(nc - 16 * u);
    int64_t off[MR];                   /* rows past mr repeat the last one; they are not stored */
    __m512 acc[MR][4];
    KC_UNROLL(8) for (int r = 0; r < MR; ++r) {
        const int i = i0 + (r < mr ? r : mr - 1);
        off[r] = (int64_t)i * ars;
        const __m512 sc = _mm512_set1_ps(rs ? rs[i] : 1.f);
        KC_UNROLL(4) for (int u = 0; u < 4; ++u)
            acc[r][u] = init ? _mm512_mul_ps(sc, _mm512_maskz_loadu_ps(mk[u], init + i * ldi + 16 * u))
                             : _mm512_setzero_ps();
    }
    for (int d = 0; d < dend; ++d) {
        const float *b = B + (int64_t)d * ldb, *ad = A + (int64_t)d * acs;
        const __m512 b0 = _mm512_maskz_loadu_ps(mk[0], b), b1 = _mm512_maskz_loadu_ps(mk[1], b + 16);
        const __m512 b2 = _mm512_maskz_loadu_ps(mk[2], b + 32), b3 = _mm512_maskz_loadu_ps(mk[3], b + 48);
        KC_UNROLL(8) for (int r = 0; r < MR; ++r) {
            const __m512 av = _mm512_set1_ps(ad[off[r]]);
            acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(av, b2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(av, b3, acc[r][3]);
        }
    }
    KC_UNROLL(8) for (int r = 0; r < MR; ++r)
        if (r < mr)
            KC_UNROLL(4) for (int u = 0; u < 4; ++u)
                _mm512_mask_storeu_ps(C + (i0 + r) * ldc + 16 * u, mk[u], acc[r][u]);
}
#endif

void ds_kc_mm(int M, int N, int D, const float *A, int64_t ars, int64_t acs, const float *B, int64_t ldb, float *C,
              int64_t ldc, const float *init, int64_t ldi, const float *rs, int tri, prefetch_queue *pq) {
#ifdef __AVX512F__
    for (int j0 = 0; j0 < N; j0 += NR)
        for (int i0 = 0; i0 < M; i0 += MR) {
            mm_tile(i0, M - i0 < MR ? M - i0 : MR, N - j0 < NR ? N - j0 : NR, tri && i0 + MR < D ? i0 + MR : D, A,
                    ars, acs, B + j0, ldb, C + j0, ldc, init ? init + j0 : NULL, ldi, rs);
            if (pq) prefetch_step(pq, pq->quota);
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
        if (pq) prefetch_step(pq, pq->quota);
    }
#endif
}

