/* The ABI of the deltaserve CPU kernel library: every function the Python bindings call, the
 * constants both sides use, and the structs passed by pointer. Every .c file includes it, so the
 * compiler checks each definition against its prototype; kernels/cpu/abi.py parses this file at
 * import for the ctypes signatures, constants and ctypes.Structures, and refuses a library whose
 * ds_abi_version() or ds_abi_sizeof() disagrees.
 *
 * Kept parseable by that module: `#define DS_<NAME> <decimal>` constants, `typedef struct { ... }
 * name;` of int / int64_t / float / pointer fields, one-line-or-more prototypes of int, int64_t,
 * float, size_t, void and pointer parameters, all named; no conditional compilation. Bump
 * DS_ABI_VERSION with any change to a prototype, a struct or a constant's meaning. */
#ifndef DELTASERVE_DS_ABI_H
#define DELTASERVE_DS_ABI_H
#include <stddef.h>
#include <stdint.h>

#define DS_ABI_VERSION 11

#define DS_MAX_M 8             /* rows of the register-accumulator (GEMV) kernels: small-M decode */
#define DS_AMX_ROWS 64         /* rows the AMX tile kernels take in one pass (batched decode) */
#define DS_GROUP 32            /* MXFP4 elements per E8M0 scale */
#define DS_MAX_MULTI 16        /* weights of one ds_linear_bf16_multi / ds_linear_amx_multi call */
#define DS_MAX_MIX 64          /* candidates of one ds_attn_res_mix call */
#define DS_MLA_MAX_HEADS 64    /* ds_mla_decode's per-row score buffer */
#define DS_MLA_MAX_RANK 1024   /* ds_mla_decode's merge buffer */
#define DS_KDA_MAX_CHUNK 64    /* chunk length of ds_kda_chunked */
#define DS_ACT_SILU 0          /* GLU activations (glu.h) */
#define DS_ACT_SITU 1
#define DS_GATE_SIGMOID 0      /* KDA decay forms (ds_kda_decode, ds_kda_block) */
#define DS_GATE_SOFTPLUS 1

/* The static part of one MoE block (ds_moe_block); the bindings fill it once per module. */
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
    int first, held;                 /* the routed experts w1..s2 hold: the router's [first, first + held)
                                        (expert parallelism; else 0, E) */
} ds_moe_block_t;

/* The static part of one KDA layer's decode step (ds_kda_block). */
typedef struct {
    int D, H, K, W, full_gate, gate_kind;       /* P = H * K channels per q/k/v */
    float lower_bound, eps, scale;
    const uint16_t *q, *k, *v, *f_a, *f_b, *b, *g, *g_b, *o;   /* bf16 weights; g is g_proj or g_a_proj */
    const float *conv_w, *a_log, *dt_bias, *norm_w;            /* fp32 as ds_kda_decode takes them */
} ds_kda_block_t;

/* The static part of one MLA layer's decode step (ds_mla_block). */
typedef struct {
    int D, H, nope, rope, rank, v, q_rank, gated;   /* q_rank 0: q_proj instead of q_a/q_b */
    float q_eps, kv_eps, scale;
    const uint16_t *q_first, *q_b, *kv_a, *g;       /* q_a_proj (or q_proj), q_b_proj, kv_a, g_proj */
    const float *q_norm, *kv_norm;                  /* fp32 norm weights [q_rank], [rank] */
    const uint16_t *w_uk_t, *w_uv;                  /* [H, rank, nope], [H, v, rank] */
} ds_mla_block_t;

/* One decoder layer of ds_decode_stack (pointers into plans and weights the bindings keep alive). */
typedef struct {
    const ds_kda_block_t *kda;                     /* at most one of kda and mla; neither: the stack's */
    const ds_mla_block_t *mla;                     /* `attend` callback computes the layer's attention */
    const uint16_t *o_proj;                        /* MLA output projection [D, H * v] */
    const ds_moe_block_t *moe;                     /* or, when NULL, the dense GLU below */
    const uint16_t *mlp_gate, *mlp_up, *mlp_down;  /* [I, D], [I, D], [D, I] */
    int mlp_width, act;
    float beta, lbeta;
    const float *attn_q, *mlp_q;                   /* Block AttnRes queries (norm * proj) [D], or NULL */
    const float *attn_norm, *mlp_norm;             /* input / post-attention RMSNorm weights [D] fp32 */
    float attn_eps, mlp_eps;
} ds_stack_layer_t;

/* The decoder stack of ds_decode_stack: its layers, the output AttnRes mix and the final norm; the token
 * embeddings and the output head around it (either may be NULL: the caller embeds, or takes hidden states). */
typedef struct {
    int D, L, block_size;                          /* Block AttnRes block size; 0: pre-norm residuals */
    float res_eps, final_eps;
    const ds_stack_layer_t *layers;                /* [L] */
    const float *out_q, *final_norm;               /* output AttnRes query [D] (or NULL), final norm [D] */
    int vocab;                                     /* rows of embed and lm_head */
    const uint16_t *embed, *lm_head;               /* bf16 [vocab, D] each (or NULL) */
    void *reduce;                                  /* tensor parallel: a ds_reduce_fn (internal.h); NULL: unsharded */
    void *attend;                                  /* a ds_attend_fn (internal.h) for layers of neither kind */
} ds_stack_t;

/* abi.c: DS_ABI_VERSION as compiled; sizeof the struct named `name` above (0 for another name). */
int ds_abi_version(void);
size_t ds_abi_sizeof(const char *name);

/* mxfp4_rows.c: the decode tables (called once before any kernel). cpu_kernels.c: the build's features, small-M GEMVs. */
void ds_init(void);
int ds_has_avx512bf16(void);
void ds_linear_bf16(const uint16_t *x, int M, int K, const uint16_t *w, int N, uint16_t *y, int64_t ldy,
                    int nthreads);
int ds_linear_bf16_multi(const uint16_t *x, int M, int K, const uint16_t *const *w, const int *N, const int *f32,
                         void *const *y, int nw, int nthreads);
void ds_linear_bf16_heads(const uint16_t *x, int H, int M, int K, const uint16_t *w, int N, uint16_t *y,
                          int nthreads);
/* mxfp4_rows.c: the exact MXFP4 -> bf16 dequantiser. */
void ds_mxfp4_to_bf16(const uint8_t *packed, const uint8_t *scale, int64_t N, int K, uint16_t *out, int nthreads);

/* amx.c: 1 when the CPU, the compiler and the kernel allow tiles, and enabled; tile GEMV. */
int ds_amx_ready(void);
void ds_amx_set_enabled(int on);
int64_t ds_amx_uses(void);    /* calls and expert m-blocks run on tiles so far */
int ds_linear_amx_multi(const uint16_t *x, int M, int K, const uint16_t *const *w, const int *N, const int *f32,
                        void *const *y, int nw, int nthreads);

/* tiles.c: the tile kernels (ds_linear_amx_multi, the fused experts' chunks) on AMX (2), on AVX512-BF16
 * register tiles where AMX is not ready (1, unless disabled), or not at all (0). */
int ds_tiles_ready(void);
void ds_tiles_set_enabled(int on);
int64_t ds_tiles_uses(void);  /* calls and expert m-blocks run on either kind of tile so far */

/* router.c, moe_decode.c, moe_prefill.c: routing, fused routed experts, prefill GLU and combine. */
int ds_route(const float *logits, int64_t n, int e, const float *bias, int top_k, int groups, int topk_group,
             int renormalize, float scale, int bias_in_weights, float *w_out, int64_t *ids_out);
int ds_moe_experts(const uint16_t *x, int N, int D, const int64_t *ids, const float *wts, int k, int E, int I,
                   int packed, const void *w1, const uint8_t *s1, const void *w3, const uint8_t *s3,
                   const void *w2, const uint8_t *s2, int act, float beta, float lbeta, uint16_t *out,
                   int nthreads);
void ds_glu_rows_bf16(const uint16_t *gate, int64_t gate_stride, const uint16_t *up, int64_t up_stride,
                      int64_t rows, int64_t cols, int act, float beta, float lbeta, uint16_t *out,
                      int64_t out_stride, int nthreads);
int ds_moe_combine(const uint16_t *ys, const int64_t *pos, const float *w, int64_t n, int k, int d,
                   uint16_t *out, int nthreads);

/* kda_decode.c, mla_decode.c: the attention decode steps over the pools. */
int ds_kda_decode(int B, int H, int K, int W, const uint16_t *xq, const uint16_t *xk, const uint16_t *xv,
                  const float *conv_w, uint16_t *tails, float *states, const int64_t *slots, const uint16_t *f,
                  const float *a_log, const float *dt_bias, int gate_kind, float lower_bound,
                  const uint16_t *b_logit, const uint16_t *gate, const float *norm_w, float eps, float scale,
                  uint16_t *out, int nthreads);
int ds_mla_decode(int B, int H, int D, int R, const uint16_t *q, const uint16_t *rows, const int64_t *read_rows,
                  const int64_t *cu_kv, float scale, uint16_t *out, int nthreads);
/* The same over a share of each context (decode context parallelism): out [B, H, R] fp32 normalised over
 * the sequence's rows here, lse [B, H] their scores' log-sum-exp; a sequence without rows (cu_kv equal)
 * gets out 0 and lse -inf. */
int ds_mla_decode_partial(int B, int H, int D, int R, const uint16_t *q, const uint16_t *rows,
                          const int64_t *read_rows, const int64_t *cu_kv, float scale, float *out, float *lse,
                          int nthreads);

/* flash_attention.c: causal attention of packed queries over each sequence's key/value rows (MLA
 * prefill): q [G Nq, H, Dn + Dr] (row and head strides sq_t, sq_h; G rows a position, cu_q counting
 * positions), keys [k_nope | k_rot] (k_nope [Nkv, H, Dn] strides sk_t, sk_h; k_rot [Nkv, Dr] stride
 * sr_t, shared by the heads; NULL if Dr = 0), v [Nkv, H, Dv] (sv_t, sv_h), last dims contiguous;
 * out [G Nq, H, Dv] contiguous; pack_bytes: the most the keys and values packed ahead take (heads in
 * groups that fit; past one head, each task packs the block it reads). 0, -1 (allocation), -2 (a
 * sequence with more positions than rows), -3 (the build lacks AVX512-BF16). */
int ds_flash_attention(int B, int H, int G, int Dn, int Dr, int Dv, const uint16_t *q, int64_t sq_t, int64_t sq_h,
                       const uint16_t *k_nope, int64_t sk_t, int64_t sk_h, const uint16_t *k_rot, int64_t sr_t,
                       const uint16_t *v, int64_t sv_t, int64_t sv_h, const int64_t *cu_q, const int64_t *cu_kv,
                       float scale, int64_t pack_bytes, uint16_t *out, int nthreads);

/* kda_chunk.c: chunked KDA prefill, causal conv (+ q/k L2 norm). */
int ds_kda_chunked(int B, int H, int K, int V, const float *q, int64_t sq, const float *k, int64_t sk,
                   const float *v, int64_t sv, const float *g, int64_t sg, const float *beta, int64_t sb,
                   float scale, const int64_t *chunk_first, const int64_t *chunk_start, const int64_t *chunk_len,
                   const int64_t *ex_first, const int64_t *ex_chunk, const float *initial_state, float *o,
                   float *final_state, float *exported, int nthreads);
int ds_causal_conv1d(int64_t N, int C, int W, const uint16_t *x, int64_t ldx, const float *weight, int B,
                     const int64_t *cu, const uint16_t *initial_tail, int norm_groups, int group, float *y,
                     uint16_t *final_tail, int nthreads);

/* small_ops.c: norms, the Block AttnRes mix, K3's KDA decay, the greedy token of each row of logits. */
void ds_rms_norm(const uint16_t *x, int64_t ldx, int N, int D, const float *w, float eps, uint16_t *out,
                 int64_t ldo, int nthreads);
void ds_attn_res_mix(const uint16_t *const *xs, int S, int N, int D, const float *q, float eps, uint16_t *out,
                     const float *norm_w, float norm_eps, uint16_t *normed, int nthreads);
void ds_kda_gate_sigmoid(const uint16_t *f, int64_t ldf, int N, int H, int K, const float *a_log,
                         const float *dt_bias, float lb, float *g, int nthreads);
void ds_gated_rms_norm(const float *o, int N, int H, int K, const float *w, const uint16_t *gate, int64_t ldg,
                       float eps, uint16_t *out, int nthreads);
void ds_argmax_rows(const float *x, int64_t N, int64_t V, int64_t *out, int nthreads);

/* blocks.c: whole decode blocks in one call each. */
int ds_moe_block(const ds_moe_block_t *b, const uint16_t *x, int N, uint16_t *out, int nthreads);
/* ds_kda_block's record (or NULL): its rows' q | k | v | f [N, P] and b [N, H] planes, bf16. */
int ds_kda_block(const ds_kda_block_t *b, const uint16_t *x, int N, uint16_t *tails, float *states,
                 const int64_t *slots, int64_t num_slots, uint16_t *record, uint16_t *out, int nthreads);
/* The KDA updates alone (conv tail shift and delta-rule state update, no projection) of M recorded rows
 * rows[i] of ds_kda_block's records (N rows each), on slots[i], every layer l of `layers` over its pools
 * tails[l] / states[l] in place, through ds_kda_decode: the tails and states a ds_kda_block of those
 * rows leaves. Rows sharing a slot are applied in order (they must be adjacent). 0, -1 allocation, -2 a
 * row or slot out of range. */
int ds_kda_replay(const ds_kda_block_t *const *layers, int L, const uint16_t *const *records, int N,
                  const int64_t *rows, int M, const int64_t *slots, uint16_t *const *tails, float *const *states,
                  int64_t num_slots, int nthreads);
int ds_mla_block(const ds_mla_block_t *b, const uint16_t *x, int N, uint16_t *rows, int64_t num_rows,
                 const int64_t *write_rows, const int64_t *read_rows, const int64_t *cu_kv, uint16_t *o,
                 uint16_t *gate, int nthreads);

/* stack.c: a whole decode step of the decoder stack in one call; the MLA output gate it shares with
 * the module path. */
void ds_sigmoid_mul_bf16(const uint16_t *o, const uint16_t *g, int64_t n, uint16_t *out, int nthreads);
int ds_decode_stack(const ds_stack_t *s, const uint16_t *x, const int64_t *ids, int N, uint16_t *const *tails,
                    float *const *states, uint16_t *const *records, const int64_t *slots, int64_t num_slots,
                    uint16_t *const *mla_rows, int64_t num_rows, const int64_t *write_rows,
                    const int64_t *read_rows, const int64_t *cu_kv, uint16_t *out, float *logits, int nthreads);

#endif
