/* The tile kernels' dispatch, and their AVX512-BF16 form for CPUs without AMX (AMD EPYC, older Xeons).
 *
 * ds_tile_rows has ds_amx_rows' contract (internal.h): the same pair-interleaved activations xv and
 * the same product layout c, so ds_linear_amx_multi and the tile chunks of moe_decode.c run on either.
 * AMX runs where ds_amx_ready(); else, in builds with AVX512-BF16, the register tiles below.
 *
 * Register tile: one 16-row weight block x one 16-row m-block, 16 zmm accumulators acc[r] (lane mm
 * = activation row). Pack row kp of a k-block holds the pairs (x[mm][2kp], x[mm][2kp+1]) of all 16
 * rows, so VDPBF16PS of it with weight row r's pair kp broadcast to every lane adds that pair's two
 * products to c[r][mm]: 16 products per loaded pack row, no horizontal sums. Weights are staged a
 * span of SPAN k-blocks at a time (MXFP4 decoded, bf16 copied) into a 16 KB L1 buffer that every
 * m-block reuses, its rows at a compile-time stride so the 16 broadcasts need no row pointers.
 * fp32 accumulation in the same order for packed and bf16 weights (bit-identical results).
 */
#include <stdint.h>
#include <string.h>
#include "ds_abi.h"
#include "bf16.h"
#include "mxfp4.h"
#include "internal.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define DS_REG_TILES 1
#include <immintrin.h>
#endif

static int reg_enabled = 1;
static int64_t tile_uses;   /* tile calls and expert m-blocks, AMX or registers (tests check engagement) */

int ds_tiles_ready(void) {
    if (ds_amx_ready()) return 2;
#ifdef DS_REG_TILES
    return reg_enabled;
#else
    return 0;
#endif
}

void ds_tiles_set_enabled(int on) { reg_enabled = on; }

int64_t ds_tiles_uses(void) { return __atomic_load_n(&tile_uses, __ATOMIC_RELAXED); }

void ds_tiles_count(int n) {
    __atomic_fetch_add(&tile_uses, n, __ATOMIC_RELAXED);
    if (ds_amx_ready()) ds_amx_count(n);
}

void ds_tiles_begin(void) {
    if (ds_amx_ready()) ds_amx_config();
}

#ifdef DS_REG_TILES
#define SPAN 16                      /* k-blocks staged at once: 16 rows x 1 KB */
#define ROW_DW (SPAN * 16)           /* dwords (bf16 pairs) per staged row */

/* st[r * ROW_DW + (kb - kb0) * 16 + kp] = pair kp of weight row r in k-block kb, kb0 <= kb < kb1. */
static inline void stage(const void *w, const uint8_t *s, int packed, int64_t row0, int K, int kb0, int kb1,
                         uint32_t *st) {
    const int KB = K / 32;
    for (int r = 0; r < DS_TILE; ++r) {
        uint32_t *dst = st + r * ROW_DW;
        if (packed) {
            const uint8_t *p = (const uint8_t *)w + (row0 + r) * (K / 2);
            const uint8_t *sc = s + (row0 + r) * KB;
            for (int kb = kb0; kb < kb1; ++kb)
                _mm512_store_si512((void *)(dst + (kb - kb0) * 16), mxfp4_group(p + kb * 16, sc[kb]));
        } else {
            const uint16_t *a = (const uint16_t *)w + (row0 + r) * K;
            for (int kb = kb0; kb < kb1; ++kb)
                _mm512_store_si512((void *)(dst + (kb - kb0) * 16), _mm512_loadu_si512((const void *)(a + kb * 32)));
        }
    }
}

/* The lines staged after the current span, prefetched into L2 while it computes: the same rows' next
 * span, or after a row's last span the first span (and scales) of row r + next, the block the caller
 * stages next. Row r's line j lies at base + r * row + j * 64 (j < lines); scales (or NULL) at
 * scales + r * srow. Without it each block's first span came in at the memory's latency; issued as one
 * burst while staging (the previous form) they queued behind each other; spread over the span's
 * products (one line every 16 products) they arrive in time. Hints never fault: the addresses are
 * integers and may lie past the matrix. */
typedef struct { uintptr_t base, scales; int64_t row, srow; int lines; } span_ahead;

static inline span_ahead ahead_of(const void *w, const uint8_t *s, int packed, int64_t row0, int K, int kb0, int kb1,
                                  int64_t next) {
    const int KB = K / 32, last = kb1 >= KB, rowb = packed ? K / 2 : 2 * K, spanb = packed ? 16 : 64;
    const int64_t skip = last ? next * rowb - (int64_t)kb0 * spanb : (int64_t)SPAN * spanb;
    span_ahead a = {(uintptr_t)w + (uintptr_t)(row0 * rowb + (int64_t)kb0 * spanb + skip), 0, rowb, KB, 0};
    const int nkb = last ? (KB < SPAN ? KB : SPAN) : (KB - kb1 < SPAN ? KB - kb1 : SPAN);
    a.lines = (nkb * spanb + 63) / 64;
    if (packed && last) a.scales = (uintptr_t)s + (uintptr_t)((row0 + next) * KB);
    return a;
}

/* c[r * 16 + mm] (+)= staged rows r . m-block mb of xv over k-blocks kb0..kb1-1 (zero: start from 0);
 * with `ah` (non-NULL) the lines of *ah are prefetched meanwhile, one per k-pair step. */
static inline void span_product(const uint32_t *st, const uint16_t *xv, int MB, int mb, int kb0, int kb1,
                                int zero, const span_ahead *ah, float *c) {
    __m512 acc[DS_TILE];
    for (int r = 0; r < DS_TILE; ++r) acc[r] = zero ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * 16);
    if (ah && ah->scales)
        for (int r = 0; r < DS_TILE; ++r) _mm_prefetch((const char *)(ah->scales + (uintptr_t)(r * ah->srow)), _MM_HINT_T1);
    for (int kb = kb0; kb < kb1; ++kb) {
        const uint16_t *xk = xv + ((int64_t)kb * MB + mb) * DS_TILE * 32;
        const uint32_t *wk = st + (kb - kb0) * 16;
        const int line = kb - kb0;
        for (int kp = 0; kp < 16; ++kp) {
            if (ah && line < ah->lines)
                _mm_prefetch((const char *)(ah->base + (uintptr_t)(kp * ah->row + line * 64)), _MM_HINT_T1);
            const __m512bh xr = (__m512bh)_mm512_load_si512((const void *)(xk + kp * 32));
            for (int r = 0; r < DS_TILE; ++r)
                acc[r] = ds_dp_bcast(acc[r], wk + r * ROW_DW + kp, xr);
        }
    }
    for (int r = 0; r < DS_TILE; ++r) _mm512_storeu_ps(c + r * 16, acc[r]);
}

static void reg_rows(const void *const *w, const uint8_t *const *s, int packed, const int64_t *row0, int nw, int K,
                     const uint16_t *xv, int MB, float *c) {
    __attribute__((aligned(64))) uint32_t st[DS_TILE * ROW_DW];
    const int KB = K / 32;
    int run = 1;   /* the nw blocks are consecutive rows of one matrix: the caller's next call starts nw blocks on */
    for (int b = 1; b < nw; ++b) run &= w[b] == w[0] && row0[b] == row0[0] + (int64_t)b * DS_TILE;
    const int64_t next = (int64_t)DS_TILE * (run ? nw : 1);
    for (int kb0 = 0; kb0 < KB; kb0 += SPAN) {
        const int kb1 = kb0 + SPAN < KB ? kb0 + SPAN : KB;
        for (int b = 0; b < nw; ++b) {
            stage(w[b], packed ? s[b] : NULL, packed, row0[b], K, kb0, kb1, st);
            const span_ahead ah = ahead_of(w[b], packed ? s[b] : NULL, packed, row0[b], K, kb0, kb1, next);
            for (int mb = 0; mb < MB; ++mb)
                span_product(st, xv, MB, mb, kb0, kb1, kb0 == 0, mb == 0 ? &ah : NULL,
                             c + ((int64_t)b * MB + mb) * DS_TILE * DS_TILE);
        }
    }
}
#endif

void ds_tile_rows(const void *const *w, const uint8_t *const *s, int packed, const int64_t *row0, int nw, int K,
                  const uint16_t *xv, int MB, float *c) {
#ifdef DS_REG_TILES
    if (!ds_amx_ready()) {
        reg_rows(w, s, packed, row0, nw, K, xv, MB, c);
        return;
    }
#endif
    ds_amx_rows(w, s, packed, row0, nw, K, xv, MB, c);
}
