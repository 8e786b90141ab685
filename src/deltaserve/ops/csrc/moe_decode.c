/* deltaserve fused routed experts for small batches (decode): the (token, slot) pairs are grouped by
 * expert, and each chunk of one expert's pairs runs gate/up, the GLU and down in one pass over that
 * expert's weights (bf16, or MXFP4 kept packed). Chunks of at least AMX_MIN_PAIRS pairs run on AMX
 * tiles (amx.c) when ds_amx_ready(), up to AMX_MAX_PAIRS (so prefill batches fit too); others on
 * the GEMV row kernels (cpu_kernels.c), up to DS_MAX_M pairs. Either way fp32 accumulation, bf16
 * results; only the summation order differs.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "bf16.h"
#include "vmath.h"
#include "internal.h"

enum { DS_ACT_SILU = 0, DS_ACT_SITU = 1 };
#define AMX_MIN_PAIRS 2
#define AMX_MAX_MB 16
#define AMX_MAX_PAIRS (DS_TILE * AMX_MAX_MB)   /* pairs per tile chunk (prefill: ~one expert's share) */
#define ACC_MAX (AMX_MAX_MB * DS_TILE * DS_TILE)   /* floats of one row block's products */

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* h = act(gate, up) from bf16-rounded gate/up, rounded to bf16 where torch's ops round:
 * SiTU computes in fp32 and rounds once; SiLU rounds silu(gate), then the product (vmath.h
 * functions: within 1 bf16 ulp of torch's). */
static inline float glu_situ(float g, float u, float beta, float lbeta) {
    float left = beta * ds_tanh(g / beta) * ds_sigmoid(g);
    return left * (lbeta > 0.f ? lbeta * ds_tanh(u / lbeta) : u);
}

static inline float glu_silu(float g, float u) { return round_bf16(g * ds_sigmoid(g)) * u; }

/* h[m * I + i0 + r] = bf16(glu(bf16(g[r * DS_MAX_M + m]), bf16(u[...]))) for r < rows, m < M (the GEMV
 * kernels' layout): valid entries are packed so the activation loop runs vectorised over them. */
static void glu_block(const float *g, const float *u, int rows, int M, int act, float beta, float lbeta,
                      uint16_t *h, int64_t I, int i0) {
    float gg[8 * DS_MAX_M], uu[8 * DS_MAX_M], hv[8 * DS_MAX_M];
    const int n = rows * M;
    for (int r = 0; r < rows; ++r)
        for (int m = 0; m < M; ++m) {
            gg[r * M + m] = round_bf16(g[r * DS_MAX_M + m]);
            uu[r * M + m] = round_bf16(u[r * DS_MAX_M + m]);
        }
    if (act == DS_ACT_SITU) {
        #pragma omp simd
        for (int t = 0; t < n; ++t) hv[t] = glu_situ(gg[t], uu[t], beta, lbeta);
    } else {
        #pragma omp simd
        for (int t = 0; t < n; ++t) hv[t] = glu_silu(gg[t], uu[t]);
    }
    for (int r = 0; r < rows; ++r)
        for (int m = 0; m < M; ++m) h[(int64_t)m * I + i0 + r] = f32_to_bf16(hv[r * M + m]);
}

typedef struct {
    const uint16_t *x;
    int D, I, k, packed, act, amx;
    const int *count, *order;
    const int64_t *ids;
    const void *w1, *w3, *w2;
    const uint8_t *s1, *s3, *s2;
    float beta, lbeta;
    uint16_t *ys;   /* [pairs, D] bf16 expert outputs */
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

/* Pairs in the chunk that starts at pair `start` of an expert whose pairs end at `end`. */
static int chunk_pairs(int amx, int start, int end) {
    const int left = end - start;
    if (amx && left >= AMX_MIN_PAIRS) return left < AMX_MAX_PAIRS ? left : AMX_MAX_PAIRS;
    return left < DS_MAX_M ? left : DS_MAX_M;
}

/* acc = the products of weight rows row0.. (R of them; 16 on tiles) with the chunk's M activations
 * (x rows, or their tile pack xv), in ds_expert_rows' or ds_amx_rows' layout. */
static void block_rows(int tiles, const void *w, const uint8_t *s, int packed, int64_t row0, int R, int K,
                       const uint16_t *x, const uint16_t *xv, int M, float *acc) {
    if (tiles) ds_amx_rows(w, s, packed, row0, K, xv, (M + DS_TILE - 1) / DS_TILE, acc);
    else ds_expert_rows(w, s, packed, row0, R, K, x, M, acc);
}

/* Tile chunks: hv (the tile pack of h, K = I) gets rows i0..i0+15 of every m-block, h[m][i0 + r] =
 * glu(bf16(g), bf16(u)) as glu_block, from the products g, u in ds_amx_rows' layout. Pair rows (r, r+1)
 * interleave into one 64-byte row of the pack, so no separate pack pass over h is needed. */
static void glu_tiles(const float *g, const float *u, int MB, int act, float beta, float lbeta, uint16_t *hv,
                      int i0) {
    float gg[DS_TILE * DS_TILE], uu[DS_TILE * DS_TILE], hh[DS_TILE * DS_TILE];
    for (int mb = 0; mb < MB; ++mb) {
        const float *gb = g + mb * DS_TILE * DS_TILE, *ub = u + mb * DS_TILE * DS_TILE;
#ifdef __AVX512F__
        for (int t = 0; t < DS_TILE * DS_TILE; t += 16) {
            _mm512_storeu_ps(gg + t, bf16_to_f32_x16(f32_to_bf16_x16(_mm512_loadu_ps(gb + t))));
            _mm512_storeu_ps(uu + t, bf16_to_f32_x16(f32_to_bf16_x16(_mm512_loadu_ps(ub + t))));
        }
#else
        for (int t = 0; t < DS_TILE * DS_TILE; ++t) {
            gg[t] = round_bf16(gb[t]);
            uu[t] = round_bf16(ub[t]);
        }
#endif
        if (act == DS_ACT_SITU) {
            #pragma omp simd
            for (int t = 0; t < DS_TILE * DS_TILE; ++t) hh[t] = glu_situ(gg[t], uu[t], beta, lbeta);
        } else {
            #pragma omp simd
            for (int t = 0; t < DS_TILE * DS_TILE; ++t) hh[t] = glu_silu(gg[t], uu[t]);
        }
        uint16_t *dst = hv + (((int64_t)(i0 / 32) * MB + mb) * DS_TILE + (i0 % 32) / 2) * 32;
        for (int q = 0; q < DS_TILE / 2; ++q) {   /* rows 2q, 2q + 1 -> pack row q: [mm][2] */
#ifdef __AVX512F__
            const __m512i even = _mm512_cvtepu16_epi32(f32_to_bf16_x16(_mm512_loadu_ps(hh + 2 * q * DS_TILE)));
            const __m512i odd = _mm512_cvtepu16_epi32(f32_to_bf16_x16(_mm512_loadu_ps(hh + (2 * q + 1) * DS_TILE)));
            _mm512_storeu_si512((void *)(dst + q * 32), _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
#else
            for (int mm = 0; mm < DS_TILE; ++mm) {
                dst[q * 32 + 2 * mm] = f32_to_bf16(hh[(2 * q) * DS_TILE + mm]);
                dst[q * 32 + 2 * mm + 1] = f32_to_bf16(hh[(2 * q + 1) * DS_TILE + mm]);
            }
#endif
        }
    }
}

/* ys[pair[m]][d0 + r] = bf16(y[m-block m / 16][r][m % 16]) for r < 16, m < M: y converted 16 lanes at a
 * time, then each pair's 16 outputs gathered from its column. */
static void store_tiles(const float *y, int M, const int *pair, uint16_t *ys, int64_t D, int d0) {
    uint16_t yb[ACC_MAX];
    const int n = (M + DS_TILE - 1) / DS_TILE * DS_TILE * DS_TILE;
#ifdef __AVX512F__
    for (int t = 0; t < n; t += 16) _mm256_storeu_si256((__m256i *)(yb + t), f32_to_bf16_x16(_mm512_loadu_ps(y + t)));
#else
    for (int t = 0; t < n; ++t) yb[t] = f32_to_bf16(y[t]);
#endif
    for (int m = 0; m < M; ++m) {
        const uint16_t *col = yb + (m / DS_TILE) * DS_TILE * DS_TILE + m % DS_TILE;
        uint16_t *dst = ys + (int64_t)pair[m] * D + d0;
        for (int r = 0; r < DS_TILE; ++r) dst[r] = col[r * DS_TILE];
    }
}

/* One chunk of one expert's pairs. With `shared` the caller is inside a parallel region and the row
 * loops are split across its threads (the scratch is shared). */
static void moe_chunk(const experts_job *j, int start, chunk_scratch *s, int shared) {
    const int D = j->D, I = j->I, e = (int)j->ids[j->order[start]];
    const int M = chunk_pairs(j->amx, start, j->count[e + 1]);
    const int tiles = j->amx && M >= AMX_MIN_PAIRS, R = tiles ? DS_TILE : DS_ROWS(M);
    const int nt = shared ? omp_get_num_threads() : 1, me = shared ? omp_get_thread_num() : 0;
    if (me == 0) {
        for (int m = 0; m < M; ++m)
            memcpy(s->xg + (int64_t)m * D, j->x + (int64_t)(j->order[start + m] / j->k) * D, sizeof(uint16_t) * D);
        if (tiles) {
            ds_amx_pack(s->xg, D, M, D, s->xv);
            ds_amx_count();
        }
    }
    if (shared) {
        #pragma omp barrier
    }
    const int iblocks = (I + R - 1) / R, dblocks = (D + R - 1) / R;   /* contiguous share per thread */
    for (int i0 = R * (iblocks * me / nt); i0 < I && i0 < R * (iblocks * (me + 1) / nt); i0 += R) {
        float g[ACC_MAX], u[ACC_MAX];
        const int rows = I - i0 < R ? I - i0 : R;
        block_rows(tiles, j->w1, j->s1, j->packed, (int64_t)e * I + i0, rows, D, s->xg, s->xv, M, g);
        block_rows(tiles, j->w3, j->s3, j->packed, (int64_t)e * I + i0, rows, D, s->xg, s->xv, M, u);
        if (tiles) glu_tiles(g, u, (M + DS_TILE - 1) / DS_TILE, j->act, j->beta, j->lbeta, s->hv, i0);
        else glu_block(g, u, rows, M, j->act, j->beta, j->lbeta, s->h, I, i0);
    }
    if (shared) {
        #pragma omp barrier
    }
    for (int d0 = R * (dblocks * me / nt); d0 < D && d0 < R * (dblocks * (me + 1) / nt); d0 += R) {
        float y[ACC_MAX];
        const int rows = D - d0 < R ? D - d0 : R;
        block_rows(tiles, j->w2, j->s2, j->packed, (int64_t)e * D + d0, rows, I, s->h, s->hv, M, y);
        if (tiles) {
            store_tiles(y, M, j->order + start, j->ys, D, d0);
            continue;
        }
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
    const int P = N * k;
    int *count = calloc((size_t)E + 1, sizeof(int));
    int *order = malloc(sizeof(int) * (size_t)(P > 0 ? P : 1));
    int *chunk = malloc(sizeof(int) * (size_t)(P > 0 ? P : 1));   /* first pair of each chunk */
    uint16_t *ys = malloc(sizeof(uint16_t) * (size_t)P * D + 2);
    int *fill = malloc(sizeof(int) * (size_t)(E > 0 ? E : 1));
    int rc = !count || !order || !chunk || !ys || !fill ? -1 : 0;
    for (int p = 0; p < P && rc == 0; ++p) {
        if (ids[p] < 0 || ids[p] >= E) rc = -2;
        else count[ids[p] + 1]++;
    }
    if (rc == 0) {
        for (int e = 0; e < E; ++e) count[e + 1] += count[e];
        memcpy(fill, count, sizeof(int) * (size_t)E);
        for (int p = 0; p < P; ++p) order[fill[ids[p]]++] = p;   /* stable: pair order kept */
        const experts_job job = {x, D, I, k, packed, act, ds_amx_ready() && D % 32 == 0 && I % 32 == 0,
                                 count, order, ids, w1, w3, w2, s1, s3, s2, beta, lbeta, ys};
        int chunks = 0, widest = 1;
        for (int e = 0; e < E; ++e)
            for (int start = count[e], n; start < count[e + 1]; start += n) {
                n = chunk_pairs(job.amx, start, count[e + 1]);
                widest = n > widest ? n : widest;
                chunk[chunks++] = start;
            }
        int bad = 0;
        if (chunks >= 2 * nthreads) {
            /* Each thread runs whole chunks in private scratch: one fork/join for all experts. */
            #pragma omp parallel num_threads(nthreads) reduction(| : bad)
            {
                chunk_scratch s;
                const int ok = scratch_alloc(&s, widest, D, I);
                bad |= !ok;
                if (job.amx) ds_amx_config();
                #pragma omp for schedule(dynamic, 1)
                for (int c = 0; c < chunks; ++c)
                    if (ok) moe_chunk(&job, chunk[c], &s, 0);
                scratch_free(&s);
            }
        } else {
            /* Few chunks (a lone dense MLP, tiny batches): every thread shares each chunk's rows. */
            chunk_scratch s;
            bad = !scratch_alloc(&s, widest, D, I);
            for (int c = 0; c < chunks && !bad; ++c) {
                #pragma omp parallel num_threads(nthreads)
                {
                    if (job.amx) ds_amx_config();
                    moe_chunk(&job, chunk[c], &s, 1);
                }
            }
            scratch_free(&s);
        }
        rc = bad ? -1 : 0;
    }
    if (rc == 0) ds_moe_combine(ys, NULL, wts, N, k, D, out, nthreads);
    free(count); free(order); free(chunk); free(ys); free(fill);
    return rc;
}
