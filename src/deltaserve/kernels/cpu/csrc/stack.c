/* deltaserve CPU kernel for a whole decode step of the decoder stack in one call (ds_decode_stack),
 * composed of the kernels the modules call one by one (model/decoder.py on the native backend), in
 * the same order with the same roundings, so the hidden states are bit-identical to that path. Per
 * layer:
 *   x = mix + norm (K3 Block AttnRes: ds_attn_res_mix with the layer's norm; Kimi-Linear and an empty
 *       bank: ds_rms_norm)
 *   a = ds_kda_block(x), or ds_mla_block(x) -> (o, g), o = ds_sigmoid_mul_bf16(o, g), a = o @ o_proj^T
 *   AttnRes: on a block's first layer the running sum is banked and a starts the next one, else added;
 *   pre-norm residuals: h + a
 *   x = mix + norm again; f = ds_moe_block(x) or the dense GLU (one expert of weight 1); h + f
 * then the output mix and the final norm; optionally the embedding rows before and the output head
 * after (token ids in, fp32 logits out). What it saves is the Python between ~6 calls a layer.
 * Under tensor parallelism (s->reduce set) each rank runs its shard of every block and calls the
 * reduce back where the module path all-reduces: each attention block's output, the dense GLU's, and
 * inside the MoE block (ds_moe_block_reduced), so every rank's hidden states are the module path's.
 * A layer with neither a KDA nor an MLA plan (decode context parallelism's MLA) calls `attend` back
 * for its attention: the caller's module runs it, collectives included.
 * Every index and the routers' static limits are checked before any pool is written. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "ds_abi.h"
#include "bf16.h"
#include "internal.h"
#include "vmath.h"

/* out = bf16(o * bf16(sigmoid(g))): torch's `o * torch.sigmoid(g)` on bf16 (two roundings). */
void ds_sigmoid_mul_bf16(const uint16_t *o, const uint16_t *g, int64_t n, uint16_t *out, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= (1 << 16))
    for (int64_t i = 0; i < n; ++i) {
        const float s = bf16_to_f32(f32_to_bf16(ds_sigmoid(bf16_to_f32(g[i]))));
        out[i] = f32_to_bf16(bf16_to_f32(o[i]) * s);
    }
}

static void add_bf16(uint16_t *acc, const uint16_t *x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) acc[i] = f32_to_bf16(bf16_to_f32(acc[i]) + bf16_to_f32(x[i]));
}

/* The input of a layer's attention or FFN: the AttnRes mix of the bank and cur with its norm (q set and
 * the bank not empty), else the norm of cur. */
static void layer_input(const uint16_t **bank, int nbank, const uint16_t *cur, int N, int D, const float *q,
                        float res_eps, const float *norm, float norm_eps, uint16_t *mix, uint16_t *x, int nthreads) {
    if (q && nbank > 0) {
        bank[nbank] = cur;
        ds_attn_res_mix(bank, nbank + 1, N, D, q, res_eps, mix, norm, norm_eps, x, nthreads);
    } else {
        ds_rms_norm(cur, D, N, D, norm, norm_eps, x, D, nthreads);
    }
}

/* The most rows a step takes: DS_AMX_ROWS where the tile kernels run every projection (tiles ready, every
 * input width a multiple of 32), else DS_MAX_M (the GEMV kernels). */
static int stack_rows(const ds_stack_t *s) {
    int ok = ds_tiles_ready() && s->D % 32 == 0;
    for (int l = 0; ok && l < s->L; ++l) {
        const ds_stack_layer_t *y = &s->layers[l];
        if (y->kda) ok = y->kda->K % 32 == 0 && (y->kda->H * y->kda->K) % 32 == 0;
        if (y->mla) ok = ok && y->mla->q_rank % 32 == 0 && (y->mla->H * y->mla->v) % 32 == 0;
        if (y->moe && y->moe->down) ok = ok && y->moe->L % 32 == 0;
    }
    return ok ? DS_AMX_ROWS : DS_MAX_M;
}

static int check_step(const ds_stack_t *s, int N, const int64_t *slots, int64_t num_slots, const int64_t *write_rows,
                      const int64_t *read_rows, const int64_t *cu_kv, int64_t num_rows) {
    int kda = 0, mla = 0;
    for (int l = 0; l < s->L; ++l) {
        const ds_stack_layer_t *y = &s->layers[l];
        kda |= y->kda != NULL;
        mla |= y->mla != NULL;
        if (y->moe && ds_route(NULL, 0, y->moe->E, y->moe->bias, y->moe->top_k, y->moe->groups, y->moe->topk_group,
                               y->moe->renormalize, y->moe->scale, y->moe->bias_in_weights, NULL, NULL) != 0)
            return -3;
    }
    for (int n = 0; kda && n < N; ++n)
        if (slots[n] < 0 || slots[n] >= num_slots) return -2;
    if (!mla) return 0;
    if (cu_kv[0] != 0) return -2;
    for (int n = 0; n < N; ++n)
        if (write_rows[n] < 0 || write_rows[n] >= num_rows || cu_kv[n + 1] <= cu_kv[n]) return -2;
    for (int64_t t = 0; t < cu_kv[N]; ++t)
        if (read_rows[t] < 0 || read_rows[t] >= num_rows) return -2;
    return 0;
}

/* y [N, vocab] bf16 = x [N, K] @ w [vocab, K]^T as ops.linear computes it: the GEMV kernel up to
 * DS_MAX_M rows, the tile kernel above. */
static int linear(const uint16_t *x, int N, int K, const uint16_t *w, int rows, uint16_t *y, int nthreads) {
    if (N <= DS_MAX_M) {
        ds_linear_bf16(x, N, K, w, rows, y, rows, nthreads);
        return 0;
    }
    const int f0 = 0;
    void *yv = y;
    return ds_linear_amx_multi(x, N, K, &w, &rows, &f0, &yv, 1, nthreads) ? -1 : 0;
}

/* logits [N, vocab] fp32 = the bf16 lm_head outputs of the hidden states h [N, D], widened (the values
 * of `lm_head(h).float()`). */
static int head_logits(const ds_stack_t *s, const uint16_t *h, int N, float *logits, int nthreads) {
    const int64_t n = (int64_t)N * s->vocab;
    uint16_t *y = malloc(sizeof(uint16_t) * (size_t)n);
    if (!y || linear(h, N, s->D, s->lm_head, s->vocab, y, nthreads)) { free(y); return -1; }
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= (1 << 18))
    for (int64_t i = 0; i < n; ++i) logits[i] = bf16_to_f32(y[i]);
    free(y);
    return 0;
}

/* out [N, D] = the final-normed hidden states of one decode step of x [N, D] (the token embeddings), or
 * with x NULL of the embedding rows ids [N] (s->embed); logits (or NULL) as head_logits (s->lm_head).
 * tails[l] / states[l]: KDA layer l's pools (as ds_kda_block), records (NULL: none) records[l] its
 * record of the step's rows (ds_kda_block's; a speculative verify's, for ds_kda_replay), mla_rows[l]: MLA
 * layer l's rows (as ds_mla_block); the step's slots / write_rows / read_rows / cu_kv are shared by the
 * layers.
 * N is at most stack_rows(s). Returns 0; -1 allocation or a kernel's failure; -2 an index out of range;
 * -3 a router's limits do not hold; -4 N out of range, or ids or logits without their weights (nothing
 * written but for 0, -1 and -5); -5 a reduce or attend callback failed. */
int ds_decode_stack(const ds_stack_t *s, const uint16_t *x, const int64_t *ids, int N, uint16_t *const *tails,
                    float *const *states, uint16_t *const *records, const int64_t *slots, int64_t num_slots,
                    uint16_t *const *mla_rows, int64_t num_rows, const int64_t *write_rows,
                    const int64_t *read_rows, const int64_t *cu_kv, uint16_t *out, float *logits, int nthreads) {
    const int D = s->D, L = s->L, blk = s->block_size;
    const ds_reduce_fn reduce = (ds_reduce_fn)s->reduce;
    const ds_attend_fn attend = (ds_attend_fn)s->attend;
    if (N < 1 || N > stack_rows(s) || (!x && !(ids && s->embed)) || (logits && !s->lm_head)) return -4;
    for (int n = 0; !x && n < N; ++n)
        if (ids[n] < 0 || ids[n] >= s->vocab) return -2;
    int rc = check_step(s, N, slots, num_slots, write_rows, read_rows, cu_kv, num_rows);
    if (rc) return rc;
    const int banked = blk > 0 ? (L + blk - 1) / blk : 0, nbuf = banked + 4;
    int hv = 0;
    for (int l = 0; l < L; ++l) {
        const ds_mla_block_t *m = s->layers[l].mla;
        if (m && m->H * m->v > hv) hv = m->H * m->v;
    }
    const size_t nd = (size_t)N * D;
    uint16_t *buf = malloc(sizeof(uint16_t) * (nd * nbuf + 2 * (size_t)N * hv));
    const uint16_t **bank = malloc(sizeof(uint16_t *) * (banked + 2));
    int64_t *zero = calloc((size_t)N, sizeof(int64_t));
    float *one = malloc(sizeof(float) * (size_t)N);
    if (!buf || !bank || !zero || !one) rc = -1;
    for (int n = 0; rc == 0 && n < N; ++n) one[n] = 1.0f;
    /* buffers: cur, a (the layer's output), x (normed input), mix; the banked sums after them */
    uint16_t *cur = buf, *a = buf + nd, *xin = a + nd, *mix = xin + nd, *next = mix + nd;
    uint16_t *o = buf + nd * nbuf, *g = o + (size_t)N * hv;
    int nbank = 0;
    for (int n = 0; rc == 0 && n < N; ++n)
        memcpy(cur + (size_t)n * D, x ? x + (size_t)n * D : s->embed + ids[n] * (int64_t)D, sizeof(uint16_t) * D);
    for (int l = 0; rc == 0 && l < L; ++l) {
        const ds_stack_layer_t *y = &s->layers[l];
        layer_input(bank, nbank, cur, N, D, y->attn_q, s->res_eps, y->attn_norm, y->attn_eps, mix, xin, nthreads);
        if (!y->kda && !y->mla) {   /* the module's attention, summed over the ranks already */
            rc = attend && attend(l, xin, N, a) == 0 ? 0 : -5;
        } else if (y->kda) {
            rc = ds_kda_block(y->kda, xin, N, tails[l], states[l], slots, num_slots, records ? records[l] : NULL, a,
                              nthreads) ? -1 : 0;
        } else {
            const ds_mla_block_t *m = y->mla;
            const int w = m->H * m->v;
            rc = ds_mla_block(m, xin, N, mla_rows[l], num_rows, write_rows, read_rows, cu_kv, o,
                              m->gated ? g : NULL, nthreads) ? -1 : 0;
            if (rc == 0 && m->gated) ds_sigmoid_mul_bf16(o, g, (int64_t)N * w, o, nthreads);
            if (rc == 0) rc = linear(o, N, w, y->o_proj, D, a, nthreads);
        }
        if (rc == 0 && reduce && (y->kda || y->mla) && reduce(a, NULL, (int64_t)nd)) rc = -5;
        if (rc) break;
        if (y->attn_q && blk > 0 && l % blk == 0) {
            bank[nbank++] = cur;
            cur = a;
            a = next;
            next += nd;
        } else {
            add_bf16(cur, a, (int64_t)nd);
        }
        layer_input(bank, nbank, cur, N, D, y->mlp_q, s->res_eps, y->mlp_norm, y->mlp_eps, mix, xin, nthreads);
        if (y->moe) {
            rc = ds_moe_block_reduced(y->moe, xin, N, reduce, a, nthreads);
            rc = rc == -5 ? -5 : rc ? -1 : 0;
        } else {
            rc = ds_moe_experts(xin, N, D, zero, one, 1, 1, y->mlp_width, 0, y->mlp_gate, NULL, y->mlp_up, NULL,
                                y->mlp_down, NULL, y->act, y->beta, y->lbeta, a, nthreads) ? -1 : 0;
            if (rc == 0 && reduce && reduce(a, NULL, (int64_t)nd)) rc = -5;
        }
        if (rc == 0) add_bf16(cur, a, (int64_t)nd);
    }
    if (rc == 0) layer_input(bank, nbank, cur, N, D, s->out_q, s->res_eps, s->final_norm, s->final_eps, mix, out,
                             nthreads);
    if (rc == 0 && logits) rc = head_logits(s, out, N, logits, nthreads);
    free(buf);
    free(bank);
    free(zero);
    free(one);
    return rc;
}
