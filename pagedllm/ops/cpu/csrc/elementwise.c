/* Per-row kernels of a transformer layer: RMSNorm with the residual add fused in
 * (pd_rms_norm), rotary embedding in place (pd_rope_neox), the SwiGLU gate
 * (pd_silu_mul), and a row gather for embedding and rotary-table lookups
 * (pd_gather_rows, pd_gather_rows_bf16), and each row's argmax for greedy sampling (pd_argmax_rows). */
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

/* out[i] = table[ids[i]] widened to float32, for a bf16 table (the embedding of a 16-bit
 * checkpoint computed in float32, kept as stored). Same contract as pd_gather_rows. */
int pd_gather_rows_bf16(const uint16_t *table, int64_t num_rows, int64_t row_len, const int64_t *ids, int64_t n,
                        float *out) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= num_rows) return PD_EINVAL;
#pragma omp parallel for schedule(static) if (n * row_len > 65536)
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *src = table + ids[i] * row_len;
        uint32_t *dst = (uint32_t *)(out + i * row_len);
        for (int64_t j = 0; j < row_len; j++) dst[j] = (uint32_t)src[j] << 16; /* bf16 is float32's top half */
    }
    return PD_OK;
}

/* ------------------------------------------------------------------ row argmax */
/* out[r] = the first index of row r's largest value, or of its first NaN (a NaN counts as
 * the largest, as torch's max does), for rows of `cols` floats `ld` apart. Greedy sampling
 * over a [rows, vocab] logits tensor: one pass over values the lm_head just wrote, where
 * torch's max(dim) took 0.9-1.2 ms of a 32-row SmolLM2 step (49152 columns). */
static int64_t argmax_row(const float *x, int64_t cols) {
    int64_t j = 0;
#if PD_AVX512
    if (cols >= 16) {
        __m512 best = _mm512_loadu_ps(x);
        __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i idx = at;
        const __m512i sixteen = _mm512_set1_epi32(16);
        if (_mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q)) goto scalar;
        for (j = 16; j + 16 <= cols; j += 16) {
            __m512 v = _mm512_loadu_ps(x + j);
            idx = _mm512_add_epi32(idx, sixteen);
            if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) goto scalar; /* a NaN: the scalar scan finds the first */
            __mmask16 more = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ); /* strictly: each lane keeps its first */
            best = _mm512_mask_mov_ps(best, more, v);
            at = _mm512_mask_mov_epi32(at, more, idx);
        }
        float lanes[16];
        int32_t where[16];
        _mm512_storeu_ps(lanes, best);
        _mm512_storeu_si512((void *)where, at);
        float mx = lanes[0];
        int64_t arg = where[0];
        for (int l = 1; l < 16; l++)
            if (lanes[l] > mx || (lanes[l] == mx && where[l] < arg)) mx = lanes[l], arg = where[l];
        for (; j < cols; j++) {
            if (x[j] != x[j]) return j;
            if (x[j] > mx) mx = x[j], arg = j;
        }
        return arg;
    }
scalar:
#endif
    {
        int64_t arg = 0;
        for (j = 0; j < cols; j++) {
            if (x[j] != x[j]) return j;
            if (x[j] > x[arg]) arg = j;
        }
        return arg;
    }
}

void pd_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t ld, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows > 1 && rows * cols > 262144)
    for (int64_t r = 0; r < rows; r++) out[r] = cols > 0 ? argmax_row(x + r * ld, cols) : 0;
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

/* out[t, i] = silu(x[t, i]) * x[t, I + i] for x [T, 2I] (gate then up). Both threads from
 * 8192 values (a 32-row SmolLM2 step's 49152 ran on one: ~28 us of its ~50 us per layer
 * would halve); the 512-bit exp gives exp_avx2's values, so either width computes the same. */
void pd_silu_mul(const float *x, float *out, int64_t T, int64_t I) {
#pragma omp parallel for schedule(static) if (T > 1 && T * I > 8192)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
#if PD_AVX512
        for (; i + 16 <= I; i += 16)
            _mm512_storeu_ps(o + i, silu_mul_avx512(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
#endif
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
