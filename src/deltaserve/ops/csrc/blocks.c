/* deltaserve CPU kernels for whole blocks of a small batch (decode) in one call each, composed of the
 * kernels the block's modules call one by one, in the same order with the same roundings, so the
 * results are bit-identical to those paths. What they save is the Python, ctypes and allocation
 * work between the calls (~250 us a layer).
 *
 * ds_moe_block (model/moe_layer.py MoeBlock.forward):
 *   logits = fp32(x @ gate^T), z = x @ down^T (K3 latent; else z = x)   one pass over both weights
 *   (w, ids) = route(logits)                                            ds_route
 *   r = experts(z, ids, w)                                              ds_moe_experts
 *   r = rms_norm(r) (latent norm), r = r @ up^T (latent)                ds_rms_norm, linear
 *   out = bf16(f32(r) + f32(shared(x)))                                 single-expert ds_moe_experts
 * ds_kda_block (model/kda_layer.py KdaAttention._native_decode): q, k, v, f_a, b, g (or g_a) in one
 * pass over x; f = f_a @ f_b^T, g = g_a @ g_b^T (low-rank gate); ds_kda_decode; out = o @ o_proj^T.
 */
#include <stdint.h>
#include <stdlib.h>
#include "bf16.h"
#include "internal.h"

/* The static part of one block; the bindings fill it once per module (ops/native_blocks.py). */
typedef struct {
    int D, E, L, I, SI;              /* hidden, experts, expert input (latent or D), expert width, shared width */
    int top_k, groups, topk_group, renormalize, bias_in_weights;
    float scale, norm_eps, beta, lbeta;
    int act, packed;
    const uint16_t *gate;            /* [E, D] */
    const float *bias;               /* [E] or NULL */
    const uint16_t *down, *up;       /* [L, D], [D, L] or NULL (no latent) */
    const float *norm_w;             /* [L] or NULL */
    const void *w1, *w3, *w2;        /* routed experts, as ds_moe_experts */
    const uint8_t *s1, *s3, *s2;
    const uint16_t *sh1, *sh3, *sh2; /* shared experts [SI, D], [SI, D], [D, SI] or NULL */
} ds_moe_block_t;

int ds_linear_bf16_multi(const uint16_t *x, int M, int K, const uint16_t *const *w, const int *N, const int *f32,
                         void *const *y, int nw, int nthreads);
int ds_linear_amx_multi(const uint16_t *x, int M, int K, const uint16_t *const *w, const int *N, const int *f32,
                        void *const *y, int nw, int nthreads);
int ds_route(const float *logits, int64_t n, int e, const float *bias, int top_k, int groups, int topk_group,
             int renormalize, float scale, int bias_in_weights, float *w_out, int64_t *ids_out);
int ds_moe_experts(const uint16_t *x, int N, int D, const int64_t *ids, const float *wts, int k, int E, int I,
                   int packed, const void *w1, const uint8_t *s1, const void *w3, const uint8_t *s3,
                   const void *w2, const uint8_t *s2, int act, float beta, float lbeta, uint16_t *out,
                   int nthreads);
void ds_rms_norm(const uint16_t *x, int64_t ldx, int N, int D, const float *w, float eps, uint16_t *out,
                 int64_t ldo, int nthreads);
int ds_kda_decode(int B, int H, int K, int W, const uint16_t *xq, const uint16_t *xk, const uint16_t *xv,
                  const float *conv_w, uint16_t *tails, float *states, const int64_t *slots, const uint16_t *f,
                  const float *a_log, const float *dt_bias, int gate_kind, float lower_bound,
                  const uint16_t *b_logit, const uint16_t *gate, const float *norm_w, float eps, float scale,
                  uint16_t *out, int nthreads);

/* The projections of x, on the kernel linear_bf16_multi's binding picks for M rows. */
static int project(const uint16_t *x, int M, int K, const uint16_t *const *w, const int *N, const int *f32,
                   void *const *y, int nw, int nthreads) {
    if (M <= DS_MAX_M) return ds_linear_bf16_multi(x, M, K, w, N, f32, y, nw, nthreads);
    return ds_linear_amx_multi(x, M, K, w, N, f32, y, nw, nthreads);
}

/* out [N, D] bf16 for x [N, D] bf16. Returns 0; -1 allocation; -3 the router's limits do not hold
 * (nothing written: the caller takes the per-module path). N must be within what the projections
 * take (MAX_ROWS, or AMX_ROWS with tiles). */
int ds_moe_block(const ds_moe_block_t *b, const uint16_t *x, int N, uint16_t *out, int nthreads) {
    const int D = b->D, L = b->down ? b->L : D, k = b->top_k;
    float *logits = malloc(sizeof(float) * (size_t)N * b->E), *w = malloc(sizeof(float) * (size_t)N * k);
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)N * k);
    uint16_t *z = malloc(sizeof(uint16_t) * (size_t)N * L), *r = malloc(sizeof(uint16_t) * (size_t)N * L);
    uint16_t *rn = malloc(sizeof(uint16_t) * (size_t)N * L), *y = malloc(sizeof(uint16_t) * (size_t)N * D);
    uint16_t *s = malloc(sizeof(uint16_t) * (size_t)N * D);
    int rc = logits && w && ids && z && r && rn && y && s ? 0 : -1;
    if (rc == 0) {   /* router logits (fp32) and the latent down-projection in one pass */
        const uint16_t *ws[2] = {b->gate, b->down};
        const int ns[2] = {b->E, L}, f32[2] = {1, 0};
        void *ys[2] = {logits, z};
        rc = project(x, N, D, ws, ns, f32, ys, b->down ? 2 : 1, nthreads) ? -1 : 0;
    }
    if (rc == 0 && ds_route(logits, N, b->E, b->bias, k, b->groups, b->topk_group, b->renormalize, b->scale,
                            b->bias_in_weights, w, ids) != 0)
        rc = -3;
    if (rc == 0)
        rc = ds_moe_experts(b->down ? z : x, N, L, ids, w, k, b->E, b->I, b->packed, b->w1, b->s1, b->w3, b->s3,
                            b->w2, b->s2, b->act, b->beta, b->lbeta, r, nthreads) ? -1 : 0;
    const uint16_t *routed = r;
    if (rc == 0 && b->norm_w) {
        ds_rms_norm(r, L, N, L, b->norm_w, b->norm_eps, rn, L, nthreads);
        routed = rn;
    }
    if (rc == 0 && b->up) {
        const int nd = D, f0 = 0;
        void *yp = y;
        rc = project(routed, N, L, &b->up, &nd, &f0, &yp, 1, nthreads) ? -1 : 0;
        routed = y;
    }
    if (rc == 0 && b->sh1) {
        int64_t *zero = calloc((size_t)N, sizeof(int64_t));
        float *one = malloc(sizeof(float) * (size_t)N);
        rc = zero && one ? 0 : -1;
        for (int n = 0; rc == 0 && n < N; ++n) one[n] = 1.0f;
        if (rc == 0)
            rc = ds_moe_experts(x, N, D, zero, one, 1, 1, b->SI, 0, b->sh1, NULL, b->sh3, NULL, b->sh2, NULL,
                                b->act, b->beta, b->lbeta, s, nthreads) ? -1 : 0;
        free(zero);
        free(one);
    }
    if (rc == 0)
        for (int64_t t = 0; t < (int64_t)N * D; ++t)
            out[t] = b->sh1 ? f32_to_bf16(bf16_to_f32(routed[t]) + bf16_to_f32(s[t])) : routed[t];
    free(logits); free(w); free(ids); free(z); free(r); free(rn); free(y); free(s);
    return rc;
}

typedef struct {
    int D, H, K, W, full_gate, gate_kind;       /* P = H * K channels per q/k/v */
    float lower_bound, eps, scale;
    const uint16_t *q, *k, *v, *f_a, *f_b, *b, *g, *g_b, *o;   /* bf16 weights; g is g_proj or g_a_proj */
    const float *conv_w, *a_log, *dt_bias, *norm_w;            /* fp32 as ds_kda_decode takes them */
} ds_kda_block_t;

/* out [N, D] for x [N, D] (N within what the projections take), updating tails/states at slots in
 * place as ds_kda_decode. Returns 0, -1 allocation, -2 a slot outside [0, num_slots). */
int ds_kda_block(const ds_kda_block_t *b, const uint16_t *x, int N, uint16_t *tails, float *states,
                 const int64_t *slots, int64_t num_slots, uint16_t *out, int nthreads) {
    const int D = b->D, K = b->K, P = b->H * b->K, G = b->full_gate ? P : K;
    for (int n = 0; n < N; ++n)
        if (slots[n] < 0 || slots[n] >= num_slots) return -2;
    uint16_t *buf = malloc(sizeof(uint16_t) * (size_t)N * (6 * P + 2 * K + b->H));
    if (!buf) return -1;
    uint16_t *q = buf, *k = q + (size_t)N * P, *v = k + (size_t)N * P, *g = v + (size_t)N * P;
    uint16_t *f = g + (size_t)N * P, *o = f + (size_t)N * P, *fa = o + (size_t)N * P, *ga = fa + (size_t)N * K;
    uint16_t *bl = ga + (size_t)N * K;
    const uint16_t *ws[6] = {b->q, b->k, b->v, b->f_a, b->b, b->g};
    const int ns[6] = {P, P, P, K, b->H, G}, zero[6] = {0};
    void *ys[6] = {q, k, v, fa, bl, b->full_gate ? (void *)g : (void *)ga};
    const int nd = D;
    void *f_out = f, *g_out = g, *o_out = out;
    int rc = project(x, N, D, ws, ns, zero, ys, 6, nthreads) ? -1 : 0;
    if (rc == 0) rc = project(fa, N, K, &b->f_b, &ns[0], zero, &f_out, 1, nthreads) ? -1 : 0;
    if (rc == 0 && !b->full_gate) rc = project(ga, N, K, &b->g_b, &ns[0], zero, &g_out, 1, nthreads) ? -1 : 0;
    if (rc == 0)
        rc = ds_kda_decode(N, b->H, K, b->W, q, k, v, b->conv_w, tails, states, slots, f, b->a_log, b->dt_bias,
                           b->gate_kind, b->lower_bound, bl, g, b->norm_w, b->eps, b->scale, o, nthreads) ? -1 : 0;
    if (rc == 0) rc = project(o, N, P, &b->o, &nd, zero, &o_out, 1, nthreads) ? -1 : 0;
    free(buf);
    return rc;
}
