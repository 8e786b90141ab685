/* Declarations shared between the deltaserve kernel files (not part of the ctypes ABI). */
#ifndef DELTASERVE_INTERNAL_H
#define DELTASERVE_INTERNAL_H
#include <stdint.h>

#define DS_MAX_M 8   /* rows of the register-accumulator (GEMV) kernels */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define DS_ROWS(M) ((M) >= 8 ? 1 : 8 / (M))   /* weight rows per pass of those kernels */
#else
#define DS_ROWS(M) 1
#endif

/* acc[r * DS_MAX_M + m] = x[m] . w[row0 + r] for r < R <= DS_ROWS(M), m < M <= DS_MAX_M; w bf16
 * [rows, K] or MXFP4 (packed = 1: bytes [rows, K/2] and scales s [rows, K/32]). cpu_kernels.c */
void ds_expert_rows(const void *w, const uint8_t *s, int packed, int64_t row0, int R, int K,
                    const uint16_t *x, int M, float *acc);

/* Kernels the whole-block kernels (blocks.c) compose; defined in cpu_kernels.c, amx.c, router.c,
 * moe_decode.c, small_ops.c, mla_decode.c and kda_decode.c. */
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
int ds_mla_decode(int B, int H, int D, int R, const uint16_t *q, const uint16_t *rows, const int64_t *read_rows,
                  const int64_t *cu_kv, float scale, uint16_t *out, int nthreads);
void ds_linear_bf16_heads(const uint16_t *x, int H, int M, int K, const uint16_t *w, int N, uint16_t *y,
                          int nthreads);
int ds_kda_decode(int B, int H, int K, int W, const uint16_t *xq, const uint16_t *xk, const uint16_t *xv,
                  const float *conv_w, uint16_t *tails, float *states, const int64_t *slots, const uint16_t *f,
                  const float *a_log, const float *dt_bias, int gate_kind, float lower_bound,
                  const uint16_t *b_logit, const uint16_t *gate, const float *norm_w, float eps, float scale,
                  uint16_t *out, int nthreads);

/* moe_prefill.c */
int ds_moe_combine(const uint16_t *ys, const int64_t *pos, const float *w, int64_t n, int k, int d,
                   uint16_t *out, int nthreads);

/* amx.c: bf16 tile kernels. A tile product covers DS_TILE weight rows x DS_TILE activation rows
 * ("an m-block") x 32 along K; DS_AMX_MB m-blocks share one pass over a weight tile. Activations are
 * first packed pair-interleaved, m-blocks side by side:
 * xv[((kb * MB + mb) * 16 + kp) * 32 + 2 * mm + j] = x[16 mb + mm][32 kb + 2 kp + j], zero rows
 * past M; MB = ceil(M / 16). */
#define DS_TILE 16
#define DS_AMX_MB 4
int ds_amx_ready(void);       /* 1 when the CPU, the compiler and the kernel allow tiles, and enabled */
void ds_amx_set_enabled(int on);
int64_t ds_amx_uses(void);    /* calls and expert chunks run on tiles so far */
void ds_amx_count(void);
void ds_amx_config(void);     /* loads the tile configuration on the calling thread */
void ds_amx_pack(const uint16_t *x, int64_t ldx, int M, int K, uint16_t *xv);
/* c[(mb * 16 + r) * 16 + mm] = w[row0 + r] . x[16 mb + mm] for r < 16 (those rows must exist), any MB,
 * K % 32 == 0; w as in ds_expert_rows (MXFP4 decoded once per 512 columns for all m-blocks).
 * Needs ds_amx_config() on this thread. */
void ds_amx_rows(const void *w, const uint8_t *s, int packed, int64_t row0, int K, const uint16_t *xv, int MB,
                 float *c);
#endif
