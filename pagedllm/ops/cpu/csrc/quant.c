/* ggml-quantized weights (Q4_0, Q4_1, Q8_0): repack at load (pd_repack), linear from
 * the repacked codes (pd_linear_packed), and a dense dequantized copy (pd_dequantize,
 * the test oracle for the block layouts). */
#include "pd_kernels.h"

/* ------------------------------------------------------------------ quantized linear
 * y[m, n] = sum_k x[m, k] * W[n, k], W from ggml blocks of 32 values per row:
 * Q4_0: {f16 d; u8 qs[16]}        value = d * (q - 8)
 * Q4_1: {f16 d; f16 m; u8 qs[16]} value = d * q + m
 * Q8_0: {f16 d; i8 qs[32]}        value = d * q
 * For 4-bit types, byte j holds value j (low nibble) and value j + 16 (high nibble).
 *
 * At load, blocks are repacked (pd_repack) into what the kernel wants to stream: the
 * codes alone (16 or 32 bytes per block, same order), and float32 arrays of scales d
 * and offsets m ([N, K/32]; m = -8d for Q4_0, none for Q8_0), so the inner loop does no
 * half-float conversion and the offsets become one short dot product per output.
 */
/* One block's 32 weights as floats, exactly as gguf_dequant.py computes them. */
static inline void dequant_block(int qtype, const uint8_t *b, float *w) {
    float d = f16_to_f32(b);
    if (qtype == PD_Q8_0) {
        const int8_t *q = (const int8_t *)(b + 2);
        for (int j = 0; j < 32; j++) w[j] = d * (float)q[j];
        return;
    }
    float m = qtype == PD_Q4_1 ? f16_to_f32(b + 2) : -8.0f * d;
    const uint8_t *qs = b + (qtype == PD_Q4_1 ? 4 : 2);
    for (int j = 0; j < 16; j++) {
        w[j] = fmaf((float)(qs[j] & 0x0F), d, m);
        w[j + 16] = fmaf((float)(qs[j] >> 4), d, m);
    }
}

/* Dense float32 [N, K] copy of raw blocks (the test oracle for the block layouts). */
int pd_dequantize(int qtype, const uint8_t *w, int64_t N, int64_t K, float *out) {
    int bb = pd_block_bytes(qtype);
    if (bb == 0 || K % 32 != 0) return PD_EINVAL;
    int64_t nblocks = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t blk = 0; blk < nblocks; blk++)
            dequant_block(qtype, w + (n * nblocks + blk) * bb, out + n * K + blk * 32);
    return PD_OK;
}

/* raw [N, K/32 blocks] -> codes [N, K/32, code_bytes], d [N, K/32], m [N, K/32] (m unused
 * and may be NULL for Q8_0). */
int pd_repack(int qtype, const uint8_t *raw, int64_t N, int64_t K, uint8_t *codes, float *d, float *m) {
    int bb = pd_block_bytes(qtype), cb = pd_code_bytes(qtype);
    if (bb == 0 || K % 32 != 0) return PD_EINVAL;
    int64_t nb = N * (K / 32);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = raw + b * bb;
        d[b] = f16_to_f32(blk);
        if (qtype == PD_Q4_1) {
            m[b] = f16_to_f32(blk + 2);
            memcpy(codes + b * cb, blk + 4, 16);
        } else if (qtype == PD_Q4_0) {
            m[b] = -8.0f * d[b];
            memcpy(codes + b * cb, blk + 2, 16);
        } else {
            memcpy(codes + b * cb, blk + 2, 32);
        }
    }
    return PD_OK;
}

#if PD_AVX2
/* Activations for the AVX2 path: weight codes are small integers, so they multiply
 * 16-bit integers (vpmaddwd: 16 products per instruction) far faster than they convert
 * to floats. Each row of x becomes two int16 terms with one scale per row,
 *   x ~= 2^e * s * (xh + xl / 65534),  s = max|x 2^-e| / 32767,
 * xh the rounded value and xl the rounded remainder: the error is at most 2^-32 of the
 * row's largest value, below what float32 accumulation itself loses, so results match a
 * float32 GEMM on the dequantized weights to float32 accuracy. The power of two 2^e
 * (frexp of the row maximum) keeps s and its inverse normal floats for rows of any
 * magnitude. Exact float block sums are kept for the offset term (value = d*q + m).
 * Layout: per block, 32 xh then 32 xl. */
static void quantize_rows_i16(const float *x, int64_t M, int64_t K, int16_t *xq, float *xscale, int32_t *xexp,
                              float *xsum) {
    int64_t nblocks = K / 32;
#pragma omp parallel for schedule(static) if (M * K > 32768)
    for (int64_t r = 0; r < M; r++) {
        const float *xr = x + r * K;
        __m256 sign = _mm256_set1_ps(-0.0f), amax = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xr + k)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        int e;
        float mx = frexpf(_mm_cvtss_f32(m4), &e); /* max|x| = mx * 2^e, mx in [0.5, 1) or 0 */
        /* 2^-e in two factors: for rows of subnormals, 2^-e alone overflows a float */
        float pow2a = ldexpf(1.0f, -e / 2), pow2b = ldexpf(1.0f, -e - (-e / 2)), scale = mx / 32767.0f, inv = mx > 0.0f ? 32767.0f / mx : 0.0f;
        xscale[r] = scale;
        xexp[r] = e;
        __m256 vpow2a = _mm256_set1_ps(pow2a), vpow2b = _mm256_set1_ps(pow2b), vinv = _mm256_set1_ps(inv);
        __m256 vinv_lo = _mm256_set1_ps(inv * 65534.0f), vscale = _mm256_set1_ps(scale);
        for (int64_t blk = 0; blk < nblocks; blk++) {
            const float *xb = xr + blk * 32;
            __m256i h[4], l[4];
            __m256 sum = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                __m256 v = _mm256_loadu_ps(xb + 8 * i);
                sum = _mm256_add_ps(sum, v);
                v = _mm256_mul_ps(_mm256_mul_ps(v, vpow2a), vpow2b); /* exact: powers of two */
                __m256 hf = _mm256_round_ps(_mm256_mul_ps(v, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                h[i] = _mm256_cvtps_epi32(hf);
                l[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_fnmadd_ps(hf, vscale, v), vinv_lo)); /* (x - s xh) */
            }
            xsum[r * nblocks + blk] = hsum256(sum);
            /* packs interleaves 128-bit lanes (saturating); the permute restores element order */
            int16_t *dst = xq + (r * nblocks + blk) * 64;
            _mm256_storeu_si256((__m256i *)dst, _mm256_permute4x64_epi64(_mm256_packs_epi32(h[0], h[1]), 0xD8));
            _mm256_storeu_si256((__m256i *)(dst + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(h[2], h[3]), 0xD8));
            _mm256_storeu_si256((__m256i *)(dst + 32), _mm256_permute4x64_epi64(_mm256_packs_epi32(l[0], l[1]), 0xD8));
            _mm256_storeu_si256((__m256i *)(dst + 48), _mm256_permute4x64_epi64(_mm256_packs_epi32(l[2], l[3]), 0xD8));
        }
    }
}

/* The codes of block `blk` as two vectors of 16 int16 (values 0-15 and 16-31). */
static inline __attribute__((always_inline)) void load_codes(int qtype, const uint8_t *codes, int64_t blk,
                                                             __m256i *lo, __m256i *hi) {
    if (qtype == PD_Q8_0) {
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + blk * 32)));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + blk * 32 + 16)));
    } else {
        __m128i q = _mm_loadu_si128((const __m128i *)(codes + blk * 16)), mask = _mm_set1_epi8(0x0F);
        *lo = _mm256_cvtepu8_epi16(_mm_and_si128(q, mask));
        *hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(q, 4), mask));
    }
}

/* sum_j code_j * x_j for one block, as 8 float partial sums (xp: the block's 32 xh, 32 xl). */
static inline __attribute__((always_inline)) __m256 block_dot(__m256i lo, __m256i hi, const int16_t *xp) {
    __m256i ph = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xp)),
                                  _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xp + 16))));
    __m256i pl = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)(xp + 32))),
                                  _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xp + 48))));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(pl), _mm256_set1_ps(1.0f / 65534.0f), _mm256_cvtepi32_ps(ph));
}

/* MC rows of quantized x against one weight row; MC is a compile-time constant at each
 * call site, so the accumulators live in registers. A single row runs two accumulator
 * chains (even and odd blocks): one chain would stall on FMA latency. */
static inline __attribute__((always_inline)) void row_dot_avx2(
    int qtype, const uint8_t *codes, const float *d, const float *m, int64_t nblocks, const int16_t *xq,
    const float *xscale, const int32_t *xexp, const float *xsum, int MC, float *out, int64_t ldo) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    __m256i lo, hi;
    if (MC == 1) {
        int64_t blk = 0;
        for (; blk + 2 <= nblocks; blk += 2) {
            load_codes(qtype, codes, blk, &lo, &hi);
            acc[0] = _mm256_fmadd_ps(block_dot(lo, hi, xq + blk * 64), _mm256_broadcast_ss(d + blk), acc[0]);
            load_codes(qtype, codes, blk + 1, &lo, &hi);
            acc[1] = _mm256_fmadd_ps(block_dot(lo, hi, xq + blk * 64 + 64), _mm256_broadcast_ss(d + blk + 1), acc[1]);
        }
        if (blk < nblocks) {
            load_codes(qtype, codes, blk, &lo, &hi);
            acc[0] = _mm256_fmadd_ps(block_dot(lo, hi, xq + blk * 64), _mm256_broadcast_ss(d + blk), acc[0]);
        }
        acc[0] = _mm256_add_ps(acc[0], acc[1]);
    } else {
        for (int64_t blk = 0; blk < nblocks; blk++) {
            load_codes(qtype, codes, blk, &lo, &hi);
            __m256 db = _mm256_broadcast_ss(d + blk);
            for (int i = 0; i < MC; i++)
                acc[i] = _mm256_fmadd_ps(block_dot(lo, hi, xq + (i * nblocks + blk) * 64), db, acc[i]);
        }
    }
    for (int i = 0; i < MC; i++) {
        float y = ldexpf(hsum256(acc[i]) * xscale[i], xexp[i]);
        if (m != NULL) y += dot(m, xsum + i * nblocks, nblocks);
        out[i * ldo] = y;
    }
}
#endif

/* y[M, ldy] (columns 0..N-1 written) = x[M, K] @ W[N, K]^T from repacked weights.
 * Returns PD_OK, PD_EINVAL for an unsupported type or a K that is not a multiple of 32,
 * PD_ENOMEM when out of memory. */
int pd_linear_packed(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *d,
                     const float *m, int64_t N, float *y, int64_t ldy) {
    if (pd_block_bytes(qtype) == 0 || K % 32 != 0) return PD_EINVAL;
    int64_t nblocks = K / 32, cb = pd_code_bytes(qtype) * nblocks;
    if (qtype == PD_Q8_0) m = NULL;
#if PD_AVX2
    int16_t *xq = (int16_t *)malloc((size_t)(2 * M * K) * sizeof(int16_t) + (size_t)(2 * M + M * nblocks) * 4);
    if (xq == NULL) return PD_ENOMEM;
    float *xscale = (float *)(xq + 2 * M * K), *xsum = xscale + M;
    int32_t *xexp = (int32_t *)(xsum + M * nblocks);
    quantize_rows_i16(x, M, K, xq, xscale, xexp, xsum);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *cn = codes + n * cb;
        const float *dn = d + n * nblocks, *mn = m == NULL ? NULL : m + n * nblocks;
        int64_t r = 0;
#define PD_ROWS(MC) row_dot_avx2(qtype, cn, dn, mn, nblocks, xq + 2 * r * K, xscale + r, xexp + r, xsum + r * nblocks, MC, \
                                 y + r * ldy + n, ldy)
        for (; r + 8 <= M; r += 8) PD_ROWS(8);
        for (; r + 4 <= M; r += 4) PD_ROWS(4);
        for (; r + 3 <= M; r += 3) PD_ROWS(3);
        for (; r + 2 <= M; r += 2) PD_ROWS(2);
        for (; r < M; r++) PD_ROWS(1);
#undef PD_ROWS
    }
    free(xq);
#else
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t r = 0; r < M; r++) {
            float acc = 0.0f;
            for (int64_t blk = 0; blk < nblocks; blk++) {
                const uint8_t *c = codes + n * cb + blk * pd_code_bytes(qtype);
                const float *xb = x + r * K + blk * 32;
                float db = d[n * nblocks + blk], mb = m == NULL ? 0.0f : m[n * nblocks + blk], s = 0.0f;
                for (int j = 0; j < 32; j++) {
                    float q = qtype == PD_Q8_0 ? (float)(int8_t)c[j] : (float)(j < 16 ? c[j] & 0x0F : c[j - 16] >> 4);
                    s += fmaf(q, db, mb) * xb[j];
                }
                acc += s;
            }
            y[r * ldy + n] = acc;
        }
    }
#endif
    return PD_OK;
}
