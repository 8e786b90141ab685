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
 * ds_mla_block (model/mla_layer.py MlaAttention.forward, decode): q_a (or q), kv_a
 * and the gate in one pass; q = q_b(norm(q_a)); the latent row [norm(c) | k_rot] written into the pool;
 * q_hat = W_UK^T q_nope per head; ds_mla_decode over the paged rows; o = W_UV o_lat per head. The
 * caller applies the output gate and o_proj (torch's sigmoid rounding stays torch's).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "ds_abi.h"
#include "bf16.h"
#include "internal.h"

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
    return ds_moe_block_reduced(b, x, N, NULL, out, nthreads);
}

int ds_moe_block_reduced(const ds_moe_block_t *b, const uint16_t *x, int N, ds_reduce_fn reduce, uint16_t *out,
                         int nthreads) {
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
    if (rc == 0 && b->held != b->E)   /* expert parallelism: this rank's experts by local id, the rest skipped */
        for (int64_t p = 0; p < (int64_t)N * k; ++p)
            ids[p] = ids[p] >= b->first && ids[p] < b->first + b->held ? ids[p] - b->first : -1;
    if (rc == 0)
        rc = ds_moe_experts_held(b->down ? z : x, N, L, ids, w, k, b->held, b->I, b->packed, b->w1, b->s1, b->w3,
                                 b->s3, b->w2, b->s2, b->act, b->beta, b->lbeta, r, nthreads) ? -1 : 0;
    if (rc == 0 && reduce && b->norm_w && reduce(r, NULL, (int64_t)N * L)) rc = -5;
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
    const int joined = reduce && b->norm_w;   /* routed is the whole sum already: the shared part joins it */
    if (rc == 0 && joined && b->sh1 && reduce(s, routed, (int64_t)N * D)) rc = -5;
    if (rc == 0)
        for (int64_t t = 0; t < (int64_t)N * D; ++t)
            out[t] = joined ? (b->sh1 ? s[t] : routed[t])
                            : b->sh1 ? f32_to_bf16(bf16_to_f32(routed[t]) + bf16_to_f32(s[t])) : routed[t];
    if (rc == 0 && reduce && !joined && reduce(out, NULL, (int64_t)N * D)) rc = -5;
    free(logits); free(w); free(ids); free(z); free(r); free(rn); free(y); free(s);
    return rc;
}

/* out [N, D] for x [N, D] (N within what the projections take), updating tails/states at slots in
 * place as ds_kda_decode. `record` (or NULL): what ds_kda_decode reads of each row but for the output
 * gate, as planes q | k | v | f [N, P] then b [N, H] (N (4P + H) bf16: a speculative verify's rows, for
 * ds_kda_replay). Returns 0, -1 allocation, -2 a slot outside [0, num_slots). */
int ds_kda_block(const ds_kda_block_t *b, const uint16_t *x, int N, uint16_t *tails, float *states,
                 const int64_t *slots, int64_t num_slots, uint16_t *record, uint16_t *out, int nthreads) {
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
    if (rc == 0 && record) {   /* q, k, v are adjacent planes in buf */
        const size_t np = (size_t)N * P;
        memcpy(record, q, sizeof(uint16_t) * 3 * np);
        memcpy(record + 3 * np, f, sizeof(uint16_t) * np);
        memcpy(record + 4 * np, bl, sizeof(uint16_t) * (size_t)N * b->H);
    }
    if (rc == 0)
        rc = ds_kda_decode(N, b->H, K, b->W, q, k, v, b->conv_w, tails, states, slots, f, b->a_log, b->dt_bias,
                           b->gate_kind, b->lower_bound, bl, g, b->norm_w, b->eps, b->scale, o, nthreads) ? -1 : 0;
    if (rc == 0) rc = project(o, N, P, &b->o, &nd, zero, &o_out, 1, nthreads) ? -1 : 0;
    free(buf);
    return rc;
}

int ds_kda_replay(const ds_kda_block_t *const *layers, int L, const uint16_t *const *records, int N,
                  const int64_t *rows, int M, const int64_t *slots, uint16_t *const *tails, float *const *states,
                  int64_t num_slots, int nthreads) {
    if (M < 1) return 0;
    for (int i = 0; i < M; ++i)
        if (rows[i] < 0 || rows[i] >= N || slots[i] < 0 || slots[i] >= num_slots) return -2;
    size_t most = 0;   /* one scratch for every layer, sized for the widest */
    for (int l = 0; l < L; ++l) {
        const size_t need = 6 * (size_t)M * layers[l]->H * layers[l]->K + (size_t)M * layers[l]->H;
        if (need > most) most = need;
    }
    /* the rows' q | k | v | f planes, the output gate, the output, b (the gate reaches only the output,
     * which is not kept) */
    uint16_t *buf = calloc(most, sizeof(uint16_t));
    if (!buf) return -1;
    int rc = 0;
    for (int l = 0; rc == 0 && l < L; ++l) {
        const ds_kda_block_t *b = layers[l];
        const int H = b->H, P = b->H * b->K;
        const size_t np = (size_t)N * P, mp = (size_t)M * P;
        uint16_t *gate = buf + 4 * mp, *o = gate + mp, *bl = o + mp;
        const uint16_t *rec = records[l];
        for (int i = 0; i < M; ++i) {
            for (int part = 0; part < 4; ++part)
                memcpy(buf + part * mp + (size_t)i * P, rec + part * np + (size_t)rows[i] * P, sizeof(uint16_t) * P);
            memcpy(bl + (size_t)i * H, rec + 4 * np + (size_t)rows[i] * H, sizeof(uint16_t) * H);
        }
        rc = ds_kda_decode(M, H, b->K, b->W, buf, buf + mp, buf + 2 * mp, b->conv_w, tails[l], states[l], slots,
                           buf + 3 * mp, b->a_log, b->dt_bias, b->gate_kind, b->lower_bound, bl, gate, b->norm_w,
                           b->eps, b->scale, o, nthreads) ? -1 : 0;
    }
    free(buf);
    return rc;
}

/* o [N, H * v] (and gate [N, H * v] when gated) for x [N, D] (N within what the projections take:
 * DS_MAX_M, or DS_AMX_ROWS on tiles); the N latent rows go to rows[write_rows] first. Returns 0, -1
 * allocation or kernel, -2 a row index out of range. */
int ds_mla_block(const ds_mla_block_t *b, const uint16_t *x, int N, uint16_t *rows, int64_t num_rows,
                 const int64_t *write_rows, const int64_t *read_rows, const int64_t *cu_kv, uint16_t *o,
                 uint16_t *gate, int nthreads) {
    const int H = b->H, nope = b->nope, rope = b->rope, R = b->rank, V = b->v, qd = nope + rope, row = R + rope;
    if (N > DS_MAX_M && !ds_tiles_ready()) return -1;
    for (int n = 0; n < N; ++n)
        if (write_rows[n] < 0 || write_rows[n] >= num_rows) return -2;
    for (int n = 0; n < N; ++n)
        if (cu_kv[0] != 0 || cu_kv[n + 1] <= cu_kv[n]) return -2;   /* every sequence reads >= 1 row */
    for (int64_t t = 0; t < cu_kv[N]; ++t)
        if (read_rows[t] < 0 || read_rows[t] >= num_rows) return -2;
    const int first = b->q_rank ? b->q_rank : H * qd;
    uint16_t *buf = malloc(sizeof(uint16_t) * (size_t)N * (2 * first + H * qd + 2 * row + H * nope
                                                          + 3 * H * R + H * row + 2 * H * V));
    if (!buf) return -1;
    uint16_t *qf = buf, *qn = qf + (size_t)N * first, *q = qn + (size_t)N * first, *kv = q + (size_t)N * H * qd;
    uint16_t *lat = kv + (size_t)N * row, *xh = lat + (size_t)N * row, *qh = xh + (size_t)N * H * nope;
    uint16_t *olat = qh + (size_t)N * H * R, *oh = olat + (size_t)N * H * R, *ql = oh + (size_t)N * H * R;
    uint16_t *ov = ql + (size_t)N * H * row;
    const uint16_t *ws[3] = {b->q_first, b->kv_a, b->g};
    const int ns[3] = {first, row, H * V}, zero[3] = {0};
    void *ys[3] = {qf, kv, gate};
    int rc = project(x, N, b->D, ws, ns, zero, ys, b->gated ? 3 : 2, nthreads) ? -1 : 0;
    if (rc == 0 && b->q_rank) {
        const int nq = H * qd;
        void *qy = q;
        ds_rms_norm(qf, first, N, first, b->q_norm, b->q_eps, qn, first, nthreads);
        rc = project(qn, N, first, &b->q_b, &nq, zero, &qy, 1, nthreads) ? -1 : 0;
    }
    const uint16_t *qq = b->q_rank ? q : qf;
    if (rc == 0) {
        ds_rms_norm(kv, row, N, R, b->kv_norm, b->kv_eps, lat, row, nthreads);
        for (int n = 0; n < N; ++n) {
            memcpy(lat + (size_t)n * row + R, kv + (size_t)n * row + R, sizeof(uint16_t) * rope);
            memcpy(rows + write_rows[n] * row, lat + (size_t)n * row, sizeof(uint16_t) * row);
        }
        for (int n0 = 0; n0 < N; n0 += DS_MAX_M) {   /* the per-head GEMVs take DS_MAX_M rows a call */
            const int m = N - n0 < DS_MAX_M ? N - n0 : DS_MAX_M;
            for (int h = 0; h < H; ++h)
                for (int i = 0; i < m; ++i)
                    memcpy(xh + ((size_t)h * m + i) * nope, qq + ((size_t)(n0 + i) * H + h) * qd,
                           sizeof(uint16_t) * nope);
            ds_linear_bf16_heads(xh, H, m, nope, b->w_uk_t, R, qh, nthreads);
            for (int i = 0; i < m; ++i)
                for (int h = 0; h < H; ++h) {
                    uint16_t *dst = ql + ((size_t)(n0 + i) * H + h) * row;
                    memcpy(dst, qh + ((size_t)h * m + i) * R, sizeof(uint16_t) * R);
                    memcpy(dst + R, qq + ((size_t)(n0 + i) * H + h) * qd + nope, sizeof(uint16_t) * rope);
                }
        }
        rc = ds_mla_decode(N, H, row, R, ql, rows, read_rows, cu_kv, b->scale, olat, nthreads) ? -1 : 0;
    }
    if (rc == 0) {
        for (int n0 = 0; n0 < N; n0 += DS_MAX_M) {
            const int m = N - n0 < DS_MAX_M ? N - n0 : DS_MAX_M;
            for (int h = 0; h < H; ++h)
                for (int i = 0; i < m; ++i)
                    memcpy(oh + ((size_t)h * m + i) * R, olat + ((size_t)(n0 + i) * H + h) * R, sizeof(uint16_t) * R);
            ds_linear_bf16_heads(oh, H, m, R, b->w_uv, V, ov, nthreads);
            for (int i = 0; i < m; ++i)
                for (int h = 0; h < H; ++h)
                    memcpy(o + ((size_t)(n0 + i) * H + h) * V, ov + ((size_t)h * m + i) * V, sizeof(uint16_t) * V);
        }
    }
    free(buf);
    return rc;
}
