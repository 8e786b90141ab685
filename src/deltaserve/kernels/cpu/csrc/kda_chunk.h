/* Helpers shared by the chunked KDA prefill (kda_chunk.c) and its matmul kernels (kda_chunk_mm.c);
 * not part of the ctypes ABI. */
#ifndef DELTASERVE_KDA_CHUNK_H
#define DELTASERVE_KDA_CHUNK_H
#include <stdint.h>
#include "ds_abi.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* Full unrolling of register-tile loops: without it GCC keeps accumulator arrays on the stack,
 * storing them on every iteration of the reduction loop. */
#define KC_PRAGMA(x) _Pragma(#x)
#define KC_UNROLL(n) KC_PRAGMA(GCC unroll n)

#define KC_MAX_CHUNK DS_KDA_MAX_CHUNK

#ifdef __AVX512F__
static inline __mmask16 tail_mask(int rem) { return rem >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << rem) - 1); }
#endif

/* The next chunk's input rows, prefetched into L2 while this chunk's matmuls run (memory latency
 * would otherwise stall the first pass over its strided rows): row r < n is tensor r % 4 (q, k, g,
 * v) of token t0 + r / 4, head h; each step issues `quota` rows. */
typedef struct {
    const float *base[4];
    int64_t ld[4];
    int len[4], n, next, quota;
} prefetch_queue;

/* Always inlined: GCC deems a function of prefetches alone free of side effects, deleting calls. */
static inline __attribute__((always_inline)) void prefetch_step(prefetch_queue *pq, int count) {
    for (const int end = pq->next + count < pq->n ? pq->next + count : pq->n; pq->next < end; ++pq->next) {
        const int r = pq->next & 3;
        const float *row = pq->base[r] + (pq->next >> 2) * pq->ld[r];
        for (int d = 0; d < pq->len[r]; d += 16) __builtin_prefetch(row + d, 0, 2);
    }
}

/* (a . c, b . c) over n channels. */
void ds_kc_dot2(const float *a, const float *b, const float *c, int n, float *ra, float *rb);
/* Rows a, b against columns c[0..3] (row stride ldc): ra[j] = a . c_j, rb[j] = b . c_j. */
void ds_kc_dot2x4(const float *a, const float *b, const float *c, int64_t ldc, int n, float *ra, float *rb);
#ifdef __AVX512F__
/* As ds_kc_dot2x4 over columns c[0..7]. */
void ds_kc_dot2x8(const float *a, const float *b, const float *c, int64_t ldc, int n, float *ra, float *rb);
#endif
/* c[0..n) += sum_{d < D} coef[d] * B[d*ldb + 0..n). */
void ds_kc_row_acc(int n, int D, const float *coef, const float *B, int64_t ldb, float *c);
/* C[M, N] = init (rows scaled by rs, or 0 when init is NULL) + A @ B, where A(i, d) is at
 * A[i*ars + d*acs], B row d at B + d*ldb, C and init rows at stride ldc / ldi (init may be C).
 * tri: A is lower-triangular incl. the diagonal (entries above it are zeros in memory).
 * pq (or NULL): prefetched in steps along the way. */
void ds_kc_mm(int M, int N, int D, const float *A, int64_t ars, int64_t acs, const float *B, int64_t ldb, float *C,
              int64_t ldc, const float *init, int64_t ldi, const float *rs, int tri, prefetch_queue *pq);

#endif
