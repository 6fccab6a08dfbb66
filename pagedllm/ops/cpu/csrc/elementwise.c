/* Per-row kernels of a transformer layer: RMSNorm with the residual add fused in
 * (pd_rms_norm), rotary embedding in place (pd_rope_neox), the SwiGLU gate
 * (pd_silu_mul), and a row gather for embedding and rotary-table lookups
 * (pd_gather_rows). */
#include "pd_kernels.h"

/* ------------------------------------------------------------------ row gather */
/* out[i] = table[ids[i]] for rows of `row_len` floats (embedding and rotary-table
 * lookups). Returns PD_EINVAL, writing nothing, when an id is outside [0, num_rows). */
int pd_gather_rows(const float *table, int64_t num_rows, int64_t row_len, const int64_t *ids, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= num_rows) return PD_EINVAL;
#pragma omp parallel for schedule(static) if (n * row_len > 65536)
    for (int64_t i = 0; i < n; i++) memcpy(out + i * row_len, table + ids[i] * row_len, (size_t)row_len * sizeof(float));
    return PD_OK;
}

/* ------------------------------------------------------------------ elementwise */

/* RMSNorm over rows of H, with the residual add fused in:
 * residual == NULL: out = norm(x) * w
 * otherwise:        residual = x + residual; out = norm(residual) * w
 * (out may alias x). */
void pd_rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t T, int64_t H,
                 float eps) {
#pragma omp parallel for schedule(static) if (T > 4)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * H;
        float *o = out + t * H;
        const float *src = xr;
        if (residual != NULL) {
            float *r = residual + t * H;
            for (int64_t i = 0; i < H; i++) r[i] += xr[i];
            src = r;
        }
        float ss = dot(src, src, H);
        float inv = 1.0f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++) o[i] = (src[i] * inv) * weight[i];
    }
}

/* Neox-style rotary embedding in place (rotate halves), as Hugging Face Llama applies
 * it: for the first `nheads` heads of each token row (row stride `stride` floats),
 * (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with cos/sin [T, D/2]. */
void pd_rope_neox(float *x, int64_t T, int64_t stride, int64_t nheads, int64_t D, const float *cos_t,
                  const float *sin_t) {
    int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (T > 16)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + t * half, *s = sin_t + t * half;
        for (int64_t h = 0; h < nheads; h++) {
            float *p1 = x + t * stride + h * D, *p2 = p1 + half;
            for (int64_t i = 0; i < half; i++) {
                float x1 = p1[i], x2 = p2[i];
                p1[i] = x1 * c[i] - x2 * s[i];
                p2[i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

/* out[t, i] = silu(x[t, i]) * x[t, I + i] for x [T, 2I] (gate then up). */
void pd_silu_mul(const float *x, float *out, int64_t T, int64_t I) {
#pragma omp parallel for schedule(static) if (T * I > 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
#if PD_AVX2
        __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 e = exp_avx2(_mm256_sub_ps(zero, gv));
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
