/* deltaserve CPU kernel: the sigmoid MoE router's selection after the logits (ops.moe.route).
 *
 * Per token: s = sigmoid(logit); pick = s + bias (or s without a bias); with G > 1 groups, each
 * group scores the sum of its top-2 picks (top-1 when a group has one expert) and only the best
 * `topk_group` groups stay eligible; the top_k eligible experts by pick are chosen in descending
 * order (ties: the lower expert id first); weights are s (or pick with bias_in_weights) at the
 * chosen experts, renormalised to w / (sum w + 1e-20) if asked, times `scale`. fp32 throughout.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "ds_abi.h"

#define MAX_EXPERTS 4096
#define MAX_GROUPS 256

/* Index of the largest v[i] (i < n) with ok[i] set; ties: the lowest index. -1 if none. */
static int argmax_masked(const float *v, const unsigned char *ok, int n) {
    int best = -1;
    for (int i = 0; i < n; ++i)
        if (ok[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

/* Returns 0, or -1 when a size exceeds the fixed buffers / top_k exceeds the eligible experts. */
int ds_route(const float *logits, int64_t n, int e, const float *bias, int top_k, int groups, int topk_group,
             int renormalize, float scale, int bias_in_weights, float *w_out, int64_t *ids_out) {
    if (e > MAX_EXPERTS || groups > MAX_GROUPS || groups < 1 || e % groups || top_k > e
        || topk_group > groups || (groups > 1 && top_k > topk_group * (e / groups)))
        return -1;
    const int per = e / groups;
    for (int64_t t = 0; t < n; ++t) {
        float s[MAX_EXPERTS], pick[MAX_EXPERTS], gscore[MAX_GROUPS];
        unsigned char ok[MAX_EXPERTS], gok[MAX_GROUPS];
        const float *row = logits + t * e;
        for (int i = 0; i < e; ++i) {
            s[i] = 1.0f / (1.0f + expf(-row[i]));
            pick[i] = bias ? s[i] + bias[i] : s[i];
            ok[i] = 1;
        }
        if (groups > 1) {
            for (int g = 0; g < groups; ++g) {
                const int a = argmax_masked(pick + g * per, ok + g * per, per);
                float sc = pick[g * per + a];
                if (per > 1) {
                    ok[g * per + a] = 0;
                    sc += pick[g * per + argmax_masked(pick + g * per, ok + g * per, per)];
                    ok[g * per + a] = 1;
                }
                gscore[g] = sc;
                gok[g] = 1;
            }
            unsigned char keep[MAX_GROUPS] = {0};
            for (int j = 0; j < topk_group; ++j) {
                const int g = argmax_masked(gscore, gok, groups);
                keep[g] = 1;
                gok[g] = 0;
            }
            for (int i = 0; i < e; ++i) ok[i] = keep[i / per];
        }
        float sum = 0.f;
        for (int j = 0; j < top_k; ++j) {
            const int i = argmax_masked(pick, ok, e);
            ok[i] = 0;
            ids_out[t * top_k + j] = i;
            w_out[t * top_k + j] = bias_in_weights ? pick[i] : s[i];
            sum += w_out[t * top_k + j];
        }
        for (int j = 0; j < top_k; ++j) {
            float w = w_out[t * top_k + j];
            if (renormalize) w = w / (sum + 1e-20f);
            w_out[t * top_k + j] = w * scale;
        }
    }
    return 0;
}
