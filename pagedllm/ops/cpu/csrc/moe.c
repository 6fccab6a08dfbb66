/* The routed experts of a mixture-of-experts layer in one call (pd_moe_f32), for float32
 * experts packed once at load by pd_sgemm_pack (one [2I, H] and one [H, I] matrix per
 * expert, stacked). Why one native call instead of torch ops per expert: at decode batch
 * sizes an expert receives a few rows, and the per-expert torch work around its two
 * GEMMs (index, gather, activation, scale, index_add, each a dispatch) cost as much as
 * the GEMMs; the routing counts also needed a host sync (`.tolist()`), which kept MoE
 * steps out of step replay. Here the (token, slot) pairs are sorted by expert with a
 * counting sort, each expert's rows are gathered once, run through pd_sgemm twice with
 * the activation between, and summed back per token in float32 in ascending expert
 * order (what ops.moe.expert_rows does). Pairs of weight 0 are skipped (another rank's
 * experts under expert parallelism). */
#include "pd_kernels.h"

#define PD_MOE_MAX_K 64 /* experts per token (native.py checks it too) */

/* tanh-approximated gelu, as F.gelu(approximate="tanh") */
static inline float gelu_tanh(float g) {
    return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

/* out [T, H] = sum_j weights[t, j] * W2[e] @ act_mul(W13[e] @ x[t]), e = ids[t, j].
 * x [T, H] rows contiguous; ids int64 [T, k]; weights float32 [T, k]; w13p: E experts of
 * pd_sgemm_pack([2I, H]) back to back, w2p: E of pd_sgemm_pack([H, I]); act 0 silu, 1
 * gelu (tanh). Returns PD_EINVAL for an expert id outside [0, E) with a nonzero weight, an
 * unknown act or k over PD_MOE_MAX_K, PD_ENOMEM when out of memory. */
int pd_moe_f32(const float *x, int64_t T, int64_t H, const int64_t *ids, const float *weights, int64_t k,
               int64_t E, const float *w13p, const float *w2p, int64_t I, int act, float *out) {
    if ((act != 0 && act != 1) || k > PD_MOE_MAX_K) return PD_EINVAL;
    int64_t pairs = T * k;
    memset(out, 0, (size_t)(T * H) * sizeof(float));
    if (pairs == 0) return PD_OK;
    int64_t *count = (int64_t *)calloc((size_t)(E + 1), sizeof(int64_t));
    int64_t *order = (int64_t *)malloc((size_t)pairs * sizeof(int64_t)); /* sorted position -> pair */
    int64_t *where = (int64_t *)malloc((size_t)pairs * sizeof(int64_t)); /* pair -> sorted position, -1 skipped */
    if (count == NULL || order == NULL || where == NULL) {
        free(count); free(order); free(where);
        return PD_ENOMEM;
    }
    for (int64_t p = 0; p < pairs; p++) {
        if (weights[p] == 0.0f) continue;
        if (ids[p] < 0 || ids[p] >= E) {
            free(count); free(order); free(where);
            return PD_EINVAL;
        }
        count[ids[p] + 1]++;
    }
    for (int64_t e = 0; e < E; e++) count[e + 1] += count[e]; /* count[e]: first position of expert e */
    int64_t used = count[E];
    int64_t *next = (int64_t *)malloc((size_t)E * sizeof(int64_t));
    size_t floats = (size_t)used * (size_t)(H + 2 * I + I + H);
    float *buf = used > 0 ? (float *)malloc(floats * sizeof(float)) : NULL;
    if (next == NULL || (used > 0 && buf == NULL)) {
        free(count); free(order); free(where); free(next); free(buf);
        return PD_ENOMEM;
    }
    memcpy(next, count, (size_t)E * sizeof(int64_t));
    for (int64_t p = 0; p < pairs; p++) {
        if (weights[p] == 0.0f) {
            where[p] = -1;
            continue;
        }
        int64_t pos = next[ids[p]]++;
        order[pos] = p;
        where[p] = pos;
    }
    float *xs = buf, *h = xs + used * H, *a = h + used * 2 * I, *o = a + used * I;
    int status = PD_OK;
#pragma omp parallel for schedule(static)
    for (int64_t pos = 0; pos < used; pos++) memcpy(xs + pos * H, x + (order[pos] / k) * H, (size_t)H * sizeof(float));
    int64_t p13 = ((2 * I + 15) / 16) * H * 16, p2 = ((H + 15) / 16) * I * 16; /* floats per packed expert */
    for (int64_t e = 0; e < E && status == PD_OK; e++) {
        int64_t n = count[e + 1] - count[e];
        if (n > 0) status = pd_sgemm(xs + count[e] * H, H, n, H, w13p + e * p13, 2 * I, NULL, h + count[e] * 2 * I, 2 * I);
    }
    if (status == PD_OK) {
        if (act == 0) {
            pd_silu_mul(h, a, used, I); /* rows [gate | up] -> silu(gate) * up */
        } else {
#pragma omp parallel for schedule(static)
            for (int64_t r = 0; r < used; r++)
                for (int64_t i = 0; i < I; i++) a[r * I + i] = gelu_tanh(h[r * 2 * I + i]) * h[r * 2 * I + I + i];
        }
    }
    for (int64_t e = 0; e < E && status == PD_OK; e++) {
        int64_t n = count[e + 1] - count[e];
        if (n > 0) status = pd_sgemm(a + count[e] * I, I, n, I, w2p + e * p2, H, NULL, o + count[e] * H, H);
    }
    if (status == PD_OK) {
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            /* this token's pairs, in ascending expert order (their sorted positions ascend with it) */
            int64_t mine[PD_MOE_MAX_K], n = 0;
            for (int64_t j = 0; j < k; j++)
                if (where[t * k + j] >= 0) mine[n++] = where[t * k + j];
            for (int64_t s = 1; s < n; s++)
                for (int64_t q = s; q > 0 && mine[q - 1] > mine[q]; q--) {
                    int64_t tmp = mine[q]; mine[q] = mine[q - 1]; mine[q - 1] = tmp;
                }
            float *dst = out + t * H;
            for (int64_t s = 0; s < n; s++) {
                float w = weights[order[mine[s]]];
                const float *src = o + mine[s] * H;
                for (int64_t c = 0; c < H; c++) dst[c] += src[c] * w;
            }
        }
    }
    free(count); free(order); free(where); free(next); free(buf);
    return status;
}
