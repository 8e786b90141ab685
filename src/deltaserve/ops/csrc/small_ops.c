/* deltaserve CPU kernels: the per-token elementwise/reduction ops of a decoder layer, fused so a
 * decode step pays one call instead of a dozen tensor ops (spec/model.md §3, §5).
 * Same formulas and rounding points as ops.norms.rms_norm and ops.attn_res.attn_res_mix (fp32
 * math on bf16 inputs, bf16 results); reductions run in a different order.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include "bf16.h"

#define LANES 16   /* independent partial sums: lets the compiler vectorise the reductions */

/* (sum_d v[d] * q[d], sum_d v[d]^2) of a bf16 row v, in LANES interleaved partial sums. */
static inline void dot_and_square(const uint16_t *v, const float *q, int n, float *dot, float *sq) {
    float pd[LANES] = {0}, ps[LANES] = {0};
    int d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int l = 0; l < LANES; ++l) {
            const float x = bf16_to_f32(v[d + l]);
            ps[l] += x * x;
            if (q) pd[l] += x * q[d + l];
        }
    float sd = 0.f, ss = 0.f;
    for (int l = 0; l < LANES; ++l) { sd += pd[l]; ss += ps[l]; }
    for (; d < n; ++d) {
        const float x = bf16_to_f32(v[d]);
        ss += x * x;
        if (q) sd += x * q[d];
    }
    *dot = sd;
    *sq = ss;
}

/* KimiRMSNorm: y = bf16(x * rsqrt(mean(x^2) + eps)); out = bf16(w * y). x, out [N, D] with row
 * strides ldx / ldo; w [D] fp32. */
void ds_rms_norm(const uint16_t *x, int64_t ldx, int N, int D, const float *w, float eps,
                 uint16_t *out, int64_t ldo, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if ((int64_t)N * D >= (1 << 15))
    for (int n = 0; n < N; ++n) {
        const uint16_t *xr = x + (int64_t)n * ldx;
        float unused, ss;
        dot_and_square(xr, 0, D, &unused, &ss);
        const float r = 1.f / sqrtf(ss / (float)D + eps);
        uint16_t *o = out + (int64_t)n * ldo;
        for (int d = 0; d < D; ++d)
            o[d] = f32_to_bf16(w[d] * bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[d]) * r)));
    }
}

/* Block AttnRes mix over S candidates xs[0..S-1] (the current block sum LAST), each [N, D] bf16:
 * score_s = (x_s . q) * rsqrt(mean(x_s^2) + eps) with q = norm * proj (fp32), a = softmax_s,
 * out = bf16(sum_s a_s x_s). */
void ds_attn_res_mix(const uint16_t *const *xs, int S, int N, int D, const float *q, float eps,
                     uint16_t *out, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if ((int64_t)N * D * S >= (1 << 15))
    for (int n = 0; n < N; ++n) {
        float score[64], m = -INFINITY, sum = 0.f;
        const int s_cap = S < 64 ? S : 64;
        for (int s = 0; s < s_cap; ++s) {
            const uint16_t *xr = xs[s] + (int64_t)n * D;
            float dot, ss;
            dot_and_square(xr, q, D, &dot, &ss);
            score[s] = dot * (1.f / sqrtf(ss / (float)D + eps));
            if (score[s] > m) m = score[s];
        }
        for (int s = 0; s < s_cap; ++s) { score[s] = expf(score[s] - m); sum += score[s]; }
        for (int s = 0; s < s_cap; ++s) score[s] /= sum;
        uint16_t *o = out + (int64_t)n * D;
        for (int d = 0; d < D; ++d) {
            float acc = 0.f;
            for (int s = 0; s < s_cap; ++s) acc += score[s] * bf16_to_f32(xs[s][(int64_t)n * D + d]);
            o[d] = f32_to_bf16(acc);
        }
    }
}
