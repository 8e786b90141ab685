/* deltaserve CPU kernels: the per-token elementwise/reduction ops of a decoder layer, fused so a
 * decode step pays one call instead of a dozen tensor ops (spec/model.md §3, §5).
 * Same formulas and rounding points as ops.norms.rms_norm and ops.attn_res.attn_res_mix (fp32
 * math on bf16 inputs, bf16 results); reductions run in a different order.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

static inline float so_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t so_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* KimiRMSNorm: y = bf16(x * rsqrt(mean(x^2) + eps)); out = bf16(w * y). x, out [N, D] with row
 * strides ldx / ldo; w [D] fp32. */
void ds_rms_norm(const uint16_t *x, int64_t ldx, int N, int D, const float *w, float eps,
                 uint16_t *out, int64_t ldo, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if ((int64_t)N * D >= (1 << 15))
    for (int n = 0; n < N; ++n) {
        const uint16_t *xr = x + (int64_t)n * ldx;
        float ss = 0.f;
        for (int d = 0; d < D; ++d) { const float v = so_bf16_to_f32(xr[d]); ss += v * v; }
        const float r = 1.f / sqrtf(ss / (float)D + eps);
        uint16_t *o = out + (int64_t)n * ldo;
        for (int d = 0; d < D; ++d)
            o[d] = so_f32_to_bf16(w[d] * so_bf16_to_f32(so_f32_to_bf16(so_bf16_to_f32(xr[d]) * r)));
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
            float dot = 0.f, ss = 0.f;
            for (int d = 0; d < D; ++d) { const float v = so_bf16_to_f32(xr[d]); dot += v * q[d]; ss += v * v; }
            score[s] = dot * (1.f / sqrtf(ss / (float)D + eps));
            if (score[s] > m) m = score[s];
        }
        for (int s = 0; s < s_cap; ++s) { score[s] = expf(score[s] - m); sum += score[s]; }
        for (int s = 0; s < s_cap; ++s) score[s] /= sum;
        uint16_t *o = out + (int64_t)n * D;
        for (int d = 0; d < D; ++d) {
            float acc = 0.f;
            for (int s = 0; s < s_cap; ++s) acc += score[s] * so_bf16_to_f32(xs[s][(int64_t)n * D + d]);
            o[d] = so_f32_to_bf16(acc);
        }
    }
}
