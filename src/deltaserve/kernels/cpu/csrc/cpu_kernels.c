/* deltaserve CPU kernels: small-M linear layers (batch-1..8 decode) for bf16 weights and their row
 * kernels, which the fused routed experts use over bf16 weights too (ds_bf16_rows; the MXFP4 row
 * kernels and dequantiser: mxfp4_rows.c).
 *
 * Every kernel computes y[m, n] = sum_k x[m, k] * w[n, k] with fp32 accumulation and writes
 * bf16 rounded to nearest-even (NaN kept quiet), the contract of torch's bf16 F.linear; only
 * the summation order differs.
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
#include "internal.h"
#include "avx2.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define DS_AVX512BF16 1
#endif

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
    const __m512 all = ds_reduce_add_vec(v, R * M);   /* R * M <= 16: R is DS_ROWS(M) or 1 */
    if (k == K) {   /* no tail */
        ds_store_sums(all, R, M, acc);
        return;
    }
    _mm512_storeu_ps(sums, all);
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
        case 2: rows_bf16_avx(x, 2, K, w, 8, acc); return;
        case 3: rows_bf16_avx(x, 3, K, w, 5, acc); return;
        case 4: rows_bf16_avx(x, 4, K, w, 4, acc); return;
        case 5: rows_bf16_avx(x, 5, K, w, 3, acc); return;
        case 6: rows_bf16_avx(x, 6, K, w, 2, acc); return;
        case 7: rows_bf16_avx(x, 7, K, w, 2, acc); return;
        case 8: rows_bf16_avx(x, 8, K, w, 2, acc); return;
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

/* Output tiles: TILE_ROWS(R) weight rows (whole row blocks of R, at most 16) are computed into one
 * accumulator tile, then each input row's results are rounded and stored as one contiguous run (a
 * vector store; storing each block's M results at once scattered them M ways). */
#define TILE_ROWS(R) ((R) * (16 / (R)))

/* acc [rows, DS_MAX_M] = x[M, K] . w[r] for the `rows` <= TILE_ROWS(R) rows of w, in row blocks of R. */
static inline void tile_rows(const uint16_t *x, int M, int K, const uint16_t *w, int R, int rows, float *acc) {
    for (int r0 = 0; r0 < rows; r0 += R)
        rows_bf16(x, M, K, w + (int64_t)r0 * K, rows - r0 < R ? rows - r0 : R, acc + r0 * DS_MAX_M);
}

/* y[m * ldy + n0 + r] = acc[r * DS_MAX_M + m] (bf16, or fp32 where f32) for r < rows, m < M. */
static inline void store_tile(const float *acc, int rows, int M, void *y, int64_t n0, int64_t ldy, int f32) {
    for (int m = 0; m < M; ++m) {
        if (f32) {
            float *ym = (float *)y + m * ldy + n0;
            for (int r = 0; r < rows; ++r) ym[r] = acc[r * DS_MAX_M + m];
        } else {
            uint16_t *ym = (uint16_t *)y + m * ldy + n0;
            for (int r = 0; r < rows; ++r) ym[r] = f32_to_bf16(acc[r * DS_MAX_M + m]);
        }
    }
}

/* y[M, N] (row stride ldy) = x[M, K] @ w[N, K]^T; M <= DS_MAX_M. */
void ds_linear_bf16(const uint16_t *x, int M, int K, const uint16_t *w, int N, uint16_t *y,
                    int64_t ldy, int nthreads) {
    const int R = DS_ROWS(M), T = TILE_ROWS(R);
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (N >= 256)
    for (int n0 = 0; n0 < N; n0 += T) {
        float acc[16 * DS_MAX_M];
        const int rows = N - n0 < T ? N - n0 : T;
        tile_rows(x, M, K, w + (int64_t)n0 * K, R, rows, acc);
        store_tile(acc, rows, M, y, n0, ldy, 0);
    }
}

/* Several linears of one input in one parallel region: y_i[M, N_i] = x[M, K] @ w_i[N_i, K]^T for
 * i < nw (each y_i contiguous; fp32 when f32[i], else bf16). Tiles of all weights are dealt
 * out together, so small projections share the threads' memory streams. Returns -1 if nw > DS_MAX_MULTI. */
int ds_linear_bf16_multi(const uint16_t *x, int M, int K, const uint16_t *const *w, const int *N,
                         const int *f32, void *const *y, int nw, int nthreads) {
    enum { MAXW = DS_MAX_MULTI };
    if (nw > MAXW) return -1;
    const int R = DS_ROWS(M), T = TILE_ROWS(R);
    int first[MAXW + 1];
    first[0] = 0;
    for (int i = 0; i < nw; ++i) first[i + 1] = first[i] + (N[i] + T - 1) / T;
    const int blocks = first[nw];
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (blocks * T >= 256)
    for (int b = 0; b < blocks; ++b) {
        int i = 0;
        while (first[i + 1] <= b) ++i;
        const int n0 = (b - first[i]) * T, rows = N[i] - n0 < T ? N[i] - n0 : T;
        float acc[16 * DS_MAX_M];
        tile_rows(x, M, K, w[i] + (int64_t)n0 * K, R, rows, acc);
        store_tile(acc, rows, M, y[i], n0, N[i], f32[i]);
    }
    return 0;
}

/* Per-head linear: y[h, M, N] = x[h, M, K] @ w[h, N, K]^T, all contiguous; M <= DS_MAX_M. */
void ds_linear_bf16_heads(const uint16_t *x, int H, int M, int K, const uint16_t *w, int N, uint16_t *y,
                          int nthreads) {
    const int R = DS_ROWS(M), T = TILE_ROWS(R), blocks = (N + T - 1) / T;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if ((int64_t)H * N >= 256)
    for (int t = 0; t < H * blocks; ++t) {
        const int h = t / blocks, n0 = (t % blocks) * T;
        float acc[16 * DS_MAX_M];
        const int rows = N - n0 < T ? N - n0 : T;
        tile_rows(x + (int64_t)h * M * K, M, K, w + ((int64_t)h * N + n0) * K, R, rows, acc);
        store_tile(acc, rows, M, y + (int64_t)h * M * N, n0, N, 0);
    }
}

/* acc[r * DS_MAX_M + m] = x[m] . w[r] for r < R <= DS_ROWS(M), m < M: bf16 rows w [R, K] (the unpacked
 * case of ds_expert_rows, mxfp4_rows.c). */
void ds_bf16_rows(const uint16_t *x, int M, int K, const uint16_t *w, int R, float *acc) { rows_bf16(x, M, K, w, R, acc); }
