/* deltaserve CPU kernel: causal softmax attention of a step's packed queries over each sequence's
 * keys and values, flash-attention style (MLA prefill, spec/model.md §7).
 * Sequence b has n_b query positions (G query rows each, from row G cu_q[b]) and c_b >= n_b
 * key/value rows (from row cu_kv[b]); query row j sits at position c_b - n_b + j / G and sees rows
 * [0, c_b - n_b + j / G]. A head's key is [k_nope (Dn) | k_rot (Dr)], k_rot one row every head
 * shares; values are Dv wide. The unabsorbed forms take G = 1 and H heads; the absorbed form
 * (MQA over the latent rows) one head with the H query heads folded into rows, G = H.
 *
 * Numerics as torch's CPU flash attention on bf16 inputs: scores in fp32 (bf16 products summed in
 * fp32), the online softmax in fp32, the probabilities rounded to bf16 for the value product,
 * fp32 accumulators, bf16 output.
 *
 * Layout: per (sequence, head), keys are first packed in blocks of FA_BK rows, pair-interleaved
 * ([pair p][key j] = dims 2p, 2p+1 of key j as one dword), values as [key pair][column] dwords, zero
 * past the sequence's rows; both are read FA_QB query rows at a time (their fp32 accumulators stay in
 * L2 while the blocks stream once per task). A register tile is FA_MR query rows x FA_BK keys: each
 * `vdpbf16ps` takes one broadcast query pair and 16 keys' pairs, so the scores and the value
 * product run on the dot-product unit alone. Tasks (sequence, head, block of query rows) go out largest
 * first. A sequence with FA_AHEAD_TASKS tasks a head or more has its blocks packed once ahead, read by
 * each task (heads in groups that fit the caller's `pack_bytes`; nothing ahead where one head's
 * blocks alone exceed it); the others' tasks pack each block they read into their own buffer
 * (packing ahead costs the writes and first-touch page faults, ~15 us a block of K3's sizes, against
 * ~1.7 us to pack one in cache: Zen 4). Where the tasks are fewer than 2 x threads (few queries over
 * a long context), each task's key blocks are split into spans whose partials are merged after
 * (`spans_for`, `merge_task`). Without AVX512-BF16 in the build the function returns -3 and the
 * caller takes PyTorch's path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "ds_abi.h"
#include "bf16.h"
#include "internal.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define FA_AVX512BF16 1
#endif

#define FA_BK 64                          /* keys a block */
#define FA_NZ (FA_BK / 16)                /* vectors a block's scores take per query */
#define FA_MR 6                           /* query rows a register tile */
#define FA_QB (16 * FA_MR)                /* query rows a task */
#define FA_AHEAD_TASKS 8                  /* tasks a head from which a sequence's blocks are packed ahead */
#define FA_MAX_SPANS 64                   /* key spans a task is split into at most (spans_for) */

#ifdef FA_AVX512BF16
typedef struct {
    int H, G, Dn, Dr, Dv, D2, DvP;        /* D2 key pairs (odd widths zero-padded), DvP = Dv rounded up to 16 */
    const uint16_t *q, *kn, *kr, *v;
    int64_t sq_t, sq_h, sk_t, sk_h, sr_t, sv_t, sv_h;
    const int64_t *cu_q, *cu_kv;
    float scale_log2;
} fa_args;

/* Dwords of one (sequence, head)'s packed keys and values per block. */
static inline int64_t block_dwords(const fa_args *a) { return (int64_t)a->D2 * FA_BK + (int64_t)(FA_BK / 2) * a->DvP; }

/* The joined key row (Dn + Dr bf16, zero-padded to 2 * D2) of row t of head h. */
static inline void key_row(const fa_args *a, int64_t t, int h, uint16_t *row) {
    memcpy(row, a->kn + t * a->sk_t + (int64_t)h * a->sk_h, sizeof(uint16_t) * a->Dn);
    if (a->Dr) memcpy(row + a->Dn, a->kr + t * a->sr_t, sizeof(uint16_t) * a->Dr);
    if ((a->Dn + a->Dr) & 1) row[a->Dn + a->Dr] = 0;
}

/* Packs block kb of rows [r0, r0 + c) of head h into dst (block_dwords dwords), zero past c. Keys:
 * 16 rows joined side by side (pairs zero-padded to a multiple of 16), then 16 x 16 dword transposes;
 * values: two rows' 16 columns widened to dwords and interleaved. */
static void pack_block(const fa_args *a, int64_t r0, int64_t c, int h, int64_t kb, uint32_t *dst) {
    uint32_t *kp = dst, *vp = dst + (int64_t)a->D2 * FA_BK;
    const int D2 = a->D2, P16 = (D2 + 15) & ~15;
    uint32_t rows[16 * P16];
    for (int j0 = 0; j0 < FA_BK; j0 += 16) {
        for (int j = 0; j < 16; ++j) {
            const int64_t t = kb * FA_BK + j0 + j;
            uint32_t *row = rows + j * P16;
            if (t < c) key_row(a, r0 + t, h, (uint16_t *)row);
            else memset(row, 0, sizeof(uint32_t) * D2);
            memset(row + D2, 0, sizeof(uint32_t) * (P16 - D2));
        }
        for (int p0 = 0; p0 < D2; p0 += 16) {
            __m512i z[16];
            for (int j = 0; j < 16; ++j) z[j] = _mm512_loadu_si512(rows + j * P16 + p0);
            ds_transpose16(z);   /* z[i] = pair p0 + i of the 16 keys */
            for (int i = 0; i < 16 && p0 + i < D2; ++i) _mm512_storeu_si512(kp + (int64_t)(p0 + i) * FA_BK + j0, z[i]);
        }
    }
    for (int jp = 0; jp < FA_BK / 2; ++jp) {
        const int64_t t = kb * FA_BK + 2 * jp;
        const uint16_t *v0 = t < c ? a->v + (r0 + t) * a->sv_t + (int64_t)h * a->sv_h : NULL;
        const uint16_t *v1 = t + 1 < c ? v0 + a->sv_t : NULL;
        uint32_t *o = vp + (int64_t)jp * a->DvP;
        for (int d = 0; d < a->DvP; d += 16) {
            const int left = a->Dv - d;
            const __mmask16 m = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
            const __m512i lo = v0 ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, v0 + d)) : _mm512_setzero_si512();
            const __m512i hi = v1 ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, v1 + d)) : _mm512_setzero_si512();
            _mm512_storeu_si512(o + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* 2^x for x <= 0 (below -126: ~0, never a NaN): a degree-6 polynomial of the fraction, scaled. */
static inline __m512 exp2_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Per-task state: the queries' pairs, fp32 accumulators, running max (log2 units) and sum. */
typedef struct {
    uint32_t *qp;          /* [FA_QB][D2] */
    float *acc;            /* [FA_QB][DvP] */
    float m[FA_QB], l[FA_QB];
    uint32_t *blk;         /* one block (block_dwords), packed as the task reads it where not packed ahead */
    uint32_t p[FA_MR * FA_BK / 2];   /* a tile's probabilities, bf16 pairs */
} fa_task;

/* P (rows x FA_BK, bf16) @ block values into acc rows [r0, r0 + FA_MR), columns [c0, c0 + 16 NZ). */
static inline __attribute__((always_inline)) void
value_tile(const uint32_t *p, const uint32_t *vp, int DvP, float *acc, int c0, const int NZ) {
    __m512 o[FA_MR][FA_NZ];
    for (int r = 0; r < FA_MR; ++r)
        for (int z = 0; z < NZ; ++z) o[r][z] = _mm512_loadu_ps(acc + (int64_t)r * DvP + c0 + 16 * z);
    for (int jp = 0; jp < FA_BK / 2; ++jp) {
        __m512bh w[FA_NZ];
        for (int z = 0; z < NZ; ++z) w[z] = (__m512bh)_mm512_loadu_si512(vp + (int64_t)jp * DvP + c0 + 16 * z);
        for (int r = 0; r < FA_MR; ++r) {
            const __m512bh pr = (__m512bh)_mm512_set1_epi32((int)p[r * (FA_BK / 2) + jp]);
            for (int z = 0; z < NZ; ++z) o[r][z] = _mm512_dpbf16_ps(o[r][z], pr, w[z]);
        }
    }
    for (int r = 0; r < FA_MR; ++r)
        for (int z = 0; z < NZ; ++z) _mm512_storeu_ps(acc + (int64_t)r * DvP + c0 + 16 * z, o[r][z]);
}

/* One register tile: query rows [i0, i0 + FA_MR) of the task (rows past its last repeat that one)
 * against key block kb; lim[r]: the last key position row i0 + r sees. */
static void tile_block(const fa_args *a, fa_task *t, int i0, const int64_t *lim, int64_t kb, const uint32_t *blk) {
    const int D2 = a->D2, DvP = a->DvP;
    const uint32_t *kp = blk, *vp = blk + (int64_t)D2 * FA_BK;
    __m512 s[FA_MR][FA_NZ];
    for (int r = 0; r < FA_MR; ++r)
        for (int z = 0; z < FA_NZ; ++z) s[r][z] = _mm512_setzero_ps();
    const uint32_t *qr = t->qp + (int64_t)i0 * D2;
    for (int pp = 0; pp < D2; ++pp) {
        __m512bh k[FA_NZ];
        for (int z = 0; z < FA_NZ; ++z) k[z] = (__m512bh)_mm512_loadu_si512(kp + (int64_t)pp * FA_BK + 16 * z);
        for (int r = 0; r < FA_MR; ++r) {
            const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)qr[(int64_t)r * D2 + pp]);
            for (int z = 0; z < FA_NZ; ++z) s[r][z] = _mm512_dpbf16_ps(s[r][z], qv, k[z]);
        }
    }
    const __m512 scale = _mm512_set1_ps(a->scale_log2);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int r = 0; r < FA_MR; ++r) {
        const int i = i0 + r;
        __mmask16 keep[FA_NZ];
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int z = 0; z < FA_NZ; ++z) {
            const int64_t first = kb * FA_BK + 16 * z, last = lim[r] - first;   /* lanes [0, last] seen */
            keep[z] = last >= 15 ? 0xFFFF : (last < 0 ? 0 : _mm512_cmple_epi32_mask(lane, _mm512_set1_epi32((int)last)));
            s[r][z] = _mm512_mul_ps(s[r][z], scale);
            mx = _mm512_mask_max_ps(mx, keep[z], mx, s[r][z]);
        }
        const float m_old = t->m[i], m_blk = _mm512_reduce_max_ps(mx), m_new = m_old > m_blk ? m_old : m_blk;
        const __m512 mv = _mm512_set1_ps(m_new);
        __m512 sum = _mm512_setzero_ps();
        for (int z = 0; z < FA_NZ; ++z) {
            s[r][z] = _mm512_maskz_mov_ps(keep[z], exp2_nonpos(_mm512_sub_ps(s[r][z], mv)));
            sum = _mm512_add_ps(sum, s[r][z]);
        }
        for (int z = 0; z < FA_NZ; z += 2)
            _mm512_storeu_si512(t->p + r * (FA_BK / 2) + 8 * z, (__m512i)_mm512_cvtne2ps_pbh(s[r][z + 1], s[r][z]));
        const float alpha = m_old == -INFINITY ? 0.f : (m_old == m_new ? 1.f : _mm512_cvtss_f32(exp2_nonpos(_mm512_set1_ps(m_old - m_new))));
        t->l[i] = t->l[i] * alpha + _mm512_reduce_add_ps(sum);
        t->m[i] = m_new;
        if (alpha != 1.f) {
            float *o = t->acc + (int64_t)i * DvP;
            const __m512 av = _mm512_set1_ps(alpha);
            for (int d = 0; d < DvP; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(av, _mm512_loadu_ps(o + d)));
        }
    }
    float *acc = t->acc + (int64_t)i0 * DvP;
    int c0 = 0;
    for (; c0 + 64 <= DvP; c0 += 64) value_tile(t->p, vp, DvP, acc, c0, 4);
    switch ((DvP - c0) / 16) {
    case 3: value_tile(t->p, vp, DvP, acc, c0, 3); break;
    case 2: value_tile(t->p, vp, DvP, acc, c0, 2); break;
    case 1: value_tile(t->p, vp, DvP, acc, c0, 1); break;
    default: break;
    }
}

/* A task: query rows [q0, q0 + FA_QB) (clipped) of sequence b, head h. Row j of the sequence is
 * position j / G of its n: it sees keys [0, c - n + j / G]. */
typedef struct { int b, h, q0, s; int64_t slot, cost; } fa_item;

static inline int task_rows(const fa_args *a, const fa_item *k) {
    const int64_t left = (a->cu_q[k->b + 1] - a->cu_q[k->b]) * a->G - k->q0;
    return left < FA_QB ? (int)left : FA_QB;
}

/* Span s of S of a task's key blocks (`packed` its blocks, or NULL: each is packed into t->blk as it
 * is read). S = 1: the normalised rows go to `out`; else the span's partial rows (max, sum, fp32
 * accumulators: FA_QB rows of DvP + 2) to `part`. */
static void run_task(const fa_args *a, fa_task *t, const fa_item *k, int S, const uint32_t *packed, float *part,
                     uint16_t *out) {
    const int b = k->b, h = k->h, q0 = k->q0;
    const int64_t n = a->cu_q[b + 1] - a->cu_q[b], c = a->cu_kv[b + 1] - a->cu_kv[b], row0 = a->cu_q[b] * a->G;
    const int rows = task_rows(a, k), tiles = (rows + FA_MR - 1) / FA_MR;
    const int D = a->Dn + a->Dr;
    int64_t lim[FA_QB];
    for (int i = 0; i < tiles * FA_MR; ++i) {   /* rows past the last repeat it */
        const int j = q0 + (i < rows ? i : rows - 1);
        uint16_t *dst = (uint16_t *)(t->qp + (int64_t)i * a->D2);
        memcpy(dst, a->q + (row0 + j) * a->sq_t + (int64_t)h * a->sq_h, sizeof(uint16_t) * D);
        if (D & 1) dst[D] = 0;
        lim[i] = c - n + j / a->G;
        t->m[i] = -INFINITY;
        t->l[i] = 0.f;
    }
    memset(t->acc, 0, sizeof(float) * (size_t)tiles * FA_MR * a->DvP);
    const int64_t nkb = (c - n + (q0 + rows - 1) / a->G) / FA_BK + 1;   /* through the last row's last block */
    for (int64_t kb = nkb * k->s / S; kb < nkb * (k->s + 1) / S; ++kb) {
        const uint32_t *blk = packed ? packed + kb * block_dwords(a) : t->blk;
        if (!packed) pack_block(a, a->cu_kv[b], c, h, kb, t->blk);
        for (int tl = 0; tl < tiles; ++tl) {
            const int i0 = tl * FA_MR;
            if (kb * FA_BK > lim[i0 + FA_MR - 1]) continue;   /* the block is past every row of the tile */
            tile_block(a, t, i0, lim + i0, kb, blk);
        }
    }
    for (int i = 0; i < rows; ++i) {
        const float *src = t->acc + (int64_t)i * a->DvP;
        if (part) {
            float *p = part + (int64_t)i * (a->DvP + 2);
            p[0] = t->m[i], p[1] = t->l[i];
            memcpy(p + 2, src, sizeof(float) * a->DvP);
            continue;
        }
        uint16_t *o = out + ((row0 + q0 + i) * a->H + h) * (int64_t)a->Dv;
        const float inv = 1.f / t->l[i];
        for (int d = 0; d < a->Dv; ++d) o[d] = f32_to_bf16(src[d] * inv);
    }
}

/* The S spans' partials of task k (`parts`: S x FA_QB rows of DvP + 2) merged into its output rows;
 * a span past a row's keys holds max -inf, sum 0: weight 0. acc: DvP floats of scratch. */
static void merge_task(const fa_args *a, const fa_item *k, int S, const float *parts, float *acc, uint16_t *out) {
    const int64_t pw = a->DvP + 2;
    for (int i = 0; i < task_rows(a, k); ++i)
        ds_merge_partials(parts + i * pw, FA_QB * pw, S, a->Dv, 1, acc,
                          out + ((a->cu_q[k->b] * a->G + k->q0 + i) * a->H + k->h) * (int64_t)a->Dv, NULL);
}

/* Spans a task's keys are split into: 1 where the tasks keep 2 x nthreads busy, else enough for that
 * (few queries over long contexts: a chunk after a prefix hit; flash-decoding style merge). */
static int spans_for(int64_t tasks, int nthreads) {
    if (tasks >= 2 * (int64_t)nthreads) return 1;
    const int64_t s = (2 * (int64_t)nthreads + tasks - 1) / tasks;
    return s > FA_MAX_SPANS ? FA_MAX_SPANS : (int)s;
}

/* Work items largest first (cost: rows x the keys the last row sees, a span its share). */
static int by_cost(const void *x, const void *y) {
    const int64_t a = ((const fa_item *)x)->cost, b = ((const fa_item *)y)->cost;
    return a < b ? 1 : (a > b ? -1 : 0);
}
#endif

int ds_flash_attention(int B, int H, int G, int Dn, int Dr, int Dv, const uint16_t *q, int64_t sq_t, int64_t sq_h,
                       const uint16_t *k_nope, int64_t sk_t, int64_t sk_h, const uint16_t *k_rot, int64_t sr_t,
                       const uint16_t *v, int64_t sv_t, int64_t sv_h, const int64_t *cu_q, const int64_t *cu_kv,
                       float scale, int64_t pack_bytes, uint16_t *out, int nthreads) {
#ifndef FA_AVX512BF16
    (void)B, (void)H, (void)G, (void)Dn, (void)Dr, (void)Dv, (void)q, (void)sq_t, (void)sq_h, (void)k_nope, (void)sk_t;
    (void)sk_h, (void)k_rot, (void)sr_t, (void)v, (void)sv_t, (void)sv_h, (void)cu_q, (void)cu_kv, (void)scale;
    (void)pack_bytes, (void)out, (void)nthreads;
    return -3;
#else
    const fa_args a = {H, G, Dn, Dr, Dv, (Dn + Dr + 1) / 2, (Dv + 15) / 16 * 16, q, k_nope, k_rot, v,
                       sq_t, sq_h, sk_t, sk_h, sr_t, sv_t, sv_h, cu_q, cu_kv, scale * 1.44269504088896f};
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(B + 1));   /* each sequence's first block packed ahead */
    if (!first) return -1;
    int64_t tasks = 0;   /* per head */
    first[0] = 0;
    for (int b = 0; b < B; ++b) {
        const int64_t n = cu_q[b + 1] - cu_q[b], c = cu_kv[b + 1] - cu_kv[b], nt = (n * G + FA_QB - 1) / FA_QB;
        if (n < 0 || c < n) { free(first); return -2; }
        tasks += nt;
        first[b + 1] = first[b] + (nt >= FA_AHEAD_TASKS ? (c + FA_BK - 1) / FA_BK : 0);
    }
    const int64_t blocks = first[B], head_dwords = blocks * block_dwords(&a);
    const int ahead = blocks > 0 && 4 * head_dwords <= pack_bytes;   /* else every task packs what it reads */
    const int64_t fit = ahead ? pack_bytes / (4 * head_dwords) : H;
    const int group = fit > H ? H : (int)fit;
    uint32_t *packed = ahead ? malloc(sizeof(uint32_t) * (size_t)(head_dwords * group)) : NULL;
    fa_item *tk = malloc(sizeof(fa_item) * (size_t)(tasks * group + 1));
    if ((ahead && !packed) || !tk) { free(first); free(packed); free(tk); return -1; }
    int bad = 0;
    for (int h0 = 0; h0 < H && !bad; h0 += group) {
        const int g = H - h0 < group ? H - h0 : group;
        int64_t nk = 0;
        for (int hh = 0; hh < g; ++hh)
            for (int b = 0; b < B; ++b) {
                const int64_t n = cu_q[b + 1] - cu_q[b], c = cu_kv[b + 1] - cu_kv[b];
                for (int64_t q0 = 0; q0 < n * G; q0 += FA_QB, ++nk)
                    tk[nk] = (fa_item){b, h0 + hh, (int)q0, 0, nk,
                                       (n * G - q0 < FA_QB ? n * G - q0 : FA_QB) * (c - n + (q0 + FA_QB) / G)};
            }
        const int S = spans_for(nk, nthreads);
        const int64_t ni = nk * S, part_floats = (int64_t)FA_QB * (a.DvP + 2);
        fa_item *items = malloc(sizeof(fa_item) * (size_t)ni);
        float *parts = S > 1 ? malloc(sizeof(float) * (size_t)(ni * part_floats)) : NULL;
        if (!items || (S > 1 && !parts)) { free(items); free(parts); bad = 1; break; }
        for (int64_t i = 0; i < ni; ++i) {
            items[i] = tk[i / S];
            items[i].s = (int)(i % S), items[i].slot = i, items[i].cost /= S;
        }
        qsort(items, (size_t)ni, sizeof(fa_item), by_cost);
        #pragma omp parallel num_threads(nthreads) reduction(| : bad)
        {
            #pragma omp for schedule(dynamic, 4)
            for (int64_t it = 0; it < (ahead ? (int64_t)g * blocks : 0); ++it) {
                const int hh = (int)(it / blocks);
                const int64_t kb = it % blocks;
                int b = 0;
                while (first[b + 1] <= kb) ++b;
                pack_block(&a, cu_kv[b], cu_kv[b + 1] - cu_kv[b], h0 + hh, kb - first[b],
                           packed + (hh * blocks + kb) * block_dwords(&a));
            }
            fa_task t;
            t.qp = malloc(sizeof(uint32_t) * (size_t)FA_QB * a.D2);
            t.acc = malloc(sizeof(float) * (size_t)FA_QB * a.DvP);
            t.blk = malloc(sizeof(uint32_t) * (size_t)block_dwords(&a));
            const int ok = t.qp && t.acc && t.blk;
            if (!ok) bad |= 1;
            #pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < ni; ++it) {
                const fa_item *w = &items[it];
                const int own = ahead && first[w->b + 1] > first[w->b];   /* its blocks were packed ahead */
                if (ok)
                    run_task(&a, &t, w, S, own ? packed + ((w->h - h0) * blocks + first[w->b]) * block_dwords(&a) : NULL,
                             parts ? parts + w->slot * part_floats : NULL, out);
            }
            if (parts) {
                #pragma omp for schedule(dynamic, 1)
                for (int64_t k = 0; k < nk; ++k)
                    if (ok) merge_task(&a, &tk[k], S, parts + k * S * part_floats, t.acc, out);
            }
            free(t.qp);
            free(t.acc);
            free(t.blk);
        }
        free(items);
        free(parts);
    }
    free(first);
    free(packed);
    free(tk);
    return bad ? -1 : 0;
#endif
}
