/* deltaserve fused routed experts for small batches (decode): the (token, slot) pairs are grouped by
 * expert, and each chunk of one expert's pairs runs gate/up, the GLU and down in one pass over that
 * expert's weights (bf16, or MXFP4 kept packed). Where ds_tiles_ready(), chunks of at least
 * min_pairs() pairs run on tiles (ds_tile_rows: AMX, or AVX512-BF16 register tiles), up to
 * AMX_MAX_PAIRS (so prefill batches fit too); others on the GEMV row kernels (ds_expert_rows), up to
 * DS_MAX_M pairs. Either way fp32 accumulation, bf16 results; only the summation order differs.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "ds_abi.h"
#include "bf16.h"
#include "glu.h"
#include "internal.h"

/* Fewest pairs of a tile chunk: AMX pads a chunk to 16 rows at little cost; register tiles compute
 * all 16 lanes of an m-block, which beats the row kernels (M dot products per weight row, each chunk
 * decoding the weights again) from 11 pairs on. Measured per 32-weight group and row of 64 MXFP4
 * experts (D = I = 512) from DRAM, AMD EPYC Zen 4: row kernels ~3.5 + 1.5 M cycles a chunk of M <= 8
 * pairs (9 pairs as 8 + 1: 20.7), one m-block 23.5, two 41.5. */
static int min_pairs(void) { return ds_amx_ready() ? 2 : 11; }
#define AMX_MAX_MB 16
#define AMX_MAX_PAIRS (DS_TILE * AMX_MAX_MB)   /* pairs per tile chunk (prefill: ~one expert's share) */
#define ACC_MAX (AMX_MAX_MB * DS_TILE * DS_TILE)   /* floats of one row block's products */
#define GLU_ROWS (ACC_MAX / DS_MAX_M)   /* rows-kernel rows whose products fill ACC_MAX */

typedef struct { int act; float beta, lbeta; float *left, *right; } glu_table;

typedef struct {
    const uint16_t *x;
    int D, I, k, packed, act, amx;
    const int *count, *order;
    const int64_t *ids;
    const void *w1, *w3, *w2;
    const uint8_t *s1, *s3, *s2;
    float beta, lbeta;
    const glu_table *glu;   /* the GLU as tables (NULL: allocation failed, evaluate it) */
    uint16_t *ys;   /* [pairs, D] bf16 expert outputs */
    int min_pairs;  /* fewest pairs of a tile chunk (amx: tile chunks allowed, on AMX or register tiles) */
} experts_job;

typedef struct { uint16_t *xg, *h, *xv, *hv; } chunk_scratch;   /* gathered rows, GLU out, tile packs */

static int scratch_alloc(chunk_scratch *s, int rows, int D, int I) {
    const size_t padded = (size_t)(rows + DS_TILE - 1) / DS_TILE * DS_TILE;   /* whole m-blocks */
    s->xg = malloc(sizeof(uint16_t) * (size_t)rows * D);
    s->h = malloc(sizeof(uint16_t) * (size_t)rows * I);
    s->xv = aligned_alloc(64, (sizeof(uint16_t) * padded * D + 63) / 64 * 64);
    s->hv = aligned_alloc(64, (sizeof(uint16_t) * padded * I + 63) / 64 * 64);
    return s->xg && s->h && s->xv && s->hv;
}

static void scratch_free(chunk_scratch *s) {
    free(s->xg); free(s->h); free(s->xv); free(s->hv);
}

/* Appends the starts of the chunks splitting one expert's pairs begin..end-1 to `chunk`; returns how
 * many. Tile chunks: at most AMX_MAX_PAIRS, whole m-blocks, as even as that allows; row-kernel chunks
 * DS_MAX_M. On register tiles (not AMX) up to DS_MAX_M pairs past the last whole m-block take a row
 * chunk instead of a mostly empty m-block (17 pairs: 23.5 + 5.3 cycles a group-row, not 41.5). */
static int split_pairs(int tiles, int min, int begin, int end, int *chunk) {
    const int left = end - begin;
    int tail = left;   /* the pairs after the tile chunks */
    if (tiles && left >= min) tail = !ds_amx_ready() && left % DS_TILE <= DS_MAX_M ? left % DS_TILE : 0;
    const int tiled = left - tail, mb = (tiled + DS_TILE - 1) / DS_TILE, n = (mb + AMX_MAX_MB - 1) / AMX_MAX_MB;
    int c = 0;
    for (int i = 0; i < n; ++i) chunk[c++] = begin + DS_TILE * (mb * i / n);
    for (int at = begin + tiled; at < end; at += DS_MAX_M) chunk[c++] = at;
    return c;
}

/* The tile GLU as two tables over bf16 bit patterns: glu_situ and glu_silu are one fp32 product
 * left(g) * right(u) (no contraction under -std=c11), so h = left[bits(g)] * right[bits(u)] is
 * bit-identical to evaluating them. Tables are built once per (act, beta, lbeta) and kept for the
 * process (GLU_KEYS of them; past that, one per call that the caller frees). */
#define GLU_KEYS 8

static int glu_fill(glu_table *t) {
    t->left = aligned_alloc(64, sizeof(float) * 2 * 65536);
    if (!t->left) return 0;
    t->right = t->left + 65536;
    const float beta = t->beta, lbeta = t->lbeta;
    float *left = t->left, *right = t->right;
    if (t->act == DS_ACT_SITU) {
        #pragma omp simd
        for (int b = 0; b < 65536; ++b) {
            const float v = bf16_to_f32((uint16_t)b);
            left[b] = situ_left(v, beta);
            right[b] = situ_right(v, lbeta);
        }
    } else {
        #pragma omp simd
        for (int b = 0; b < 65536; ++b) {
            const float v = bf16_to_f32((uint16_t)b);
            left[b] = silu_left(v);
            right[b] = v;
        }
    }
    return 1;
}

/* The table for (act, beta, lbeta), or NULL (allocation failed); *owned when the caller frees left. */
static const glu_table *glu_get(int act, float beta, float lbeta, glu_table *own, int *owned) {
    static glu_table keys[GLU_KEYS];
    static int used;
    const glu_table *got = NULL;
    *owned = 0;
    #pragma omp critical(ds_glu_tables)
    {
        for (int i = 0; i < used && !got; ++i)
            if (keys[i].act == act && keys[i].beta == beta && keys[i].lbeta == lbeta) got = &keys[i];
        if (!got && used < GLU_KEYS) {
            keys[used] = (glu_table){act, beta, lbeta, NULL, NULL};
            if (glu_fill(&keys[used])) got = &keys[used++];
        }
    }
    if (!got) {
        *own = (glu_table){act, beta, lbeta, NULL, NULL};
        if (glu_fill(own)) { got = own; *owned = 1; }
    }
    return got;
}

/* hv[i] = t->left[bits(gg[i])] * t->right[bits(uu[i])] for i < n, gg and uu bf16 values held as fp32: the
 * GLU's value, bit-identical (see glu_table), a third of the cost of evaluating it where the table's
 * used entries are in cache (AMD EPYC Zen 4: 2.7 against 8.1 cycles a value). */
static void glu_lookup(const float *gg, const float *uu, int n, const glu_table *t, float *hv) {
    int i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
        const __m512i gi = _mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(gg + i)), 16);
        const __m512i ui = _mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(uu + i)), 16);
        _mm512_storeu_ps(hv + i, _mm512_mul_ps(_mm512_i32gather_ps(gi, t->left, 4), _mm512_i32gather_ps(ui, t->right, 4)));
    }
#endif
    for (; i < n; ++i) hv[i] = t->left[f32_to_bf16(gg[i])] * t->right[f32_to_bf16(uu[i])];
}

/* h[m * I + i0 + r] = bf16(glu(bf16(g[r * DS_MAX_M + m]), bf16(u[...]))) for r < rows, m < M (the GEMV
 * kernels' layout): the valid entries packed together GLU_STEP rows at a time and evaluated in vector
 * loops, by the tables `t` where given (a batch's many chunks keep their used entries in cache), else
 * by glu_values. */
#define GLU_STEP 64
static void glu_block(const float *g, const float *u, int rows, int M, int act, float beta, float lbeta,
                      const glu_table *t, uint16_t *h, int64_t I, int i0) {
    float gg[GLU_STEP * DS_MAX_M], uu[GLU_STEP * DS_MAX_M], hv[GLU_STEP * DS_MAX_M];
    for (int r0 = 0; r0 < rows; r0 += GLU_STEP) {
        const int nr = rows - r0 < GLU_STEP ? rows - r0 : GLU_STEP;
        for (int m = 0; m < M; ++m)
            for (int r = 0; r < nr; ++r) {
                gg[m * nr + r] = round_bf16(g[(r0 + r) * DS_MAX_M + m]);
                uu[m * nr + r] = round_bf16(u[(r0 + r) * DS_MAX_M + m]);
            }
        if (t) glu_lookup(gg, uu, nr * M, t, hv);
        else glu_values(gg, uu, nr * M, act, beta, lbeta, hv);
        for (int m = 0; m < M; ++m)
            for (int r = 0; r < nr; ++r) h[(int64_t)m * I + i0 + r0 + r] = f32_to_bf16(hv[m * nr + r]);
    }
}

/* Tile chunks: hv (the tile pack of h, K = I) gets rows i0..i0+15 of every m-block, h[m][i0 + r] =
 * glu(bf16(g), bf16(u)) as glu_block, from the products g, u in ds_amx_rows' layout. Pair rows (r, r+1)
 * interleave into one 64-byte row of the pack, so no separate pack pass over h is needed. */
static void glu_tiles(const float *g, const float *u, int MB, const glu_table *t, uint16_t *hv, int i0) {
    for (int mb = 0; mb < MB; ++mb) {
        const float *gb = g + mb * DS_TILE * DS_TILE, *ub = u + mb * DS_TILE * DS_TILE;
        uint16_t *dst = hv + (((int64_t)(i0 / 32) * MB + mb) * DS_TILE + (i0 % 32) / 2) * 32;
        for (int q = 0; q < DS_TILE / 2; ++q) {   /* rows 2q, 2q + 1 -> pack row q: [mm][2] */
#ifdef __AVX512F__
            __m512i h2[2];
            for (int o = 0; o < 2; ++o) {
                const int at = (2 * q + o) * DS_TILE;
                const __m512i gi = _mm512_cvtepu16_epi32(f32_to_bf16_x16(_mm512_loadu_ps(gb + at)));
                const __m512i ui = _mm512_cvtepu16_epi32(f32_to_bf16_x16(_mm512_loadu_ps(ub + at)));
                const __m512 h = _mm512_mul_ps(_mm512_i32gather_ps(gi, t->left, 4), _mm512_i32gather_ps(ui, t->right, 4));
                h2[o] = _mm512_cvtepu16_epi32(f32_to_bf16_x16(h));
            }
            _mm512_storeu_si512((void *)(dst + q * 32), _mm512_or_si512(h2[0], _mm512_slli_epi32(h2[1], 16)));
#else
            for (int mm = 0; mm < DS_TILE; ++mm)
                for (int o = 0; o < 2; ++o) {
                    const int at = (2 * q + o) * DS_TILE + mm;
                    dst[q * 32 + 2 * mm + o] = f32_to_bf16(t->left[f32_to_bf16(gb[at])] * t->right[f32_to_bf16(ub[at])]);
                }
#endif
        }
    }
}

/* ys[pair[m]][d0 + 16 b + r] = bf16(y[b][m-block m / 16][r][m % 16]) for b < nb (1 or 2; y[b] at
 * b * MB * 256), r < 16, m < M. Per m-block, rows 2q, 2q + 1 pack into dword row q (as in glu_tiles),
 * then a 16 x 16 dword transpose gives each pair's 16 nb outputs as one row. */
static void store_tiles(const float *y, int MB, int nb, int M, const int *pair, uint16_t *ys, int64_t D, int d0) {
    for (int mb = 0; mb < MB; ++mb) {
#ifdef __AVX512F__
        __m512i z[16];
        for (int q = 0; q < 16; ++q) {
            const int b = q / 8;
            if (b >= nb) { z[q] = _mm512_setzero_si512(); continue; }
            const float *yr = y + ((int64_t)b * MB + mb) * 256 + (q % 8) * 32;
            const __m512i even = _mm512_cvtepu16_epi32(f32_to_bf16_x16(_mm512_loadu_ps(yr)));
            const __m512i odd = _mm512_cvtepu16_epi32(f32_to_bf16_x16(_mm512_loadu_ps(yr + 16)));
            z[q] = _mm512_or_si512(even, _mm512_slli_epi32(odd, 16));
        }
        ds_transpose16(z);
        for (int mm = 0; mm < DS_TILE && mb * DS_TILE + mm < M; ++mm)
            _mm512_mask_storeu_epi32(ys + (int64_t)pair[mb * DS_TILE + mm] * D + d0, nb == 2 ? 0xffff : 0xff, z[mm]);
#else
        for (int mm = 0; mm < DS_TILE && mb * DS_TILE + mm < M; ++mm)
            for (int b = 0; b < nb; ++b)
                for (int r = 0; r < DS_TILE; ++r)
                    ys[(int64_t)pair[mb * DS_TILE + mm] * D + d0 + b * DS_TILE + r] =
                        f32_to_bf16(y[((int64_t)b * MB + mb) * 256 + r * DS_TILE + mm]);
#endif
    }
}

/* The M pairs of one expert at `start` of the pair order. With `shared` the caller is inside a parallel
 * region and the row loops are split across its threads (the scratch is shared). Tile chunks run
 * gate and up of the same 16 rows as one two-block ds_tile_rows call, and down two 16-row blocks a call. */
static void moe_chunk(const experts_job *j, int start, int M, chunk_scratch *s, int shared) {
    const int D = j->D, I = j->I, e = (int)j->ids[j->order[start]], MB = (M + DS_TILE - 1) / DS_TILE;
    const int tiles = j->amx && M >= j->min_pairs, R = tiles ? DS_TILE : j->packed ? DS_MX_ROWS(M) : DS_ROWS(M);
    const int DR = tiles ? 2 * R : R;
    const int nt = shared ? omp_get_num_threads() : 1, me = shared ? omp_get_thread_num() : 0;
    if (me == 0) {
        for (int m = 0; m < M; ++m)
            memcpy(s->xg + (int64_t)m * D, j->x + (int64_t)(j->order[start + m] / j->k) * D, sizeof(uint16_t) * D);
        if (tiles) {
            ds_amx_pack(s->xg, D, M, D, s->xv);
            ds_tiles_count(MB);
        }
    }
    if (shared) {
        #pragma omp barrier
    }
    const int iblocks = (I + R - 1) / R, dblocks = (D + DR - 1) / DR;   /* contiguous share per thread */
    const int lo = R * (iblocks * me / nt), hi = R * (iblocks * (me + 1) / nt) < I ? R * (iblocks * (me + 1) / nt) : I;
    float gu[2 * ACC_MAX];   /* gate products, then up */
    if (tiles)
        for (int i0 = lo; i0 < hi; i0 += R) {
            const void *w[2] = {j->w1, j->w3};
            const uint8_t *sc[2] = {j->s1, j->s3};
            const int64_t r0[2] = {(int64_t)e * I + i0, (int64_t)e * I + i0};
            ds_tile_rows(w, sc, j->packed, r0, 2, D, s->xv, MB, gu);
            glu_tiles(gu, gu + MB * DS_TILE * DS_TILE, MB, j->glu, s->hv, i0);
        }
    else
        for (int b0 = lo; b0 < hi; b0 += GLU_ROWS) {   /* the products of GLU_ROWS rows, then their GLU */
            const int b1 = hi - b0 < GLU_ROWS ? hi : b0 + GLU_ROWS;
            for (int i0 = b0; i0 < b1; i0 += R) {
                const int rows = b1 - i0 < R ? b1 - i0 : R;
                float *at = gu + (int64_t)(i0 - b0) * DS_MAX_M;
                ds_expert_rows(j->w1, j->s1, j->packed, (int64_t)e * I + i0, rows, D, s->xg, M, at);
                ds_expert_rows(j->w3, j->s3, j->packed, (int64_t)e * I + i0, rows, D, s->xg, M, at + ACC_MAX);
            }
            glu_block(gu, gu + ACC_MAX, b1 - b0, M, j->act, j->beta, j->lbeta, j->glu, s->h, I, b0);
        }
    if (shared) {
        #pragma omp barrier
    }
    for (int d0 = DR * (dblocks * me / nt); d0 < D && d0 < DR * (dblocks * (me + 1) / nt); d0 += DR) {
        float y[2 * ACC_MAX];
        const int rows = D - d0 < DR ? D - d0 : DR;
        const int64_t row = (int64_t)e * D + d0;
        if (tiles) {
            const int nw = rows / DS_TILE;
            const void *w[2] = {j->w2, j->w2};
            const uint8_t *sc[2] = {j->s2, j->s2};
            const int64_t r0[2] = {row, row + DS_TILE};
            ds_tile_rows(w, sc, j->packed, r0, nw, I, s->hv, MB, y);
            store_tiles(y, MB, nw, M, j->order + start, j->ys, D, d0);
            continue;
        }
        ds_expert_rows(j->w2, j->s2, j->packed, row, rows, I, s->h, M, y);
        for (int m = 0; m < M; ++m)
            for (int r = 0; r < rows; ++r)
                j->ys[(int64_t)j->order[start + m] * D + d0 + r] = f32_to_bf16(y[r * DS_MAX_M + m]);
    }
}

/* out[N, D] = sum_j wts[n, j] * bf16(w2_e @ act(w1_e x_n, w3_e x_n)), e = ids[n, j], the fp32
 * sum over j in slot order, rounded to bf16 once: the contract of ops.moe.grouped_experts.
 * Weights bf16 [E, I, D] / [E, D, I], or MXFP4 (packed=1: [E, I, D/2] + scales [E, I, D/32]).
 * Each expert's weights are read once per chunk of its pairs. Returns 0, -1 (allocation), -2 (bad id). */
int ds_moe_experts(const uint16_t *x, int N, int D, const int64_t *ids, const float *wts, int k,
                   int E, int I, int packed, const void *w1, const uint8_t *s1, const void *w3,
                   const uint8_t *s3, const void *w2, const uint8_t *s2, int act, float beta,
                   float lbeta, uint16_t *out, int nthreads) {
    for (int64_t p = 0; p < (int64_t)N * k; ++p)
        if (ids[p] < 0 || ids[p] >= E) return -2;
    return ds_moe_experts_held(x, N, D, ids, wts, k, E, I, packed, w1, s1, w3, s3, w2, s2, act, beta, lbeta, out,
                               nthreads);
}

/* One token's held pairs, in slot order, on the batch-1 kernel (moe_row.c); none held: out = 0. */
static int row_held(const uint16_t *x, int D, const int64_t *ids, const float *wts, int k, int E, int I, int packed,
                    const void *w1, const uint8_t *s1, const void *w3, const uint8_t *s3, const void *w2,
                    const uint8_t *s2, int act, float beta, float lbeta, uint16_t *out, int nthreads) {
    int64_t held_ids[DS_ROW_MAX_K];
    float held_wts[DS_ROW_MAX_K];
    int n = 0;
    for (int j = 0; j < k; ++j)
        if (ids[j] >= 0) held_ids[n] = ids[j], held_wts[n++] = wts[j];
    if (n == 0) {
        memset(out, 0, sizeof(uint16_t) * (size_t)D);
        return 0;
    }
    return ds_moe_experts_row(x, D, held_ids, held_wts, n, E, I, packed, w1, s1, w3, s3, w2, s2, act, beta, lbeta,
                              out, nthreads);
}

int ds_moe_experts_held(const uint16_t *x, int N, int D, const int64_t *ids, const float *wts, int k, int E, int I,
                        int packed, const void *w1, const uint8_t *s1, const void *w3, const uint8_t *s3,
                        const void *w2, const uint8_t *s2, int act, float beta, float lbeta, uint16_t *out,
                        int nthreads) {
    if (N == 1 && k >= 1 && k <= DS_ROW_MAX_K)   /* batch-1 decode: one region, one barrier (moe_row.c) */
        return row_held(x, D, ids, wts, k, E, I, packed, w1, s1, w3, s3, w2, s2, act, beta, lbeta, out, nthreads);
    const int P = N * k;
    int *count = calloc((size_t)E + 1, sizeof(int));
    int *order = malloc(sizeof(int) * (size_t)(P > 0 ? P : 1));
    int *chunk = malloc(sizeof(int) * ((size_t)P + 1));   /* first pair of each chunk, then P */
    uint16_t *ys = malloc(sizeof(uint16_t) * (size_t)P * D + 2);
    int *fill = malloc(sizeof(int) * (size_t)(E > 0 ? E : 1));
    int rc = !count || !order || !chunk || !ys || !fill ? -1 : 0;
    for (int p = 0; p < P && rc == 0; ++p) {
        if (ids[p] < -1 || ids[p] >= E) rc = -2;
        else if (ids[p] >= 0) count[ids[p] + 1]++;
    }
    if (rc == 0) {
        for (int e = 0; e < E; ++e) count[e + 1] += count[e];
        memcpy(fill, count, sizeof(int) * (size_t)E);
        for (int p = 0; p < P; ++p)   /* stable: pair order kept */
            if (ids[p] >= 0) order[fill[ids[p]]++] = p;
        glu_table own;
        int owned = 0;
        const glu_table *glu = glu_get(act, beta, lbeta, &own, &owned);
        const int tiles = glu && ds_tiles_ready() && D % 32 == 0 && I % 32 == 0;
        const experts_job job = {x, D, I, k, packed, act, tiles, count, order, ids, w1, w3, w2, s1, s3, s2,
                                 beta, lbeta, glu, ys, min_pairs()};
        int chunks = 0, widest = 1;
        for (int e = 0; e < E; ++e)
            chunks += split_pairs(job.amx, job.min_pairs, count[e], count[e + 1], chunk + chunks);
        chunk[chunks] = count[E];
        for (int c = 0; c < chunks; ++c) widest = chunk[c + 1] - chunk[c] > widest ? chunk[c + 1] - chunk[c] : widest;
        int bad = 0;
        if (chunks >= 2 * nthreads) {
            /* Each thread runs whole chunks in private scratch: one fork/join for all experts. */
            #pragma omp parallel num_threads(nthreads) reduction(| : bad)
            {
                chunk_scratch s;
                const int ok = scratch_alloc(&s, widest, D, I);
                bad |= !ok;
                if (job.amx) ds_tiles_begin();
                #pragma omp for schedule(dynamic, 1)
                for (int c = 0; c < chunks; ++c)
                    if (ok) moe_chunk(&job, chunk[c], chunk[c + 1] - chunk[c], &s, 0);
                scratch_free(&s);
            }
        } else {
            /* Few chunks (a lone dense MLP, tiny batches): every thread shares each chunk's rows. */
            chunk_scratch s;
            bad = !scratch_alloc(&s, widest, D, I);
            for (int c = 0; c < chunks && !bad; ++c) {
                #pragma omp parallel num_threads(nthreads)
                {
                    if (job.amx) ds_tiles_begin();
                    moe_chunk(&job, chunk[c], chunk[c + 1] - chunk[c], &s, 1);
                }
            }
            scratch_free(&s);
        }
        rc = bad ? -1 : 0;
        if (owned) free(own.left);
    }
    if (rc == 0) ds_moe_combine_held(ys, NULL, ids, wts, N, k, D, out, nthreads);
    free(count); free(order); free(chunk); free(ys); free(fill);
    return rc;
}
