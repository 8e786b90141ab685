/* AMX bf16 tile kernels: the dense multi-projection ds_linear_amx_multi (batched decode, 9..64 rows)
 * and the row kernel of the fused experts (moe_decode.c, chunks of 2..256 pairs); both reach the
 * tiles through ds_tile_rows (tiles.c), which runs AVX512-BF16 register tiles where AMX is not ready.
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
#include "ds_abi.h"
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
#ifdef __AVX512F__
            __m512i z[16];   /* row mm: the 16 dword pairs of x[16 mb + mm] in k-block kb */
            for (int mm = 0; mm < DS_TILE; ++mm) {
                const int m = mb * DS_TILE + mm;
                z[mm] = m < M ? _mm512_loadu_si512((const void *)(x + (int64_t)m * ldx + kb * 32)) : _mm512_setzero_si512();
            }
            ds_transpose16(z);
            for (int kp = 0; kp < 16; ++kp) _mm512_store_si512((void *)(t + kp * 32), z[kp]);
#else
            for (int mm = 0; mm < DS_TILE; ++mm) {
                const int m = mb * DS_TILE + mm;
                const uint16_t *src = m < M ? x + (int64_t)m * ldx + kb * 32 : NULL;
                for (int kp = 0; kp < 16; ++kp) {
                    t[kp * 32 + 2 * mm] = src ? src[2 * kp] : 0;
                    t[kp * 32 + 2 * mm + 1] = src ? src[2 * kp + 1] : 0;
                }
            }
#endif
        }
}

#ifdef DS_AMX
static int amx_state = -1;   /* -1 not asked yet, 0 refused, 1 granted (the loader asks once) */
static int amx_enabled = 1;
static int64_t amx_uses;     /* calls and expert m-blocks that ran on tiles (tests check engagement) */

int64_t ds_amx_uses(void) { return __atomic_load_n(&amx_uses, __ATOMIC_RELAXED); }

void ds_amx_count(int n) { __atomic_fetch_add(&amx_uses, n, __ATOMIC_RELAXED); }

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

/* Eight 16 x 64-byte tiles: 0..3 accumulators, 4 and 5 weights, 6 and 7 activations.
 * Static storage: GCC does not treat _tile_loadconfig as reading its argument, so a stack copy's
 * stores can be optimised away. */
static const tile_config TILES = {1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

void ds_amx_config(void) { _tile_loadconfig(&TILES); }

/* Weights of block b, k-block kb into tile T: bf16 rows in place (prefetched ahead while `pf`, the
 * first m pass over them), or MXFP4 rows from dec, where decode_span() has written them. */
#define LOAD_WEIGHTS(T, b, kb) do {                                                                   \
        if (packed) {                                                                                 \
            _tile_loadd(T, dec + ((b) * SPAN + (kb) - kb0) * TILE_ELEMS, 64);                         \
        } else {                                                                                      \
            if (pf)                                                                                   \
                for (int r = 0; r < DS_TILE; ++r)                                                     \
                    _mm_prefetch((const char *)(a[b] + (int64_t)r * K + (kb) * 32 + PREFETCH), _MM_HINT_T0); \
            _tile_loadd(T, a[b] + (kb) * 32, (int64_t)K * 2);                                         \
        }                                                                                             \
    } while (0)

#define SPAN 16   /* k-blocks per span: MXFP4 decoded once per span (16 KB a block), reused by every m pass */

/* dec[(kb - kb0) * TILE_ELEMS + r * 32 + j] = weight (r, 32 kb + j) for kb0 <= kb < kb1: decoding a
 * span before its products keeps the tile loads off freshly stored lines. */
static inline void decode_span(const uint8_t *p, const uint8_t *sc, int K, int kb0, int kb1, uint16_t *dec) {
    const int KB = K / 32;
    for (int r = 0; r < DS_TILE; ++r)
        for (int kb = kb0; kb < kb1; ++kb)
            _mm512_store_si512((void *)(dec + (kb - kb0) * TILE_ELEMS + r * 32),
                               mxfp4_group(p + (int64_t)r * (K / 2) + kb * 16, sc[(int64_t)r * KB + kb]));
}

/* Products of weight tile A with the activation tiles of up to four m-blocks at b into accumulators
 * 0..NB-1, the activations alternating between tmm6 and tmm7. */
#define DOT_KBLOCK(A, b, NB) do {                                                          \
        _tile_loadd(6, (b), 64);                                                           \
        _tile_dpbf16ps(0, A, 6);                                                           \
        if ((NB) > 1) { _tile_loadd(7, (b) + TILE_ELEMS, 64); _tile_dpbf16ps(1, A, 7); }     \
        if ((NB) > 2) { _tile_loadd(6, (b) + 2 * TILE_ELEMS, 64); _tile_dpbf16ps(2, A, 6); } \
        if ((NB) > 3) { _tile_loadd(7, (b) + 3 * TILE_ELEMS, 64); _tile_dpbf16ps(3, A, 7); } \
    } while (0)

/* Accumulator tile T <-> c (or zero on a span's first k-block). */
#define ACC_IN(T, at) do { if (kb0 == 0) _tile_zero(T); else _tile_loadd(T, (at), 64); } while (0)

void ds_amx_rows(const void *const *w, const uint8_t *const *s, int packed, const int64_t *row0, int nw, int K,
                 const uint16_t *xv, int MB, float *c) {
    const int KB = K / 32;
    const int64_t step = (int64_t)MB * TILE_ELEMS;   /* xv elements per k-block */
    __attribute__((aligned(64))) uint16_t dec[2 * SPAN * TILE_ELEMS];   /* decoded MXFP4 weights */
    const uint16_t *a[2] = {NULL, NULL};
    for (int b = 0; b < nw && !packed; ++b) a[b] = (const uint16_t *)w[b] + row0[b] * K;
    float *c1 = c + (int64_t)MB * DS_TILE * DS_TILE;   /* block 1's products */
    for (int kb0 = 0; kb0 < KB; kb0 += SPAN) {
        const int kb1 = kb0 + SPAN < KB ? kb0 + SPAN : KB;
        for (int b = 0; b < nw && packed; ++b)
            decode_span((const uint8_t *)w[b] + row0[b] * (K / 2), s[b] + row0[b] * KB, K, kb0, kb1,
                        dec + b * SPAN * TILE_ELEMS);
        if (nw == 2) {
            /* 2 x 2 blocking: accumulators 0, 1 block 0 and 2, 3 block 1 at m-blocks mb, mb + 1; each
             * loaded tile feeds two products. A last odd m-block uses accumulators 0 and 2. */
            for (int mb = 0; mb < MB; mb += 2) {
                const int pf = mb == 0, two = mb + 1 < MB;
                const uint16_t *x = xv + (int64_t)mb * TILE_ELEMS;
                float *at0 = c + mb * 256, *at1 = c1 + mb * 256;
                ACC_IN(0, at0);
                ACC_IN(2, at1);
                if (two) { ACC_IN(1, at0 + 256); ACC_IN(3, at1 + 256); }
                for (int kb = kb0; kb < kb1; ++kb) {
                    LOAD_WEIGHTS(4, 0, kb);
                    _tile_loadd(6, x + kb * step, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (two) {
                        _tile_loadd(7, x + kb * step + TILE_ELEMS, 64);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    LOAD_WEIGHTS(5, 1, kb);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two) _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(0, at0, 64);
                _tile_stored(2, at1, 64);
                if (two) { _tile_stored(1, at0 + 256, 64); _tile_stored(3, at1 + 256, 64); }
            }
            continue;
        }
        /* One block: passes of up to four m-blocks over one weight tile per k-block; weight tiles
         * alternate between tmm4 and tmm5 by k-block parity (tiles are not renamed: a load into a tile
         * waits for the products still reading it). */
        for (int mb0 = 0; mb0 < MB; mb0 += DS_AMX_MB) {
            const int nb = MB - mb0 < DS_AMX_MB ? MB - mb0 : DS_AMX_MB, pf = mb0 == 0;
            const uint16_t *x = xv + (int64_t)mb0 * TILE_ELEMS;
            float *at = c + mb0 * 256;
            ACC_IN(0, at);
            if (nb > 1) ACC_IN(1, at + 256);
            if (nb > 2) ACC_IN(2, at + 512);
            if (nb > 3) ACC_IN(3, at + 768);
            int kb = kb0;
            for (; kb + 1 < kb1; kb += 2) {
                LOAD_WEIGHTS(4, 0, kb);
                DOT_KBLOCK(4, x + kb * step, nb);
                LOAD_WEIGHTS(5, 0, kb + 1);
                DOT_KBLOCK(5, x + (kb + 1) * step, nb);
            }
            if (kb < kb1) {
                LOAD_WEIGHTS(4, 0, kb);
                DOT_KBLOCK(4, x + kb * step, nb);
            }
            _tile_stored(0, at, 64);
            if (nb > 1) _tile_stored(1, at + 256, 64);
            if (nb > 2) _tile_stored(2, at + 512, 64);
            if (nb > 3) _tile_stored(3, at + 768, 64);
        }
    }
}
#else
int ds_amx_ready(void) { return 0; }
void ds_amx_set_enabled(int on) { (void)on; }
int64_t ds_amx_uses(void) { return 0; }
void ds_amx_count(int n) { (void)n; }
void ds_amx_config(void) {}
void ds_amx_rows(const void *const *w, const uint8_t *const *s, int packed, const int64_t *row0, int nw, int K,
                 const uint16_t *xv, int MB, float *c) {
    (void)w; (void)s; (void)packed; (void)row0; (void)nw; (void)K; (void)xv; (void)MB; (void)c;
}
#endif

/* y[m * ldy + n0 + r] = c[m-block m / 16][r][m % 16] for r < rows, m < Mc: fp32, or bf16 rounded as
 * f32_to_bf16. Per m-block a 16 x 16 dword transpose turns the products' columns into output rows. */
static void store_block(const float *c, int MB, int Mc, int rows, int f32, void *y, int64_t ldy, int n0) {
    for (int mb = 0; mb < MB; ++mb) {
        const float *cb = c + mb * DS_TILE * DS_TILE;
        const int mms = Mc - mb * DS_TILE < DS_TILE ? Mc - mb * DS_TILE : DS_TILE;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
        __m512i z[16];
        for (int r = 0; r < DS_TILE; ++r) z[r] = _mm512_loadu_si512((const void *)(cb + r * DS_TILE));
        ds_transpose16(z);
        const __mmask16 k = (__mmask16)((1u << rows) - 1);
        for (int mm = 0; mm < mms; ++mm) {
            const int64_t at = (int64_t)(mb * DS_TILE + mm) * ldy + n0;
            if (f32) _mm512_mask_storeu_ps((float *)y + at, k, _mm512_castsi512_ps(z[mm]));
            else _mm256_mask_storeu_epi16((uint16_t *)y + at, k, f32_to_bf16_x16(_mm512_castsi512_ps(z[mm])));
        }
#else
        for (int mm = 0; mm < mms; ++mm) {
            const int64_t at = (int64_t)(mb * DS_TILE + mm) * ldy + n0;
            for (int r = 0; r < rows; ++r) {
                if (f32) ((float *)y)[at + r] = cb[r * DS_TILE + mm];
                else ((uint16_t *)y)[at + r] = f32_to_bf16(cb[r * DS_TILE + mm]);
            }
        }
#endif
    }
}

/* y_i[M, N_i] = x[M, K] @ w_i[N_i, K]^T for i < nw, as ds_linear_bf16_multi (each y_i contiguous,
 * fp32 where f32[i], else bf16) for any M, in passes of DS_AMX_ROWS rows over the weights. Needs K % 32 == 0.
 * Returns 0, -1 (bad arguments or no tiles; nothing written) or -2 (allocation failed). */
int ds_linear_amx_multi(const uint16_t *x, int M, int K, const uint16_t *const *w, const int *N, const int *f32,
                        void *const *y, int nw, int nthreads) {
    enum { MAXW = DS_MAX_MULTI, PASS = DS_AMX_ROWS };
    if (!ds_tiles_ready() || nw < 1 || nw > MAXW || M < 1 || K < 32 || K % 32) return -1;
    int first[MAXW + 1];
    first[0] = 0;
    for (int i = 0; i < nw; ++i) first[i + 1] = first[i] + (N[i] + DS_TILE - 1) / DS_TILE;
    const int blocks = first[nw];
    uint16_t *xv = aligned_alloc(64, sizeof(uint16_t) * (size_t)K * PASS);
    if (!xv) return -2;
    ds_tiles_count(1);
    int bad = 0;
    for (int m0 = 0; m0 < M && !bad; m0 += PASS) {
        const int Mc = M - m0 < PASS ? M - m0 : PASS, MB = (Mc + DS_TILE - 1) / DS_TILE;
        const int pair = MB >= DS_AMX_MB;   /* two blocks a call; fewer m-blocks stream weights better one at a time */
        ds_amx_pack(x + (int64_t)m0 * K, K, Mc, K, xv);
        #pragma omp parallel num_threads(nthreads) reduction(| : bad)
        {
            __attribute__((aligned(64))) float c[2 * DS_AMX_MB * DS_TILE * DS_TILE];
            uint16_t *tail = NULL;   /* blocks of fewer than 16 rows, zero-padded (two: one per block of a call) */
            ds_tiles_begin();
            #pragma omp for schedule(static)
            for (int u = 0; u < (blocks + 1) / 2; ++u) {   /* pairs of row blocks, one ds_amx_rows call */
                const void *wb[2];
                int64_t r0[2];
                int mat[2], n0[2], rows[2];
                const int nb = 2 * u + 1 < blocks ? 2 : 1;
                for (int h = 0; h < nb; ++h) {
                    const int b = 2 * u + h;
                    int i = 0;
                    while (first[i + 1] <= b) ++i;
                    mat[h] = i;
                    n0[h] = (b - first[i]) * DS_TILE;
                    rows[h] = N[i] - n0[h] < DS_TILE ? N[i] - n0[h] : DS_TILE;
                    wb[h] = w[i];
                    r0[h] = n0[h];
                    if (rows[h] < DS_TILE) {
                        if (!tail) tail = malloc(sizeof(uint16_t) * 2 * DS_TILE * (size_t)K);
                        if (!tail) { bad |= 1; break; }
                        uint16_t *t = tail + (int64_t)h * DS_TILE * K;
                        memcpy(t, w[i] + (int64_t)n0[h] * K, sizeof(uint16_t) * (size_t)rows[h] * K);
                        memset(t + (int64_t)rows[h] * K, 0, sizeof(uint16_t) * (size_t)(DS_TILE - rows[h]) * K);
                        wb[h] = t;
                        r0[h] = 0;
                    }
                }
                if (bad) continue;
                for (int h = 0; h < nb; h += pair ? nb : 1)
                    ds_tile_rows(wb + h, NULL, 0, r0 + h, pair ? nb : 1, K, xv, MB, c + h * MB * DS_TILE * DS_TILE);
                for (int h = 0; h < nb; ++h) {
                    const int i = mat[h];
                    void *yi = f32[i] ? (void *)((float *)y[i] + (int64_t)m0 * N[i])
                                      : (void *)((uint16_t *)y[i] + (int64_t)m0 * N[i]);
                    store_block(c + h * MB * DS_TILE * DS_TILE, MB, Mc, rows[h], f32[i], yi, N[i], n0[h]);
                }
            }
            free(tail);
        }
    }
    free(xv);
    return bad ? -2 : 0;
}
