/* deltaserve CPU kernel: absorbed MLA decode attention straight over the paged latent cache
 * (spec/model.md §7). One query token per sequence b; all H heads share the latent rows:
 *   o[b, h, :R] = sum_j softmax_j(scale * q[b, h, :] . row_j) * row_j[:R]
 * with row_j = rows[read_rows[cu_kv[b] + j]], j over the whole context of b (new row included).
 * fp32 scores, softmax and accumulation (as torch's SDPA runs bf16 inputs); bf16 output.
 * Work splits each sequence's context into chunks (flash-decoding style) whose partial
 * (max, sum, accumulator) triples are merged per sequence, so one long sequence uses every thread.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "ds_abi.h"
#include "bf16.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ML_AVX512BF16 1
#endif

#define MLA_CHUNK 256
#define LANES 16   /* independent partial sums: lets the compiler vectorise the dot products */

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

/* Partial attention of all heads over rows [j0, j1) of one sequence. part: H * (R + 2) floats
 * laid out per head as [m, l, acc(R)]. scratch: D + H * MLA_CHUNK floats. */
static void mla_chunk(const float *qf, const uint16_t *qb, int H, int D, int R, const uint16_t *rows,
                      const int64_t *idx, int64_t j0, int64_t j1, float scale, float *part, float *scratch) {
    float *row = scratch, *s = scratch + D;
    const int n = (int)(j1 - j0);
    for (int h = 0; h < H; ++h) part[h * (R + 2)] = -FLT_MAX;
    for (int j = 0; j < n; ++j) {
        const uint16_t *r = rows + idx[j0 + j] * (int64_t)D;
        float dots[DS_MLA_MAX_HEADS];
#ifdef ML_AVX512BF16
        if (D % 32 == 0 && H <= DS_MLA_MAX_HEADS) {
            for (int h = 0; h < H; ++h) {
                __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
                const uint16_t *qh = qb + (int64_t)h * D;
                int d = 0;
                for (; d + 64 <= D; d += 64) {
                    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qh + d), (__m512bh)_mm512_loadu_si512(r + d));
                    b = _mm512_dpbf16_ps(b, (__m512bh)_mm512_loadu_si512(qh + d + 32),
                                         (__m512bh)_mm512_loadu_si512(r + d + 32));
                }
                if (d < D)
                    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qh + d), (__m512bh)_mm512_loadu_si512(r + d));
                dots[h] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
            }
        } else
#endif
        {
            for (int d = 0; d < D; ++d) row[d] = bf16_to_f32(r[d]);
            for (int h = 0; h < H && h < DS_MLA_MAX_HEADS; ++h) dots[h] = dot_f32(qf + (int64_t)h * D, row, D);
        }
        for (int h = 0; h < H && h < DS_MLA_MAX_HEADS; ++h) {
            const float acc = scale * dots[h];
            s[h * MLA_CHUNK + j] = acc;
            if (acc > part[h * (R + 2)]) part[h * (R + 2)] = acc;
        }
    }
#ifdef ML_AVX512BF16
    /* Per head, 64 output columns at a time stay in registers across the chunk's rows. */
    for (int h = 0; h < H; ++h) {
        float *ph = part + h * (R + 2), *pv = s + h * MLA_CHUNK, l = 0.f;
        for (int j = 0; j < n; ++j) { pv[j] = expf(pv[j] - ph[0]); l += pv[j]; }
        ph[1] = l;
        int d = 0;
        for (; d + 64 <= R; d += 64) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int j = 0; j < n; ++j) {
                const uint16_t *r = rows + idx[j0 + j] * (int64_t)D + d;
                const __m512 p = _mm512_set1_ps(pv[j]);
#define ML_LOAD(o) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r + (o)))), 16))
                a0 = _mm512_fmadd_ps(p, ML_LOAD(0), a0);
                a1 = _mm512_fmadd_ps(p, ML_LOAD(16), a1);
                a2 = _mm512_fmadd_ps(p, ML_LOAD(32), a2);
                a3 = _mm512_fmadd_ps(p, ML_LOAD(48), a3);
#undef ML_LOAD
            }
            _mm512_storeu_ps(ph + 2 + d, a0);
            _mm512_storeu_ps(ph + 2 + d + 16, a1);
            _mm512_storeu_ps(ph + 2 + d + 32, a2);
            _mm512_storeu_ps(ph + 2 + d + 48, a3);
        }
        for (; d < R; ++d) {
            float a = 0.f;
            for (int j = 0; j < n; ++j) a += pv[j] * bf16_to_f32(rows[idx[j0 + j] * (int64_t)D + d]);
            ph[2 + d] = a;
        }
    }
    (void)row;
#else
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

int ds_mla_decode(int B, int H, int D, int R, const uint16_t *q, const uint16_t *rows,
                  const int64_t *read_rows, const int64_t *cu_kv, float scale, uint16_t *out,
                  int nthreads) {
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(B + 1));
    if (!first) return -1;
    first[0] = 0;
    for (int b = 0; b < B; ++b) {
        const int64_t len = cu_kv[b + 1] - cu_kv[b];
        if (len < 1) { free(first); return -2; }
        first[b + 1] = first[b] + (len + MLA_CHUNK - 1) / MLA_CHUNK;
    }
    const int64_t items = first[B];
    float *parts = malloc(sizeof(float) * (size_t)items * H * (R + 2));
    float *qf = malloc(sizeof(float) * (size_t)B * H * D);
    if (!parts || !qf) { free(first); free(parts); free(qf); return -1; }
    for (int64_t i = 0; i < (int64_t)B * H * D; ++i) qf[i] = bf16_to_f32(q[i]);
    int bad = 0;
    #pragma omp parallel num_threads(nthreads) reduction(| : bad)
    {
        float *scratch = malloc(sizeof(float) * (size_t)(D + H * MLA_CHUNK));
        if (!scratch) bad |= 1;
        int b = 0;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; ++it) {
            if (!scratch) continue;
            while (first[b + 1] <= it) ++b;   /* items ascend within each thread's share */
            while (first[b] > it) --b;
            const int64_t j0 = cu_kv[b] + (it - first[b]) * MLA_CHUNK;
            const int64_t j1 = j0 + MLA_CHUNK < cu_kv[b + 1] ? j0 + MLA_CHUNK : cu_kv[b + 1];
            mla_chunk(qf + (int64_t)b * H * D, q + (int64_t)b * H * D, H, D, R, rows, read_rows, j0, j1, scale,
                      parts + it * H * (R + 2), scratch);
        }
        free(scratch);
    }
    if (bad) { free(first); free(parts); free(qf); return -1; }
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (B * H >= 4)
    for (int t = 0; t < B * H; ++t) {
        const int b = t / H, h = t % H;
        float m = -FLT_MAX, l = 0.f;
        for (int64_t it = first[b]; it < first[b + 1]; ++it) {
            const float mi = parts[(it * H + h) * (R + 2)];
            if (mi > m) m = mi;
        }
        float acc[DS_MLA_MAX_RANK];
        const int r_cap = R < DS_MLA_MAX_RANK ? R : DS_MLA_MAX_RANK;
        for (int d = 0; d < r_cap; ++d) acc[d] = 0.f;
        for (int64_t it = first[b]; it < first[b + 1]; ++it) {
            const float *ph = parts + (it * H + h) * (R + 2);
            const float w = expf(ph[0] - m);
            l += w * ph[1];
            for (int d = 0; d < r_cap; ++d) acc[d] += w * ph[2 + d];
        }
        uint16_t *o = out + ((int64_t)b * H + h) * R;
        for (int d = 0; d < r_cap; ++d) o[d] = f32_to_bf16(acc[d] / l);
    }
    free(first); free(parts); free(qf);
    return 0;
}
