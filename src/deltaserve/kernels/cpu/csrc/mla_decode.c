/* deltaserve CPU kernel: absorbed MLA decode attention straight over the paged latent cache
 * (spec/model.md §7). One query token per sequence b; all H heads share the latent rows:
 *   o[b, h, :R] = sum_j softmax_j(scale * q[b, h, :] . row_j) * row_j[:R]
 * with row_j = rows[read_rows[cu_kv[b] + j]], j over the whole context of b (new row included).
 * fp32 scores, softmax and accumulation; the weights rounded to bf16 for the value product, as
 * torch's SDPA runs bf16 inputs on CPU (the value pass then takes two rows a `vdpbf16ps`: 1.12-1.36x
 * a call, Zen 4, 2 threads, 4k-64k rows; the same error against a float64 oracle); bf16 output.
 * Work splits each sequence's context into chunks of at most MLA_CHUNK rows, as even as
 * `chunk_rows` makes them (flash-decoding style), whose partial
 * (max, sum, accumulator) triples are merged per sequence, so one long sequence uses every thread.
 * Each thread takes a contiguous share of the chunks and prefetches the next one's rows while it
 * computes this one: a chunk's score pass reads its rows at the dot products' pace (~19 GB/s a
 * thread, more than one core streams), its value pass reads nothing new; spread over both passes
 * the reads keep up (AMD EPYC Zen 4, 2 threads, 16-row pages in random order: 1.2-1.5x a call at
 * 16-64k rows, batch-1 decode steps 1.03x at 4k context, 1.07x at 16k; bit-identical).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "ds_abi.h"
#include "bf16.h"
#include "internal.h"
#include "vmath.h"
#include "mla_scores.h"

#define ML_AHEAD 4   /* the score pass prefetches the row this far ahead (and the one after) where it starts a page run */
#define LANES 16   /* independent partial sums: lets the compiler vectorise the dot products */
#define ML_SCRATCH(D, H) ((D) + (H) * MLA_CHUNK + ((H) * MLA_CHUNK + 2) / 2)   /* floats: row, weights, bf16 weights */

/* Whether the scores run on `vdpbf16ps` over the bf16 queries (else dot_f32 over fp32 copies). */
static inline int ml_fast(int D) {
#ifdef ML_AVX512BF16
    return D % 32 == 0;
#else
    (void)D;
    return 0;
#endif
}

/* sum_d a[d] * b[d] in LANES interleaved partial sums (a fixed order, vectorisable under ISO C). */
static inline float dot_f32(const float *a, const float *b, int n) {
    float part[LANES] = {0};
    int d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int l = 0; l < LANES; ++l) part[l] += a[d + l] * b[d + l];
    float s = 0.f;
    for (int l = 0; l < LANES; ++l) s += part[l];
    for (; d < n; ++d) s += a[d] * b[d];
    return s;
}

#ifdef ML_AVX512BF16
/* Sweep t of a chunk's `sweeps` passes over its rows (the score pass, then one per 32 value columns)
 * prefetches lines [first_line(t), first_line(t + 1)) of each of the next chunk's rows into L2: the
 * next chunk's reads spread evenly over this chunk's compute. */
static inline int first_line(int t, int sweeps, int lines) { return (t * lines + sweeps - 1) / sweeps; }

static inline void prefetch_lines(const uint16_t *rows, int64_t at, int D, int c0, int c1) {
    const char *p = (const char *)(rows + at * (int64_t)D);
    for (int c = c0; c < c1; ++c) _mm_prefetch(p + c * 64, _MM_HINT_T1);
}
#endif

/* Partial attention of all heads over rows [j0, j1) of one sequence (qf: the queries in fp32, read
 * only where D % 32 != 0 or without AVX512-BF16). part: H * (R + 2) floats
 * laid out per head as [m, l, acc(R)]. scratch: ML_SCRATCH(D, H) floats. next: the next_n row
 * indices of the chunk the thread runs next (NULL: none), prefetched meanwhile. */
static void mla_chunk(const float *qf, const uint16_t *qb, int H, int D, int R, const uint16_t *rows,
                      const int64_t *idx, int64_t j0, int64_t j1, const int64_t *next, int next_n, float scale,
                      float *part, float *scratch) {
    float *row = scratch, *s = scratch + D;
    uint16_t *sb = (uint16_t *)(s + H * MLA_CHUNK);   /* the weights in bf16, a zero past an odd n */
    const int n = (int)(j1 - j0);
#ifdef ML_AVX512BF16
    const int lines = (D * 2 + 63) / 64, sweeps = 1 + R / 32;
#endif
    const int fast = ml_fast(D);
    int scored = 0;   /* rows whose scores are in s */
#ifdef ML_AVX512BF16
    if (!fast && D % 16 == 0 && ml_scores_pairs(qf, H, D, rows, idx + j0, n, scale, s)) {
        for (int j = 0; j < next_n && next; ++j) prefetch_lines(rows, next[j], D, 0, first_line(1, sweeps, lines));
        scored = n;
    }
#endif
    for (int j = scored, nb; j < n; j += nb) {
        nb = fast && j + 3 <= n ? 3 : 1;   /* three rows a pass over the query */
        const uint16_t *r[3];
        float dots[3][DS_MLA_MAX_HEADS];
        for (int b = 0; b < nb; ++b) {
            r[b] = rows + idx[j0 + j + b] * (int64_t)D;
#ifdef ML_AVX512BF16
            const int jb = j + b;
            if (next && jb < next_n) prefetch_lines(rows, next[jb], D, 0, first_line(1, sweeps, lines));
            if (jb + ML_AHEAD < n && idx[j0 + jb + ML_AHEAD] != idx[j0 + jb + ML_AHEAD - 1] + 1) {   /* a new page run */
                const uintptr_t ahead = (uintptr_t)(rows + idx[j0 + jb + ML_AHEAD] * (int64_t)D);   /* the row after may end the pool */
                for (int c = 0; c < 2 * lines; ++c) _mm_prefetch((const char *)(ahead + (uintptr_t)c * 64), _MM_HINT_T0);
            }
#endif
        }
#ifdef ML_AVX512BF16
        if (nb == 3) ml_scores(qb, H, D, r, 3, dots);
        else if (fast) ml_scores(qb, H, D, r, 1, dots);
        else
#endif
        {
            for (int d = 0; d < D; ++d) row[d] = bf16_to_f32(r[0][d]);
            for (int h = 0; h < H; ++h) dots[0][h] = dot_f32(qf + (int64_t)h * D, row, D);
        }
        for (int b = 0; b < nb; ++b)
            for (int h = 0; h < H; ++h) s[h * MLA_CHUNK + j + b] = scale * dots[b][h];
    }
    for (int h = 0; h < H; ++h) {   /* each head's maximum, in vector steps (H <= DS_MLA_MAX_HEADS) */
        float m = -FLT_MAX;
        const float *sh = s + h * MLA_CHUNK;
        #pragma omp simd reduction(max : m)
        for (int j = 0; j < n; ++j) m = sh[j] > m ? sh[j] : m;
        part[h * (R + 2)] = m;
    }
#ifdef ML_AVX512BF16
    for (int h = 0; h < H; ++h) {   /* the softmax weights, vectorised (ds_exp: within ~2 ulp of expf) */
        float *ph = part + h * (R + 2), *pv = s + h * MLA_CHUNK, l = 0.f;
        const float m = ph[0];
        #pragma omp simd reduction(+ : l)
        for (int j = 0; j < n; ++j) {
            pv[j] = ds_exp(pv[j] - m);
            l += pv[j];
        }
        ph[1] = l;
        for (int j = 0; j < n; ++j) sb[h * MLA_CHUNK + j] = f32_to_bf16(pv[j]);
        sb[h * MLA_CHUNK + n] = 0;
    }
#define ML_LOAD(r, o) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((r) + (o)))), 16))
    /* Groups of 8 heads: 32 output columns of the 8 heads stay in 16 registers across the chunk's
     * rows. Rows go in pairs: their 32 columns interleaved (`vpunpck*wd`: columns 0-3, 8-11, ... in
     * `lo`, 4-7, 12-15, ... in `hi`, reordered at the store), each head's two bf16 weights broadcast,
     * one `vdpbf16ps` a head and 16 columns for both rows: half the FMA-unit work of widening the rows
     * to fp32 (as torch's CPU flash attention, the weights are rounded to bf16 for this product; the
     * sums l stay fp32). */
    const __m512i to_lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i to_hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    int h0 = 0;
    for (; h0 + ML_GROUP <= H; h0 += ML_GROUP)
        for (int d = 0; d + 32 <= R; d += 32) {
            __m512 lo[ML_GROUP], hi[ML_GROUP];
            for (int k = 0; k < ML_GROUP; ++k) lo[k] = hi[k] = _mm512_setzero_ps();
            /* this sweep's share of the next chunk's lines (the first group's sweeps cover them all) */
            const int c0 = h0 == 0 && next ? first_line(1 + d / 32, sweeps, lines) : 0;
            const int c1 = h0 == 0 && next ? first_line(2 + d / 32, sweeps, lines) : 0;
            for (int j = 0; j < n; j += 2) {
                if (j < next_n) prefetch_lines(rows, next[j], D, c0, c1);
                if (j + 1 < next_n) prefetch_lines(rows, next[j + 1], D, c0, c1);
                const __m512i r0 = _mm512_loadu_si512(rows + idx[j0 + j] * (int64_t)D + d);
                const __m512i r1 = j + 1 < n ? _mm512_loadu_si512(rows + idx[j0 + j + 1] * (int64_t)D + d) : r0;
                const __m512bh x0 = (__m512bh)_mm512_unpacklo_epi16(r0, r1), x1 = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
                const ds_pair_t *pairs = (const ds_pair_t *)(sb + h0 * MLA_CHUNK + j);   /* j even: aligned */
                for (int k = 0; k < ML_GROUP; ++k) {
                    lo[k] = ds_dp_bcast(lo[k], pairs + k * (MLA_CHUNK / 2), x0);
                    hi[k] = ds_dp_bcast(hi[k], pairs + k * (MLA_CHUNK / 2), x1);
                }
            }
            for (int j = n; j < next_n; ++j) prefetch_lines(rows, next[j], D, c0, c1);
            for (int k = 0; k < ML_GROUP; ++k) {
                _mm512_storeu_ps(part + (h0 + k) * (R + 2) + 2 + d, _mm512_permutex2var_ps(lo[k], to_lo, hi[k]));
                _mm512_storeu_ps(part + (h0 + k) * (R + 2) + 2 + d + 16, _mm512_permutex2var_ps(lo[k], to_hi, hi[k]));
            }
        }
    /* The other heads (and columns past the last 32) one head at a time, 64 columns in registers. */
    for (int h = 0; h < H; ++h) {
        float *ph = part + h * (R + 2);
        int d = h < h0 ? R / 32 * 32 : 0;
        for (; d + 64 <= R; d += 64) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int j = 0; j < n; ++j) {
                const uint16_t *r = rows + idx[j0 + j] * (int64_t)D + d;
                const __m512 p = _mm512_set1_ps(bf16_to_f32(sb[h * MLA_CHUNK + j]));
                a0 = _mm512_fmadd_ps(p, ML_LOAD(r, 0), a0);
                a1 = _mm512_fmadd_ps(p, ML_LOAD(r, 16), a1);
                a2 = _mm512_fmadd_ps(p, ML_LOAD(r, 32), a2);
                a3 = _mm512_fmadd_ps(p, ML_LOAD(r, 48), a3);
            }
            _mm512_storeu_ps(ph + 2 + d, a0);
            _mm512_storeu_ps(ph + 2 + d + 16, a1);
            _mm512_storeu_ps(ph + 2 + d + 32, a2);
            _mm512_storeu_ps(ph + 2 + d + 48, a3);
        }
        for (; d < R; ++d) {
            float a = 0.f;
            for (int j = 0; j < n; ++j) a += bf16_to_f32(sb[h * MLA_CHUNK + j]) * bf16_to_f32(rows[idx[j0 + j] * (int64_t)D + d]);
            ph[2 + d] = a;
        }
    }
#undef ML_LOAD
    (void)row;
#else
    (void)sb;
    for (int h = 0; h < H; ++h) {
        float *ph = part + h * (R + 2);
        ph[1] = 0.f;
        for (int d = 0; d < R; ++d) ph[2 + d] = 0.f;
    }
    for (int j = 0; j < n; ++j) {
        const uint16_t *r = rows + idx[j0 + j] * (int64_t)D;
        for (int d = 0; d < R; ++d) row[d] = bf16_to_f32(r[d]);
        for (int h = 0; h < H; ++h) {
            float *ph = part + h * (R + 2);
            const float p = expf(s[h * MLA_CHUNK + j] - ph[0]);
            ph[1] += p;
            float *acc = ph + 2;
            for (int d = 0; d < R; ++d) acc[d] += p * row[d];
        }
    }
#endif
}

/* Rows per chunk of a context of `len` rows cut into `chunks` = ceil(len / MLA_CHUNK): as even
 * as multiples of 16 allow (320 rows: 160 + 160, not 256 + 64), at most MLA_CHUNK, the last chunk
 * never empty. A function of the sequence's own length only, so a sequence attends alike alone
 * and in any batch. */
static inline int64_t chunk_rows(int64_t len, int64_t chunks) {
    const int64_t even = ((len + chunks - 1) / chunks + 15) / 16 * 16;
    return even < MLA_CHUNK ? even : MLA_CHUNK;
}

/* Item it (ascending calls): its sequence *b (advanced from the previous item's) and rows [*j0, *j1). */
static inline void item_span(const int64_t *first, const int64_t *cu_kv, int64_t it, int *b, int64_t *j0,
                             int64_t *j1) {
    while (first[*b + 1] <= it) ++*b;
    const int64_t size = chunk_rows(cu_kv[*b + 1] - cu_kv[*b], first[*b + 1] - first[*b]);
    *j0 = cu_kv[*b] + (it - first[*b]) * size;
    *j1 = *j0 + size < cu_kv[*b + 1] ? *j0 + size : cu_kv[*b + 1];
}

/* ds_mla_decode (out bf16) and ds_mla_decode_partial (out32 fp32 and lse; sequences may have no row). */
static int mla_decode(int B, int H, int D, int R, const uint16_t *q, const uint16_t *rows, const int64_t *read_rows,
                      const int64_t *cu_kv, float scale, uint16_t *out, float *out32, float *lse, int nthreads) {
    if (H > DS_MLA_MAX_HEADS || R > DS_MLA_MAX_RANK) return -2;
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(B + 1));
    if (!first) return -1;
    first[0] = 0;
    for (int b = 0; b < B; ++b) {
        const int64_t len = cu_kv[b + 1] - cu_kv[b];
        if (len < (lse ? 0 : 1)) { free(first); return -2; }
        first[b + 1] = first[b] + (len + MLA_CHUNK - 1) / MLA_CHUNK;
    }
    const int64_t items = first[B];
    const int scalar = !ml_fast(D);   /* mla_chunk's scores from fp32 queries (else from q itself) */
    float *parts = malloc(sizeof(float) * (size_t)(items > 0 ? items : 1) * H * (R + 2));
    float *qf = scalar ? malloc(sizeof(float) * (size_t)B * H * D) : NULL;
    if (!parts || (scalar && !qf)) { free(first); free(parts); free(qf); return -1; }
    for (int64_t i = 0; scalar && i < (int64_t)B * H * D; ++i) qf[i] = bf16_to_f32(q[i]);
    int bad = 0;
    #pragma omp parallel num_threads(nthreads) reduction(| : bad)
    {
        float *scratch = malloc(sizeof(float) * (size_t)ML_SCRATCH(D, H));
        if (!scratch) bad |= 1;
        /* a contiguous share of the items, so the next one's rows are known (prefetched meanwhile) */
        const int nt = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t lo = items * me / nt, hi = items * (me + 1) / nt;
        int b = 0;
        int64_t j0 = 0, j1 = 0;
        if (scratch && lo < hi) item_span(first, cu_kv, lo, &b, &j0, &j1);
        for (int64_t it = lo; scratch && it < hi; ++it) {
            int nb = b;
            int64_t n0 = 0, n1 = 0;
            if (it + 1 < hi) item_span(first, cu_kv, it + 1, &nb, &n0, &n1);
            mla_chunk(qf ? qf + (int64_t)b * H * D : NULL, q + (int64_t)b * H * D, H, D, R, rows, read_rows, j0, j1,
                      it + 1 < hi ? read_rows + n0 : NULL, (int)(n1 - n0), scale, parts + it * H * (R + 2), scratch);
            b = nb, j0 = n0, j1 = n1;
        }
        free(scratch);
    }
    if (bad) { free(first); free(parts); free(qf); return -1; }
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (B * H >= 4)
    for (int t = 0; t < B * H; ++t) {
        const int b = t / H, h = t % H;
        float acc[DS_MLA_MAX_RANK];
        ds_merge_partials(parts + (first[b] * H + h) * (R + 2), (int64_t)H * (R + 2), first[b + 1] - first[b], R, 0,
                          out32 ? out32 + (int64_t)t * R : acc, out ? out + (int64_t)t * R : NULL, lse ? lse + t : NULL);
    }
    free(first); free(parts); free(qf);
    return 0;
}

int ds_mla_decode(int B, int H, int D, int R, const uint16_t *q, const uint16_t *rows, const int64_t *read_rows,
                  const int64_t *cu_kv, float scale, uint16_t *out, int nthreads) {
    return mla_decode(B, H, D, R, q, rows, read_rows, cu_kv, scale, out, NULL, NULL, nthreads);
}

int ds_mla_decode_partial(int B, int H, int D, int R, const uint16_t *q, const uint16_t *rows,
                          const int64_t *read_rows, const int64_t *cu_kv, float scale, float *out, float *lse,
                          int nthreads) {
    return mla_decode(B, H, D, R, q, rows, read_rows, cu_kv, scale, NULL, out, lse, nthreads);
}
