/* deltaserve fused experts for ONE token (batch-1 decode): its k (expert, weight) pairs in one
 * parallel region with one barrier, instead of a region and two barriers per pair. Phase 1 deals
 * the pairs' gate/up row blocks out in order (each thread streams its share of the experts' w1 rows,
 * then the same rows of w3: one sequential stream at a time, ~8% faster than alternating blocks of the
 * two; then the GLU over its whole share in one vector loop), phase 2
 * gives each thread a contiguous share of the D output rows of every pair's w2 and combines them.
 * The same row kernels, GLU and combine as ds_moe_experts' GEMV path (moe_decode.c, moe_prefill.c),
 * so the results are bit-identical to it at N = 1 (ds_moe_experts hands N = 1 calls here):
 *   h_j = bf16(glu(bf16(w1_e x), bf16(w3_e x))), ys_j = bf16(w2_e h_j), e = ids[j];
 *   out = bf16(w_0 ys_0 + w_1 ys_1 + ...), products and sums rounded separately, in slot order.
 */
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
#include "ds_abi.h"
#include "bf16.h"
#include "glu.h"
#include "internal.h"

#define ROWS DS_ROWS(1)   /* weight rows per row-kernel call at M = 1 */

/* Rows [lo, hi) of a span of n: thread me of nt's contiguous share of n items. */
static inline void share(int n, int me, int nt, int *lo, int *hi) {
    *lo = (int)((int64_t)n * me / nt);
    *hi = (int)((int64_t)n * (me + 1) / nt);
}

/* Weights as ds_moe_experts: bf16 [E, I, D] / [E, D, I], or MXFP4 (packed = 1) with scales.
 * Returns 0, -1 (allocation), -2 (an id outside [0, E)), -3 (k outside [1, DS_ROW_MAX_K]). */
int ds_moe_experts_row(const uint16_t *x, int D, const int64_t *ids, const float *wts, int k, int E, int I,
                       int packed, const void *w1, const uint8_t *s1, const void *w3, const uint8_t *s3,
                       const void *w2, const uint8_t *s2, int act, float beta, float lbeta, uint16_t *out,
                       int nthreads) {
    if (k < 1 || k > DS_ROW_MAX_K) return -3;
    for (int j = 0; j < k; ++j)
        if (ids[j] < 0 || ids[j] >= E) return -2;
    const int iblocks = (I + ROWS - 1) / ROWS, dblocks = (D + ROWS - 1) / ROWS;
    const size_t slots = (size_t)k * iblocks * ROWS;   /* gate/up values by (pair order, row block, row) */
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)k * I), *ys = malloc(sizeof(uint16_t) * (size_t)k * D);
    float *gg = malloc(sizeof(float) * 3 * slots), *uu = gg + slots, *hv = uu + slots;
    if (!h || !ys || !gg) { free(h); free(ys); free(gg); return -1; }
    int order[DS_ROW_MAX_K];   /* pairs by ascending expert id: the weights are visited in address order */
    for (int j = 0; j < k; ++j) {
        int at = j;
        while (at > 0 && ids[order[at - 1]] > ids[j]) { order[at] = order[at - 1]; --at; }
        order[at] = j;
    }
    #pragma omp parallel num_threads(nthreads)
    {
        const int nt = omp_get_num_threads(), me = omp_get_thread_num();
        int lo, hi;
        share(k * iblocks, me, nt, &lo, &hi);
        for (int pass = 0; pass < 2; ++pass)   /* all its gate rows, then all its up rows: one stream each */
            for (int t = lo; t < hi; ++t) {
                const int j = order[t / iblocks], i0 = (t % iblocks) * ROWS, rows = I - i0 < ROWS ? I - i0 : ROWS;
                float v[ROWS * DS_MAX_M], *dst = (pass ? uu : gg) + (int64_t)t * ROWS;
                ds_expert_rows(pass ? w3 : w1, pass ? s3 : s1, packed, ids[j] * (int64_t)I + i0, rows, D, x, 1, v);
                for (int r = 0; r < ROWS; ++r) dst[r] = r < rows ? round_bf16(v[r * DS_MAX_M]) : 0.f;   /* past I: 0 */
            }
        /* The GLU over the thread's whole share at once: full vectors (a block's ROWS values alone would
         * run the scalar remainder of glu_values' loop; the same values either way). */
        glu_values(gg + (int64_t)lo * ROWS, uu + (int64_t)lo * ROWS, (hi - lo) * ROWS, act, beta, lbeta,
                   hv + (int64_t)lo * ROWS);
        for (int t = lo; t < hi; ++t) {
            const int j = order[t / iblocks], i0 = (t % iblocks) * ROWS, rows = I - i0 < ROWS ? I - i0 : ROWS;
            for (int r = 0; r < rows; ++r) h[(int64_t)j * I + i0 + r] = f32_to_bf16(hv[(int64_t)t * ROWS + r]);
        }
        #pragma omp barrier
        share(dblocks, me, nt, &lo, &hi);
        const int d_lo = lo * ROWS, d_hi = hi * ROWS < D ? hi * ROWS : D;
        for (int o = 0; o < k; ++o)
            for (int d0 = d_lo, j = order[o]; d0 < d_hi; d0 += ROWS) {
                float y[ROWS * DS_MAX_M];
                const int rows = D - d0 < ROWS ? D - d0 : ROWS;
                ds_expert_rows(w2, s2, packed, ids[j] * (int64_t)D + d0, rows, I, h + (int64_t)j * I, 1, y);
                for (int r = 0; r < rows; ++r) ys[(int64_t)j * D + d0 + r] = f32_to_bf16(y[r * DS_MAX_M]);
            }
        for (int d = d_lo; d < d_hi; ++d) {
            float acc = wts[0] * bf16_to_f32(ys[d]);
            for (int j = 1; j < k; ++j) acc = acc + wts[j] * bf16_to_f32(ys[(int64_t)j * D + d]);
            out[d] = f32_to_bf16(acc);
        }
    }
    free(h);
    free(ys);
    free(gg);
    return 0;
}
