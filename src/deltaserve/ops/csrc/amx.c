/* AMX bf16 tile kernels: the dense multi-projection ds_linear_amx_multi (batched decode, 9..64 rows)
 * and the row kernel of the fused experts (moe_decode.c, chunks of 2..256 pairs).
 *
 * TDPBF16PS computes C[16][16] += A[16][32 bf16] . B[16 pairs][16][2 bf16]. Products here are
 * transposed, C[n][m] = w[n] . x[m]: A is 16 weight rows exactly as stored (row-major, so weights
 * need no repacking) and B the pair-interleaved activations (internal.h). MXFP4 rows are decoded a
 * span of 512 columns at a time (16 KB, one group of 32 per row and tile) and reused by every m pass.
 * fp32 accumulation; only the summation order differs from the GEMV kernels'.
 * Linux gates tile data behind arch_prctl(ARCH_REQ_XCOMP_PERM); without that permission, or without
 * AMX under the compiler's -march=native, ds_amx_ready() is 0 and callers take the other paths.
 */
#define _GNU_SOURCE   /* syscall() under -std=c11 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "bf16.h"
#include "mxfp4.h"
#include "internal.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__linux__)
#define DS_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define TILE_ELEMS (DS_TILE * 32)   /* bf16 elements of one A or B tile */
#ifndef PREFETCH
#define PREFETCH 64   /* elements (two lines) ahead per row; longer distances measured slower */
#endif

void ds_amx_pack(const uint16_t *x, int64_t ldx, int M, int K, uint16_t *xv) {
    const int MB = (M + DS_TILE - 1) / DS_TILE, KB = K / 32;
    for (int kb = 0; kb < KB; ++kb)
        for (int mb = 0; mb < MB; ++mb) {
            uint16_t *t = xv + ((int64_t)kb * MB + mb) * TILE_ELEMS;
            for (int mm = 0; mm < DS_TILE; ++mm) {
                const int m = mb * DS_TILE + mm;
                const uint16_t *src = m < M ? x + (int64_t)m * ldx + kb * 32 : NULL;
                for (int kp = 0; kp < 16; ++kp) {
                    t[kp * 32 + 2 * mm] = src ? src[2 * kp] : 0;
                    t[kp * 32 + 2 * mm + 1] = src ? src[2 * kp + 1] : 0;
                }
            }
        }
}

#ifdef DS_AMX
static int amx_state = -1;   /* -1 not asked yet, 0 refused, 1 granted (the loader asks once) */
static int amx_enabled = 1;
static int64_t amx_uses;     /* calls and expert chunks that ran on tiles (tests check engagement) */

int64_t ds_amx_uses(void) { return __atomic_load_n(&amx_uses, __ATOMIC_RELAXED); }

void ds_amx_count(void) { __atomic_fetch_add(&amx_uses, 1, __ATOMIC_RELAXED); }

int ds_amx_ready(void) {
    if (amx_state < 0)
        amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return amx_state && amx_enabled;
}

void ds_amx_set_enabled(int on) { amx_enabled = on; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Eight 16 x 64-byte tiles: 0..3 accumulators (one per m-block), 4 weights, 5..7 activations.
 * Static storage: GCC does not treat _tile_loadconfig as reading its argument, so a stack copy's
 * stores can be optimised away. */
static const tile_config TILES = {1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

void ds_amx_config(void) { _tile_loadconfig(&TILES); }

/* Tile registers are not renamed: a load into a tile waits for the products still reading it. So
 * weight tiles alternate between tmm4 and tmm5 by k-block parity (the next block's weights load while
 * this block's products run); activation tiles alternate between tmm6 and tmm7. */
#define DOT_KBLOCK(A, b, NB) do {                                                          \
        _tile_loadd(6, (b), 64);                                                           \
        _tile_dpbf16ps(0, A, 6);                                                           \
        if ((NB) > 1) { _tile_loadd(7, (b) + TILE_ELEMS, 64); _tile_dpbf16ps(1, A, 7); }     \
        if ((NB) > 2) { _tile_loadd(6, (b) + 2 * TILE_ELEMS, 64); _tile_dpbf16ps(2, A, 6); } \
        if ((NB) > 3) { _tile_loadd(7, (b) + 3 * TILE_ELEMS, 64); _tile_dpbf16ps(3, A, 7); } \
    } while (0)

/* Weights of k-block kb into tile T: bf16 rows in place (prefetched ahead), or MXFP4 rows from
 * `dec`, where decode_span() has written them. */
#define LOAD_WEIGHTS(T, kb) do {                                                                      \
        if (packed) {                                                                                 \
            _tile_loadd(T, dec + ((kb) - kb0) * TILE_ELEMS, 64);                                      \
        } else {                                                                                      \
            for (int r = 0; r < DS_TILE; ++r)                                                         \
                _mm_prefetch((const char *)(a + (int64_t)r * K + (kb) * 32 + PREFETCH), _MM_HINT_T0);  \
            _tile_loadd(T, a + (kb) * 32, (int64_t)K * 2);                                            \
        }                                                                                             \
    } while (0)

#define SPAN 16   /* k-blocks per span: MXFP4 decoded once per span (16 KB), reused by every m pass */

/* dec[(kb - kb0) * TILE_ELEMS + r * 32 + j] = weight (r, 32 kb + j) for kb0 <= kb < kb1: decoding a
 * span before its products keeps the tile loads off freshly stored lines. */
static inline void decode_span(const uint8_t *p, const uint8_t *sc, int K, int kb0, int kb1, uint16_t *dec) {
    const int KB = K / 32;
    for (int r = 0; r < DS_TILE; ++r)
        for (int kb = kb0; kb < kb1; ++kb)
            _mm512_store_si512((void *)(dec + (kb - kb0) * TILE_ELEMS + r * 32),
                               mxfp4_group(p + (int64_t)r * (K / 2) + kb * 16, sc[(int64_t)r * KB + kb]));
}

/* Accumulator tiles 0..nb-1 <-> c (m-blocks mb0..mb0+nb-1). */
static inline void tiles_from(const float *c, int nb, int zero) {
    if (zero) { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); return; }
    _tile_loadd(0, c, 64);
    if (nb > 1) _tile_loadd(1, c + 256, 64);
    if (nb > 2) _tile_loadd(2, c + 512, 64);
    if (nb > 3) _tile_loadd(3, c + 768, 64);
}

static inline void tiles_to(float *c, int nb) {
    _tile_stored(0, c, 64);
    if (nb > 1) _tile_stored(1, c + 256, 64);
    if (nb > 2) _tile_stored(2, c + 512, 64);
    if (nb > 3) _tile_stored(3, c + 768, 64);
}

void ds_amx_rows(const void *w, const uint8_t *s, int packed, int64_t row0, int K, const uint16_t *xv, int MB,
                 float *c) {
    const int KB = K / 32;
    __attribute__((aligned(64))) uint16_t dec[SPAN * TILE_ELEMS];   /* decoded MXFP4 weights */
    const uint8_t *p = packed ? (const uint8_t *)w + row0 * (K / 2) : NULL, *sc = packed ? s + row0 * KB : NULL;
    const uint16_t *a = packed ? NULL : (const uint16_t *)w + row0 * K;
    for (int kb0 = 0; kb0 < KB; kb0 += SPAN) {
        const int kb1 = kb0 + SPAN < KB ? kb0 + SPAN : KB;
        if (packed) decode_span(p, sc, K, kb0, kb1, dec);
        for (int mb0 = 0; mb0 < MB; mb0 += DS_AMX_MB) {   /* passes of up to four m-blocks */
            const int nb = MB - mb0 < DS_AMX_MB ? MB - mb0 : DS_AMX_MB;
            const uint16_t *b = xv + (int64_t)mb0 * TILE_ELEMS;
            const int64_t step = (int64_t)MB * TILE_ELEMS;   /* xv elements per k-block */
            tiles_from(c + mb0 * 256, nb, kb0 == 0);
            int kb = kb0;
            for (; kb + 1 < kb1; kb += 2) {
                LOAD_WEIGHTS(4, kb);
                DOT_KBLOCK(4, b + kb * step, nb);
                LOAD_WEIGHTS(5, kb + 1);
                DOT_KBLOCK(5, b + (kb + 1) * step, nb);
            }
            if (kb < kb1) {
                LOAD_WEIGHTS(4, kb);
                DOT_KBLOCK(4, b + kb * step, nb);
            }
            tiles_to(c + mb0 * 256, nb);
        }
    }
}
#else
int ds_amx_ready(void) { return 0; }
void ds_amx_set_enabled(int on) { (void)on; }
int64_t ds_amx_uses(void) { return 0; }
void ds_amx_count(void) {}
void ds_amx_config(void) {}
void ds_amx_rows(const void *w, const uint8_t *s, int packed, int64_t row0, int K, const uint16_t *xv, int MB,
                 float *c) {
    (void)w; (void)s; (void)packed; (void)row0; (void)K; (void)xv; (void)MB; (void)c;
}
#endif

/* y_i[M, N_i] = x[M, K] @ w_i[N_i, K]^T for i < nw, as ds_linear_bf16_multi (each y_i contiguous,
 * fp32 where f32[i], else bf16) for any M, in passes of 64 rows over the weights. Needs K % 32 == 0.
 * Returns 0, -1 (bad arguments or no AMX; nothing written) or -2 (allocation failed). */
int ds_linear_amx_multi(const uint16_t *x, int M, int K, const uint16_t *const *w, const int *N, const int *f32,
                        void *const *y, int nw, int nthreads) {
    enum { MAXW = 16, PASS = DS_TILE * DS_AMX_MB };
    if (!ds_amx_ready() || nw < 1 || nw > MAXW || M < 1 || K < 32 || K % 32) return -1;
    int first[MAXW + 1];
    first[0] = 0;
    for (int i = 0; i < nw; ++i) first[i + 1] = first[i] + (N[i] + DS_TILE - 1) / DS_TILE;
    const int blocks = first[nw];
    uint16_t *xv = aligned_alloc(64, sizeof(uint16_t) * (size_t)K * PASS);
    if (!xv) return -2;
    ds_amx_count();
    int bad = 0;
    for (int m0 = 0; m0 < M && !bad; m0 += PASS) {
        const int Mc = M - m0 < PASS ? M - m0 : PASS, MB = (Mc + DS_TILE - 1) / DS_TILE;
        ds_amx_pack(x + (int64_t)m0 * K, K, Mc, K, xv);
        #pragma omp parallel num_threads(nthreads) reduction(| : bad)
        {
            __attribute__((aligned(64))) float c[DS_AMX_MB * DS_TILE * DS_TILE];
            uint16_t *tail = NULL;   /* a last block of fewer than 16 rows, zero-padded */
            ds_amx_config();
            #pragma omp for schedule(static)
            for (int b = 0; b < blocks; ++b) {
                int i = 0;
                while (first[i + 1] <= b) ++i;
                const int n0 = (b - first[i]) * DS_TILE, rows = N[i] - n0 < DS_TILE ? N[i] - n0 : DS_TILE;
                if (rows == DS_TILE) {
                    ds_amx_rows(w[i], NULL, 0, n0, K, xv, MB, c);
                } else {
                    if (!tail) tail = calloc((size_t)DS_TILE * K, sizeof(uint16_t));
                    if (!tail) { bad |= 1; continue; }
                    memcpy(tail, w[i] + (int64_t)n0 * K, sizeof(uint16_t) * (size_t)rows * K);
                    memset(tail + (int64_t)rows * K, 0, sizeof(uint16_t) * (size_t)(DS_TILE - rows) * K);
                    ds_amx_rows(tail, NULL, 0, 0, K, xv, MB, c);
                }
                for (int m = 0; m < Mc; ++m) {
                    const float *cm = c + (m / DS_TILE) * DS_TILE * DS_TILE + m % DS_TILE;
                    const int64_t at = (int64_t)(m0 + m) * N[i] + n0;
                    if (f32[i]) for (int r = 0; r < rows; ++r) ((float *)y[i])[at + r] = cm[r * DS_TILE];
                    else for (int r = 0; r < rows; ++r) ((uint16_t *)y[i])[at + r] = f32_to_bf16(cm[r * DS_TILE]);
                }
            }
            free(tail);
        }
    }
    free(xv);
    return bad ? -2 : 0;
}
