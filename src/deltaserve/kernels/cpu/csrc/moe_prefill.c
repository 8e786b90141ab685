/* deltaserve CPU kernels for large-M (prefill) MoE work: the GLU activations over rows of
 * bf16 GEMM outputs (glu.h) and the weighted combination of the routed
 * experts' outputs.
 *
 * GLU rounding points follow ops.activations: SiTU `beta*tanh(g/beta)*sigmoid(g) *
 * lbeta*tanh(u/lbeta)` (or `* u` when lbeta <= 0) in fp32, rounded once to bf16; SiLU rounds
 * silu(g) to bf16, then the product. Results agree with torch's within 1 bf16 ulp (the
 * transcendental functions differ in the last fp32 bits; SiTU's three fractions share one division).
 * Combine: out[i] = bf16(sum_j w[i, j] * ys[pos[i*k + j]]), the fp32 sum over slots j = 0..k-1
 * in order, products and sums rounded separately (no FMA under -std=c11), exactly as
 * ops.moe.grouped_experts sums.
 */
#include <stdint.h>
#include <omp.h>
#include "ds_abi.h"
#include "bf16.h"
#include "glu.h"
#include "internal.h"

#define COL_BLOCK 2048

static void glu_span(const uint16_t *g, const uint16_t *u, int64_t n, int act, float beta, float lbeta,
                     uint16_t *out) {
    float tmp[COL_BLOCK];
    const float ib = 1.0f / beta, il = lbeta > 0.f ? 1.0f / lbeta : 0.f;
    if (act == DS_ACT_SITU) {
        #pragma omp simd
        for (int64_t i = 0; i < n; ++i)
            tmp[i] = glu_situ_one_division(bf16_to_f32(g[i]), bf16_to_f32(u[i]), beta, ib, lbeta, il);
    } else {
        #pragma omp simd
        for (int64_t i = 0; i < n; ++i) tmp[i] = glu_silu(bf16_to_f32(g[i]), bf16_to_f32(u[i]));
    }
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(tmp[i]);
}

/* out[r, c] = glu(gate[r, c], up[r, c]) for r < rows, c < cols; each operand's rows are
 * `*_stride` elements apart (columns contiguous). Parallel over (row, column block). */
void ds_glu_rows_bf16(const uint16_t *gate, int64_t gate_stride, const uint16_t *up, int64_t up_stride,
                      int64_t rows, int64_t cols, int act, float beta, float lbeta, uint16_t *out,
                      int64_t out_stride, int nthreads) {
    const int64_t blocks = (cols + COL_BLOCK - 1) / COL_BLOCK, work = rows * blocks;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * cols >= (1 << 14))
    for (int64_t t = 0; t < work; ++t) {
        const int64_t r = t / blocks, c0 = (t % blocks) * COL_BLOCK;
        const int64_t n = cols - c0 < COL_BLOCK ? cols - c0 : COL_BLOCK;
        glu_span(gate + r * gate_stride + c0, up + r * up_stride + c0, n, act, beta, lbeta,
                 out + r * out_stride + c0);
    }
}

/* out[i, :] = bf16(sum_{j<k} w[i*k + j] * f32(ys[pos[i*k + j], :])), i < n, d columns; pos NULL
 * means ys is in slot order (pos[t] = t). Returns -2 if a position lies outside [0, n*k). */
int ds_moe_combine(const uint16_t *ys, const int64_t *pos, const float *w, int64_t n, int k, int d,
                   uint16_t *out, int nthreads) {
    return ds_moe_combine_held(ys, pos, NULL, w, n, k, d, out, nthreads);
}

int ds_moe_combine_held(const uint16_t *ys, const int64_t *pos, const int64_t *ids, const float *w, int64_t n, int k,
                        int d, uint16_t *out, int nthreads) {
    for (int64_t t = 0; pos && t < n * k; ++t)
        if (pos[t] < 0 || pos[t] >= n * k) return -2;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (n * d >= (1 << 14))
    for (int64_t i = 0; i < n; ++i) {
        float acc[COL_BLOCK];
        for (int c0 = 0; c0 < d; c0 += COL_BLOCK) {
            const int m = d - c0 < COL_BLOCK ? d - c0 : COL_BLOCK;
            int started = 0;
            for (int j = 0; j < k; ++j) {
                if (ids && ids[i * k + j] < 0) continue;
                const uint16_t *y = ys + (pos ? pos[i * k + j] : i * k + j) * (int64_t)d + c0;
                const float wj = w[i * k + j];
                if (!started) {
                    #pragma omp simd
                    for (int c = 0; c < m; ++c) acc[c] = wj * bf16_to_f32(y[c]);
                } else {
                    #pragma omp simd
                    for (int c = 0; c < m; ++c) acc[c] = acc[c] + wj * bf16_to_f32(y[c]);
                }
                started = 1;
            }
            for (int c = 0; c < m; ++c) out[i * (int64_t)d + c0 + c] = started ? f32_to_bf16(acc[c]) : 0;
        }
    }
    return 0;
}
