/* Declarations shared between the deltaserve kernel files, not part of the ctypes ABI (that is
 * ds_abi.h, whose kernels the whole-block kernels of blocks.c also compose). */
#ifndef DELTASERVE_INTERNAL_H
#define DELTASERVE_INTERNAL_H
#include <math.h>
#include <stdint.h>
#include "ds_abi.h"
#include "bf16.h"

/* Split attention's merge (flash-decoding): S partials [max, sum, acc(n)] `stride` floats apart (the
 * max in natural-log units, or log2 with `base2`; a max of -inf weighs 0), combined in order by
 * their maxima into acc[n] = sum_s w_s acc_s / sum_s w_s sum_s (acc: n floats), written as bf16 to
 * `out` unless NULL; *lse (unless NULL) = the log-sum-exp of every partial's scores (natural log;
 * -inf, acc all 0, where no partial saw a score). ds_mla_decode's chunks, ds_flash_attention's spans. */
static inline void ds_merge_partials(const float *p, int64_t stride, int64_t S, int n, int base2, float *acc,
                                     uint16_t *out, float *lse) {
    float mx = -INFINITY, l = 0.f;
    for (int64_t s = 0; s < S; ++s) mx = fmaxf(mx, p[s * stride]);
    for (int d = 0; d < n; ++d) acc[d] = 0.f;
    for (int64_t s = 0; s < S; ++s) {
        const float *ps = p + s * stride;
        const float w = ps[0] == -INFINITY ? 0.f : (base2 ? exp2f(ps[0] - mx) : expf(ps[0] - mx));
        l += w * ps[1];
        for (int d = 0; d < n; ++d) acc[d] += w * ps[2 + d];
    }
    if (l > 0.f)
        for (int d = 0; d < n; ++d) acc[d] /= l;
    if (out)
        for (int d = 0; d < n; ++d) out[d] = f32_to_bf16(acc[d]);
    if (lse) *lse = l > 0.f ? (base2 ? mx * 0.6931471805599453f : mx) + logf(l) : -INFINITY;
}

/* The tensor-parallel sum ds_decode_stack calls back (ds_stack_t.reduce) where a layer's output is this
 * rank's partial sum: partial [n] bf16 becomes the sum over the ranks of every rank's partial, plus
 * `replicated` [n] (equal on every rank, added once; NULL: none), in place. Returns 0, else nonzero
 * (the collective failed). The caller's Python does the arithmetic (ParallelContext.all_reduce /
 * reduce_sum), so the bits are the module path's. */
typedef int (*ds_reduce_fn)(uint16_t *partial, const uint16_t *replicated, int64_t n);

/* The attention of decoder layer `layer` that ds_decode_stack calls back where the layer has no block
 * plan (decode context parallelism's MLA): out [N, D] = the layer's attention output of its normed input
 * x [N, D], every rank's share summed (the caller's module runs it). Returns 0, else nonzero. */
typedef int (*ds_attend_fn)(int layer, const uint16_t *x, int64_t rows, uint16_t *out);

/* blocks.c: ds_moe_block of a tensor-parallel rank (reduce non-NULL: experts split by width) whose
 * output is the whole block's, summed over the ranks: the routed sum reduced before the latent norm
 * where there is one (the shared experts' partial joined to the replicated routed output then),
 * else the block's partial output reduced once. reduce NULL: ds_moe_block. -5: a reduce failed. */
int ds_moe_block_reduced(const ds_moe_block_t *b, const uint16_t *x, int N, ds_reduce_fn reduce, uint16_t *out,
                         int nthreads);

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* weight rows per pass of the DS_MAX_M kernels: up to 16 accumulators (M = 1: 8 rows in sequence) */
#define DS_ROWS(M) ((M) <= 2 ? 8 : 16 / (M))
#define DS_MX_ROWS(M) ((M) <= 2 ? 8 / (M) : (M) <= 4 ? 4 : 3)   /* the same over MXFP4 weights */
#elif defined(__AVX2__) && defined(__FMA__)   /* avx2.h: rows one after another, any count */
#define DS_ROWS(M) ((M) >= 8 ? 1 : 8 / (M))
#define DS_MX_ROWS(M) 8   /* the activations are split once per call */
#else
#define DS_ROWS(M) 1
#define DS_MX_ROWS(M) 1
#endif

/* acc[r * DS_MAX_M + m] = x[m] . w[row0 + r] for r < R <= DS_ROWS(M) (DS_MX_ROWS(M) if packed), m < M <= DS_MAX_M;
 * w bf16 [rows, K] or MXFP4 (packed = 1: bytes [rows, K/2] and scales s [rows, K/32]). mxfp4_rows.c */
void ds_expert_rows(const void *w, const uint8_t *s, int packed, int64_t row0, int R, int K,
                    const uint16_t *x, int M, float *acc);
/* The unpacked case: acc as above over bf16 rows w [R, K]. cpu_kernels.c */
void ds_bf16_rows(const uint16_t *x, int M, int K, const uint16_t *w, int R, float *acc);

/* ds_moe_experts / ds_moe_combine over the pairs whose id is not -1 only (a rank holding some of the
 * experts: the others' pairs are skipped, and a row none of whose pairs is held gets 0); ids are in
 * [-1, E). moe_decode.c, moe_prefill.c */
int ds_moe_experts_held(const uint16_t *x, int N, int D, const int64_t *ids, const float *wts, int k, int E, int I,
                        int packed, const void *w1, const uint8_t *s1, const void *w3, const uint8_t *s3,
                        const void *w2, const uint8_t *s2, int act, float beta, float lbeta, uint16_t *out,
                        int nthreads);
int ds_moe_combine_held(const uint16_t *ys, const int64_t *pos, const int64_t *ids, const float *w, int64_t n, int k,
                        int d, uint16_t *out, int nthreads);

/* moe_row.c: ds_moe_experts for one token of k <= DS_ROW_MAX_K pairs (-3 outside that). */
#define DS_ROW_MAX_K 64
int ds_moe_experts_row(const uint16_t *x, int D, const int64_t *ids, const float *wts, int k, int E, int I,
                       int packed, const void *w1, const uint8_t *s1, const void *w3, const uint8_t *s3,
                       const void *w2, const uint8_t *s2, int act, float beta, float lbeta, uint16_t *out,
                       int nthreads);

/* amx.c: bf16 tile kernels. A tile product covers DS_TILE weight rows x DS_TILE activation rows
 * ("an m-block") x 32 along K; DS_AMX_MB m-blocks share one pass over a weight tile. Activations are
 * first packed pair-interleaved, m-blocks side by side:
 * xv[((kb * MB + mb) * 16 + kp) * 32 + 2 * mm + j] = x[16 mb + mm][32 kb + 2 kp + j], zero rows
 * past M; MB = ceil(M / 16). */
#define DS_TILE 16
#define DS_AMX_MB 4
_Static_assert(DS_TILE * DS_AMX_MB == DS_AMX_ROWS, "an AMX pass is DS_AMX_ROWS rows");
#ifdef __AVX512F__
#include <immintrin.h>
/* z[i] lane j <- z[j] lane i (16 x 16 dwords): how pair rows move between the tile layout and rows. */
static inline void ds_transpose16(__m512i z[16]) {
    __m512i t[16];
    for (int q = 0; q < 16; q += 2) {
        t[q] = _mm512_unpacklo_epi32(z[q], z[q + 1]);
        t[q + 1] = _mm512_unpackhi_epi32(z[q], z[q + 1]);
    }
    for (int q = 0; q < 16; q += 4)
        for (int h = 0; h < 2; ++h) {
            z[q + h] = _mm512_unpacklo_epi64(t[q + h], t[q + 2 + h]);
            z[q + 2 + h] = _mm512_unpackhi_epi64(t[q + h], t[q + 2 + h]);
        }
    for (int q = 0; q < 16; q += 8)
        for (int h = 0; h < 4; ++h) {
            t[q + h] = _mm512_shuffle_i32x4(z[q + h], z[q + 4 + h], 0x88);
            t[q + 4 + h] = _mm512_shuffle_i32x4(z[q + h], z[q + 4 + h], 0xdd);
        }
    /* The unpacks leave columns 0, 2, 1, 3 in each group of four rows; undo that here. */
    static const int col[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
    for (int h = 0; h < 8; ++h) {
        z[col[h]] = _mm512_shuffle_i32x4(t[h], t[h + 8], 0x88);
        z[col[h + 8]] = _mm512_shuffle_i32x4(t[h], t[h + 8], 0xdd);
    }
}

/* Lane i: _mm512_reduce_add_ps(v[i]) for i < n <= 16 (0 past n), bit for bit: the same pairing (lane j with
 * j + 8, then j + 4, j + 2, j + 1; fp32 addition commutes exactly), but two vectors combined per step,
 * 15 steps of two shuffles and one add for 16 sums instead of 16 separate 8-op reductions. */
static inline __attribute__((always_inline)) __m512 ds_reduce_add_vec(const __m512 *v, const int n) {
    __m512 a[16], b[8];
    for (int i = 0; i < 16; ++i) a[i] = i < n ? v[i] : _mm512_setzero_ps();
    for (int i = 0; i < 8; ++i)   /* lanes 0-7: v[2i]'s j + (j + 8); 8-15: v[2i + 1]'s */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xee));
    for (int i = 0; i < 4; ++i)   /* 128-bit lane q: v[4i + q]'s 4 partials */
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; ++i) {   /* lane q: v[8i + q]'s 2 partials, then v[8i + 4 + q]'s */
        const __m512d lo = _mm512_castps_pd(a[2 * i]), hi = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)), _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
    }
    /* lane 4q + c: the sum of v[4c + q] */
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(b[0], b[1], 0x88), _mm512_shuffle_ps(b[0], b[1], 0xdd));
    const __m512i at = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(at, sums);
}

/* acc[r * DS_MAX_M + m] = lane r * M + m of sums, for r < R, m < M (R * M <= 16): each weight row's M
 * sums straight from the lanes (a permute and a masked store a row; storing the lanes, then copying
 * them one float at a time, stalled each load on the wide store). */
static inline __attribute__((always_inline)) void ds_store_sums(const __m512 sums, const int R, const int M, float *acc) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int r = 0; r < R; ++r)
        _mm512_mask_storeu_ps(acc + r * DS_MAX_M, (__mmask16)((1u << M) - 1),
                              _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(r * M), lane), sums));
}

/* out[i] = _mm512_reduce_add_ps(v[i]) for i < n <= 16 (ds_reduce_add_vec's lanes, stored whole and
 * copied: a masked store would not forward to the loads that soon read `out`). */
static inline __attribute__((always_inline)) void ds_reduce_add_n(const __m512 *v, const int n, float *out) {
    float all[16];
    _mm512_storeu_ps(all, ds_reduce_add_vec(v, n));
    for (int i = 0; i < n; ++i) out[i] = all[i];
}
#ifdef __AVX512BF16__
/* acc + the pair products of the dword at w broadcast to every lane with x (VDPBF16PS with an embedded
 * broadcast: one instruction, where the intrinsics give a separate VPBROADCASTD, which competes with
 * shuffles for their pipes on Zen 4). The product of two pairs is symmetric: the same bits as
 * _mm512_dpbf16_ps(acc, _mm512_set1_epi32(*w), x). `w` may point into bf16 data (a may_alias type). */
typedef uint32_t __attribute__((may_alias)) ds_pair_t;
static inline __attribute__((always_inline)) __m512 ds_dp_bcast(__m512 acc, const ds_pair_t *w, __m512bh x) {
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(x), "m"(*w));
    return acc;
}
#endif
#endif
void ds_amx_count(int n);
void ds_amx_config(void);     /* loads the tile configuration on the calling thread */
void ds_amx_pack(const uint16_t *x, int64_t ldx, int M, int K, uint16_t *xv);
/* c[((b * MB + mb) * 16 + r) * 16 + mm] = w_b[row0_b + r] . x[16 mb + mm] for b < nw (1 or 2 weight
 * blocks, w_b and s_b as in ds_expert_rows; those rows must exist), r < 16, any MB, K % 32 == 0. MXFP4
 * is decoded once per 512 columns for all m-blocks. Needs ds_amx_config() on this thread. */
void ds_amx_rows(const void *const *w, const uint8_t *const *s, int packed, const int64_t *row0, int nw, int K,
                 const uint16_t *xv, int MB, float *c);

/* tiles.c: ds_amx_rows' contract on AMX where ds_amx_ready(), else on AVX512-BF16 register tiles (only
 * where ds_tiles_ready()); ds_tiles_begin() on each thread before its first call, ds_tiles_count(1) per
 * kernel call, ds_tiles_count(MB) per expert chunk of MB m-blocks. */
void ds_tile_rows(const void *const *w, const uint8_t *const *s, int packed, const int64_t *row0, int nw, int K,
                  const uint16_t *xv, int MB, float *c);
void ds_tiles_begin(void);
void ds_tiles_count(int n);
#endif
