/* GLU activations of the fused expert kernels (spec/model.md §10), on gate/up values already
 * rounded to bf16, with torch's rounding points: SiTU computes in fp32 (the caller rounds once);
 * SiLU rounds silu(gate) to bf16, then the product (vmath.h functions: within 1 bf16 ulp of
 * torch's). Each is ONE fp32 product left(g) * right(u) (no contraction under -std=c11), which
 * moe_decode.c's lookup tables rely on to stay bit-identical. */
#ifndef DELTASERVE_GLU_H
#define DELTASERVE_GLU_H
#include "bf16.h"
#include "ds_abi.h"
#include "vmath.h"

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static inline float situ_left(float g, float beta) { return beta * ds_tanh(g / beta) * ds_sigmoid(g); }
static inline float situ_right(float u, float lbeta) { return lbeta > 0.f ? lbeta * ds_tanh(u / lbeta) : u; }
static inline float silu_left(float g) { return round_bf16(g * ds_sigmoid(g)); }
static inline float glu_situ(float g, float u, float beta, float lbeta) { return situ_left(g, beta) * situ_right(u, lbeta); }
static inline float glu_silu(float g, float u) { return silu_left(g) * u; }

/* The prefill GLU's SiTU (moe_prefill.c): the same formula with its three fractions sharing one
 * division (ib = 1 / beta, il = 1 / lbeta); not bit-identical to glu_situ, within 1 bf16 ulp of it. */
static inline float glu_situ_one_division(float g, float u, float beta, float ib, float lbeta, float il) {
    float tn, td, sn, sd, un = u, ud = 1.0f;
    ds_tanh_frac(g * ib, &tn, &td);
    ds_sigmoid_frac(g, &sn, &sd);
    if (lbeta > 0.f) {
        ds_tanh_frac(u * il, &un, &ud);
        un *= lbeta;
    }
    return (beta * tn) * sn * un / (td * sd * ud);
}

/* hv[t] = act(gg[t], uu[t]) for t < n: contiguous operands, so the loop runs vectorised. */
static inline void glu_values(const float *gg, const float *uu, int n, int act, float beta, float lbeta, float *hv) {
    if (act == DS_ACT_SITU) {
        #pragma omp simd
        for (int t = 0; t < n; ++t) hv[t] = glu_situ(gg[t], uu[t], beta, lbeta);
    } else {
        #pragma omp simd
        for (int t = 0; t < n; ++t) hv[t] = glu_silu(gg[t], uu[t]);
    }
}

#endif
