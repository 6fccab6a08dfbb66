/* A linear over 4-bit codebook weights (pd_linear_lut4): bitsandbytes' NF4 / FP4, where a
 * code is an index into 16 arbitrary values, not an integer the Q4 kernels could multiply.
 *
 * y[m, n] = sum_b absmax[n, b] * sum_{k in block b} x[m, k] * lut[code(n, k)]
 * codes: [N, K/2] bytes, element 2j of a row in the low nibble of byte j, 2j + 1 in the
 * high one; absmax: [N, K/block] float32; block a multiple of 16 dividing K.
 *
 * The AVX2 path turns 16 codes into 16 floats with two 8-entry permutes (vpermps) and a
 * blend, then multiplies up to 4 activation rows at once; each block's sum is scaled once.
 * Every value is exactly lut[code] * absmax as bitsandbytes dequantizes it; only the
 * summation order differs from a float32 GEMM on the dequantized weight.
 */
#include "pd_kernels.h"

#if PD_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* 16 codes (8 bytes) -> two vectors of 8 values */
static inline void decode16(const uint8_t *p, __m256 lo_lut, __m256 hi_lut, __m256 *w0, __m256 *w1) {
    __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
    __m128i mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(bytes, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    __m128i idx = _mm_unpacklo_epi8(lo, hi); /* elements 0..15 in order */
    __m256i i0 = _mm256_cvtepu8_epi32(idx);
    __m256i i1 = _mm256_cvtepu8_epi32(_mm_srli_si128(idx, 8));
    __m256i seven = _mm256_set1_epi32(7);
    *w0 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo_lut, i0), _mm256_permutevar8x32_ps(hi_lut, i0),
                           _mm256_castsi256_ps(_mm256_cmpgt_epi32(i0, seven)));
    *w1 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo_lut, i1), _mm256_permutevar8x32_ps(hi_lut, i1),
                           _mm256_castsi256_ps(_mm256_cmpgt_epi32(i1, seven)));
}
#endif

int pd_linear_lut4(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *lut,
                   const float *absmax, int64_t block, int64_t N, float *y, int64_t ldy) {
    if (block <= 0 || block % 16 != 0 || K % block != 0) return PD_EINVAL;
    int64_t nblocks = K / block, row_bytes = K / 2;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *c = codes + n * row_bytes;
        const float *a = absmax + n * nblocks;
#if PD_AVX2
        __m256 lo_lut = _mm256_loadu_ps(lut), hi_lut = _mm256_loadu_ps(lut + 8);
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int rows = M - m0 < 4 ? (int)(M - m0) : 4;
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int64_t b = 0; b < nblocks; b++) {
                __m256 part[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
                for (int64_t k = b * block; k < (b + 1) * block; k += 16) {
                    __m256 w0, w1;
                    decode16(c + k / 2, lo_lut, hi_lut, &w0, &w1);
                    for (int r = 0; r < rows; r++) {
                        const float *xr = x + (m0 + r) * K + k;
                        part[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), part[r]);
                        part[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), part[r]);
                    }
                }
                __m256 scale = _mm256_set1_ps(a[b]);
                for (int r = 0; r < rows; r++) acc[r] = _mm256_fmadd_ps(part[r], scale, acc[r]);
            }
            for (int r = 0; r < rows; r++) y[(m0 + r) * ldy + n] = hsum8(acc[r]);
        }
#else
        for (int64_t m = 0; m < M; m++) {
            const float *xr = x + m * K;
            float acc = 0.0f;
            for (int64_t b = 0; b < nblocks; b++) {
                float part = 0.0f;
                for (int64_t k = b * block; k < (b + 1) * block; k++) {
                    uint8_t byte = c[k / 2];
                    part += xr[k] * lut[(k & 1) ? (byte >> 4) : (byte & 0x0F)];
                }
                acc += part * a[b];
            }
            y[m * ldy + n] = acc;
        }
#endif
    }
    return PD_OK;
}
