/* Native CPU kernels for pagedllm, called through ctypes (see ../native.py).
 *
 * Why C and not torch ops: on a CPU, a decode step of a small model is dominated by
 * reading weights (float32 weights are 4x the bytes of 8-bit blocks and ~6x those of
 * 4-bit blocks) and by per-op overhead (dozens of small torch ops per layer). These
 * kernels read ggml-quantized weights directly, attend over the paged KV cache without
 * gathering it, and fuse the residual add into RMSNorm.
 *
 * Numerics: weights are dequantized exactly as gguf_dequant.py does (d*q + m is exact
 * in float32 for 4- and 8-bit codes). The AVX2 quantized linear splits activations into
 * two int16 terms whose error (2^-32 of the row maximum) is below float32 accumulation
 * error (see quantize_rows_i16); everything else computes in float32 as torch would,
 * in another summation order.
 *
 * Threads: OpenMP. torch's CPU wheel ships libgomp.so.1 and loads it first, so these
 * kernels share torch's OpenMP runtime and thread count (torch.set_num_threads).
 * Every function has a portable scalar path; the AVX2/FMA/F16C path is chosen at
 * compile time (the library is built for the machine it runs on, -march=native).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PD_AVX2 1
#else
#define PD_AVX2 0
#endif

/* ggml type ids (gguf_file.py) */
enum { PD_Q4_0 = 2, PD_Q4_1 = 3, PD_Q8_0 = 8 };

int pd_abi_version(void) { return 2; }
int pd_has_avx2(void) { return PD_AVX2; }

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if PD_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* ------------------------------------------------------------------ helpers */
#if PD_AVX2
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

static inline float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if PD_AVX2
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    s = hsum256(_mm256_add_ps(acc0, acc1));
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

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
static inline int block_bytes(int qtype) {
    switch (qtype) {
    case PD_Q4_0: return 18;
    case PD_Q4_1: return 20;
    case PD_Q8_0: return 34;
    default: return 0;
    }
}

static inline int code_bytes(int qtype) { return qtype == PD_Q8_0 ? 32 : 16; }

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
    int bb = block_bytes(qtype);
    if (bb == 0 || K % 32 != 0) return -1;
    int64_t nblocks = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t blk = 0; blk < nblocks; blk++)
            dequant_block(qtype, w + (n * nblocks + blk) * bb, out + n * K + blk * 32);
    return 0;
}

/* raw [N, K/32 blocks] -> codes [N, K/32, code_bytes], d [N, K/32], m [N, K/32] (m unused
 * and may be NULL for Q8_0). */
int pd_repack(int qtype, const uint8_t *raw, int64_t N, int64_t K, uint8_t *codes, float *d, float *m) {
    int bb = block_bytes(qtype), cb = code_bytes(qtype);
    if (bb == 0 || K % 32 != 0) return -1;
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
    return 0;
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
 * Returns 0, -1 for an unsupported type or a K that is not a multiple of 32, -2 when out
 * of memory. */
int pd_linear_packed(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *d,
                     const float *m, int64_t N, float *y, int64_t ldy) {
    if (block_bytes(qtype) == 0 || K % 32 != 0) return -1;
    int64_t nblocks = K / 32, cb = code_bytes(qtype) * nblocks;
    if (qtype == PD_Q8_0) m = NULL;
#if PD_AVX2
    int16_t *xq = (int16_t *)malloc((size_t)(2 * M * K) * sizeof(int16_t) + (size_t)(2 * M + M * nblocks) * 4);
    if (xq == NULL) return -2;
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
                const uint8_t *c = codes + n * cb + blk * code_bytes(qtype);
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
    return 0;
}

/* ------------------------------------------------------------------ dense float32 linear
 * y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W packed once at load (pd_sgemm_pack) into
 * panels of 16 columns, [ceil(N/16)][K][16], zero-padded. The kernel is the classic
 * register-blocked GEMM: a 6-row x 16-column tile of y lives in 12 AVX2 registers while
 * k runs over a block of K; x is copied per block into 6-row strips, k-major, so every
 * k reads six consecutive floats and one 64-byte line of W. K is split into blocks of
 * at most 1536 (a 16-column strip of W is then <= 96 KiB, an L2-resident stream): one
 * block for common hidden sizes, so each output is written once (measured on Zen 3:
 * 288-wide blocks, which keep the strip in L1, were 10-25% slower at every shape).
 * Why not oneDNN/MKL, which torch ships: see dense.py (they run SmolLM2's shapes 0.9-1.8x
 * slower on AMD Zen 3).
 * Every k adds into float32 accumulators in order, so results differ from torch's only
 * in summation order (blocks of K are summed one after another). */
#define SG_MR 6
#define SG_NR 16
#define SG_KC 1536 /* K block */
#define SG_MC 96  /* rows of x per block */

void pd_sgemm_pack(const float *w, int64_t N, int64_t K, float *wp) {
    int64_t panels = (N + SG_NR - 1) / SG_NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = wp + p * K * SG_NR;
        for (int64_t j = 0; j < SG_NR; j++) {
            int64_t n = p * SG_NR + j;
            for (int64_t k = 0; k < K; k++) dst[k * SG_NR + j] = n < N ? w[n * K + k] : 0.0f;
        }
    }
}

/* rows [0, mc) of x (row stride ldx), columns [0, kc) -> strips [mc/6][kc][6], zero rows
 * past mc */
static void sgemm_pack_x(const float *x, int64_t ldx, int64_t mc, int64_t kc, float *xp) {
    for (int64_t i0 = 0; i0 < mc; i0 += SG_MR) {
        float *dst = xp + i0 * kc;
        for (int64_t i = 0; i < SG_MR; i++) {
            if (i0 + i < mc) {
                const float *src = x + (i0 + i) * ldx;
                for (int64_t k = 0; k < kc; k++) dst[k * SG_MR + i] = src[k];
            } else {
                for (int64_t k = 0; k < kc; k++) dst[k * SG_MR + i] = 0.0f;
            }
        }
    }
}

/* The mr x nr corner of a 6 x 16 tile `acc` (row-major) into y: added to y when
 * `accumulate` (later K blocks), else plus bias (first K block). */
static inline void sgemm_store(const float *acc, float *y, int64_t ldy, int mr, int nr, int accumulate,
                               const float *bias) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float v = acc[i * SG_NR + j];
            y[i * ldy + j] = accumulate ? y[i * ldy + j] + v : (bias != NULL ? v + bias[j] : v);
        }
}

static void sgemm_tile(int64_t kc, const float *xp, const float *wp, float *y, int64_t ldy, int mr, int nr,
                       int accumulate, const float *bias) {
#if PD_AVX2
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
           c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (int64_t k = 0; k < kc; k++) {
        __m256 w0 = _mm256_loadu_ps(wp), w1 = _mm256_loadu_ps(wp + 8), a;
        a = _mm256_broadcast_ss(xp + 0); c00 = _mm256_fmadd_ps(a, w0, c00); c01 = _mm256_fmadd_ps(a, w1, c01);
        a = _mm256_broadcast_ss(xp + 1); c10 = _mm256_fmadd_ps(a, w0, c10); c11 = _mm256_fmadd_ps(a, w1, c11);
        a = _mm256_broadcast_ss(xp + 2); c20 = _mm256_fmadd_ps(a, w0, c20); c21 = _mm256_fmadd_ps(a, w1, c21);
        a = _mm256_broadcast_ss(xp + 3); c30 = _mm256_fmadd_ps(a, w0, c30); c31 = _mm256_fmadd_ps(a, w1, c31);
        a = _mm256_broadcast_ss(xp + 4); c40 = _mm256_fmadd_ps(a, w0, c40); c41 = _mm256_fmadd_ps(a, w1, c41);
        a = _mm256_broadcast_ss(xp + 5); c50 = _mm256_fmadd_ps(a, w0, c50); c51 = _mm256_fmadd_ps(a, w1, c51);
        xp += SG_MR;
        wp += SG_NR;
    }
    __m256 acc[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
    if (mr == SG_MR && nr == SG_NR) {
        for (int i = 0; i < SG_MR; i++) {
            float *yi = y + i * ldy;
            __m256 a0 = acc[2 * i], a1 = acc[2 * i + 1];
            if (accumulate) {
                a0 = _mm256_add_ps(a0, _mm256_loadu_ps(yi));
                a1 = _mm256_add_ps(a1, _mm256_loadu_ps(yi + 8));
            } else if (bias != NULL) {
                a0 = _mm256_add_ps(a0, _mm256_loadu_ps(bias));
                a1 = _mm256_add_ps(a1, _mm256_loadu_ps(bias + 8));
            }
            _mm256_storeu_ps(yi, a0);
            _mm256_storeu_ps(yi + 8, a1);
        }
        return;
    }
    float tile[SG_MR * SG_NR];
    for (int i = 0; i < 12; i++) _mm256_storeu_ps(tile + 8 * i, acc[i]);
    sgemm_store(tile, y, ldy, mr, nr, accumulate, bias);
#else
    float tile[SG_MR * SG_NR] = {0};
    for (int64_t k = 0; k < kc; k++)
        for (int i = 0; i < SG_MR; i++)
            for (int j = 0; j < SG_NR; j++) tile[i * SG_NR + j] += xp[k * SG_MR + i] * wp[k * SG_NR + j];
    sgemm_store(tile, y, ldy, mr, nr, accumulate, bias);
#endif
}

/* y (row stride ldy) = x [M, K] (row stride ldx) @ W^T + bias (may be NULL), W from
 * pd_sgemm_pack. Work items are (block of rows, run of 16-column panels); threads take
 * them dynamically, each packing its own x block. Returns 0, or -2 when out of memory. */
int pd_sgemm(const float *x, int64_t ldx, int64_t M, int64_t K, const float *wp, int64_t N, const float *bias,
             float *y, int64_t ldy) {
    if (M <= 0 || N <= 0) return 0;
    int64_t panels = (N + SG_NR - 1) / SG_NR;
    int64_t kblocks = (K + SG_KC - 1) / SG_KC, kcb = kblocks ? (K + kblocks - 1) / kblocks : 0;
    int64_t mblocks = (M + SG_MC - 1) / SG_MC, mcb = (M + mblocks - 1) / mblocks;
    mcb = (mcb + SG_MR - 1) / SG_MR * SG_MR;
    mblocks = (M + mcb - 1) / mcb;
    /* enough items for the threads to balance: 2 per thread when rows alone are too few */
    int64_t threads = omp_get_max_threads(), runs = mblocks >= 2 * threads ? 1 : (2 * threads + mblocks - 1) / mblocks;
    if (runs > panels) runs = panels;
    int64_t per_run = (panels + runs - 1) / runs;
    runs = (panels + per_run - 1) / per_run;
    if (K == 0) {
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) y[i * ldy + j] = bias != NULL ? bias[j] : 0.0f;
        return 0;
    }
    int failed = 0;
#pragma omp parallel
    {
        float *xp = (float *)malloc((size_t)(mcb * kcb) * sizeof(float));
        if (xp == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t mb = 0; mb < mblocks; mb++)
            for (int64_t run = 0; run < runs; run++) {
                if (xp == NULL) continue;
                int64_t i0 = mb * mcb, mc = M - i0 < mcb ? M - i0 : mcb;
                int64_t p0 = run * per_run, p1 = p0 + per_run < panels ? p0 + per_run : panels;
                for (int64_t k0 = 0; k0 < K; k0 += kcb) {
                    int64_t kc = K - k0 < kcb ? K - k0 : kcb;
                    sgemm_pack_x(x + i0 * ldx + k0, ldx, mc, kc, xp);
                    for (int64_t p = p0; p < p1; p++) {
                        int64_t n0 = p * SG_NR;
                        int nr = (int)(N - n0 < SG_NR ? N - n0 : SG_NR);
                        const float *wpp = wp + p * K * SG_NR + k0 * SG_NR;
                        for (int64_t i = 0; i < mc; i += SG_MR)
                            sgemm_tile(kc, xp + i * kc, wpp, y + (i0 + i) * ldy + n0, ldy,
                                       (int)(mc - i < SG_MR ? mc - i : SG_MR), nr, k0 > 0,
                                       bias != NULL ? bias + n0 : NULL);
                    }
                }
            }
        free(xp);
    }
    return failed ? -2 : 0;
}

/* ------------------------------------------------------------------ row gather */
/* out[i] = table[ids[i]] for rows of `row_len` floats (embedding and rotary-table
 * lookups). Returns -1, writing nothing, when an id is outside [0, num_rows). */
int pd_gather_rows(const float *table, int64_t num_rows, int64_t row_len, const int64_t *ids, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= num_rows) return -1;
#pragma omp parallel for schedule(static) if (n * row_len > 65536)
    for (int64_t i = 0; i < n; i++) memcpy(out + i * row_len, table + ids[i] * row_len, (size_t)row_len * sizeof(float));
    return 0;
}

/* ------------------------------------------------------------------ elementwise */

/* exp(x), vectorised: 2^(x log2 e) split into an integer power of two and a degree-6
 * polynomial on [-0.5, 0.5]; relative error below 2e-7. Inputs are clamped to
 * [-87, 88] (results stay normal floats). */
#if PD_AVX2
static inline __m256 exp_avx2(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(t, n); /* [-0.5, 0.5] */
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* In place: x[i] = exp(x[i] - max); returns the sum. */
static float exp_sub_sum(float *x, int64_t n, float max) {
    int64_t i = 0;
    float sum = 0.0f;
#if PD_AVX2
    __m256 vmax = _mm256_set1_ps(max), vsum = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax));
        _mm256_storeu_ps(x + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    sum = hsum256(vsum);
#endif
    for (; i < n; i++) {
        x[i] = expf(x[i] - max);
        sum += x[i];
    }
    return sum;
}


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

/* ------------------------------------------------------------------ paged KV cache
 * Cache layout (one layer): key_cache and value_cache each [num_blocks, block_size,
 * num_kv_heads, head_size] float32, token slot s = block * block_size + offset.
 */

/* Copy T new tokens' keys/values ([T, kvh * D] rows, given strides) to their slots. */
void pd_write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *key_cache,
                 float *value_cache, const int64_t *slots, int64_t T, int64_t row) {
    for (int64_t t = 0; t < T; t++) {
        memcpy(key_cache + slots[t] * row, k + t * k_stride, (size_t)row * sizeof(float));
        memcpy(value_cache + slots[t] * row, v + t * v_stride, (size_t)row * sizeof(float));
    }
}

/* Attention of query tokens over the paged cache, without gathering it.
 *
 * Request r (of num_reqs) has q_len = query_start[r+1] - query_start[r] query rows, at
 * rows row_start[r] .. row_start[r] + q_len - 1 of q and out; they are the last of its
 * seq_lens[r] context tokens, so query i sits at position seq_len - q_len + i and sees
 * keys 0..position (window > 0: only the last `window` of them). query_start is the
 * running count over these requests only (query_start[0] = 0), so a caller can hand
 * over any subset of a batch. q rows have stride q_stride floats, out is [*, H, D].
 * Grouped-query heads: query head h reads kv head h / (H / KVH).
 * soft_cap > 0: scores become soft_cap * tanh(score / soft_cap).
 * Work item = (query row, kv head); within an item, keys are scored for two query
 * heads per pass and values summed for up to three, so each row is loaded fewer times.
 */
#if PD_AVX2
/* [sum(a[0]), ..., sum(a[7])]: eight horizontal sums in one vector. */
static inline __m256 hsum8_avx2(const __m256 *a) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Eight dot products q . k_i (D a multiple of 8): one accumulator per key, so eight
 * independent FMA chains, then a transpose-add into one vector of eight scores. */
static inline __m256 dot8_avx2(const float *qh, const float *const *k, int64_t D) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 qv = _mm256_loadu_ps(qh + d);
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[i] + d), a[i]);
    }
    return hsum8_avx2(a);
}

/* Keys and values of one request sit in 16-token blocks scattered over the cache, so
 * the hardware prefetcher loses the stream at every block boundary: ask for rows a few
 * keys ahead (up to `count` rows of `floats` floats, none past the end). */
#define PD_PREFETCH_ROWS 32
static inline void prefetch_rows(const float *const *rows, int64_t left, int64_t count, int64_t floats) {
    for (int64_t i = 0; i < count && i < left; i++)
        for (int64_t f = 0; f < floats; f += 16) _mm_prefetch((const char *)(rows[i] + f), _MM_HINT_T0);
}

/* Scores of two query heads against four keys: [q0.k0..q0.k3 | q1.k0..q1.k3]. */
static inline __m256 dot4x2_avx2(const float *q0, const float *q1, const float *const *k, int64_t D) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 x0 = _mm256_loadu_ps(q0 + d), x1 = _mm256_loadu_ps(q1 + d);
        for (int i = 0; i < 4; i++) {
            __m256 kv = _mm256_loadu_ps(k[i] + d);
            a[i] = _mm256_fmadd_ps(x0, kv, a[i]);
            a[4 + i] = _mm256_fmadd_ps(x1, kv, a[4 + i]);
        }
    }
    return hsum8_avx2(a);
}

/* For `heads` (1-3, a constant at each call) query heads h: out[h*ld + 0:32] =
 * sum_j p[h*pstride + j] * v[j][off:off+32], the 4*heads accumulators held in registers. */
static inline __attribute__((always_inline)) void weighted_sum32_avx2(int heads, const float *p, int64_t pstride,
                                                                      const float *const *v, int64_t n, int64_t off,
                                                                      float *out, int64_t ld) {
    __m256 a[12];
    for (int i = 0; i < 4 * heads; i++) a[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        if (off == 0) prefetch_rows(v + j + PD_PREFETCH_ROWS, n - j - PD_PREFETCH_ROWS, 1, ld);
        const float *vp = v[j] + off;
        __m256 v0 = _mm256_loadu_ps(vp), v1 = _mm256_loadu_ps(vp + 8), v2 = _mm256_loadu_ps(vp + 16),
               v3 = _mm256_loadu_ps(vp + 24);
        for (int h = 0; h < heads; h++) {
            __m256 pj = _mm256_broadcast_ss(p + h * pstride + j);
            a[4 * h] = _mm256_fmadd_ps(pj, v0, a[4 * h]);
            a[4 * h + 1] = _mm256_fmadd_ps(pj, v1, a[4 * h + 1]);
            a[4 * h + 2] = _mm256_fmadd_ps(pj, v2, a[4 * h + 2]);
            a[4 * h + 3] = _mm256_fmadd_ps(pj, v3, a[4 * h + 3]);
        }
    }
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + h * ld + 8 * i, a[4 * h + i]);
}
#endif

int pd_paged_attention(const float *q, int64_t q_stride, const float *key_cache, const float *value_cache,
                       const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                       const int32_t *query_start, const int32_t *row_start, int64_t num_reqs, float *out, int64_t H,
                       int64_t KVH, int64_t D, int64_t block_size, float scale, int64_t window, float soft_cap) {
    /* max_seq_len sizes the scratch rows (at least 1: no malloc of 0 bytes) */
    int64_t T = query_start[num_reqs], G = H / KVH, row = KVH * D, max_seq_len = 1;
    /* every length must fit its block-table row (bt_stride blocks) and cover its queries */
    for (int64_t r = 0; r < num_reqs; r++) {
        if (seq_lens[r] > bt_stride * block_size || seq_lens[r] < query_start[r + 1] - query_start[r]) return -3;
        max_seq_len = seq_lens[r] > max_seq_len ? seq_lens[r] : max_seq_len;
    }
    int failed = 0;
#pragma omp parallel
    {
        /* per thread: scores [G, max_seq_len], then key and value row pointers */
        float *scores = (float *)malloc((size_t)(G * max_seq_len) * sizeof(float) + 2 * (size_t)max_seq_len * sizeof(float *));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < T * KVH; item++) {
            if (scores == NULL) continue;
            int64_t t = item / KVH, kh = item % KVH;
            /* which request owns query row t (binary search over the running counts) */
            int64_t lo = 0, hi = num_reqs - 1;
            while (lo < hi) {
                int64_t mid = (lo + hi + 1) / 2;
                if (query_start[mid] <= t) lo = mid; else hi = mid - 1;
            }
            int64_t r = lo, q_len = query_start[r + 1] - query_start[r], i = t - query_start[r];
            int64_t pos = seq_lens[r] - q_len + i, qrow = row_start[r] + i;
            int64_t start = window > 0 && pos + 1 > window ? pos + 1 - window : 0, n = pos + 1 - start;
            const int32_t *bt = block_tables + r * bt_stride;
            const float **krow = (const float **)(scores + G * max_seq_len), **vrow = krow + max_seq_len;
            for (int64_t j = 0; j < n; j++) {
                int64_t p = start + j, slot = (int64_t)bt[p / block_size] * block_size + p % block_size;
                krow[j] = key_cache + slot * row + kh * D;
                vrow[j] = value_cache + slot * row + kh * D;
            }
            const float *qt = q + qrow * q_stride + kh * G * D; /* this kv head's G query heads */
            int64_t g = 0;
#if PD_AVX2
            /* two query heads per pass over the keys: each key chunk is loaded once */
            if (D % 8 == 0)
                for (; g + 2 <= G; g += 2) {
                    float *s0 = scores + g * max_seq_len, *s1 = s0 + max_seq_len;
                    int64_t j = 0;
                    for (; j + 4 <= n; j += 4) {
                        if (g == 0) prefetch_rows(krow + j + PD_PREFETCH_ROWS, n - j - PD_PREFETCH_ROWS, 4, D);
                        __m256 both = dot4x2_avx2(qt + g * D, qt + (g + 1) * D, krow + j, D);
                        _mm_storeu_ps(s0 + j, _mm256_castps256_ps128(both));
                        _mm_storeu_ps(s1 + j, _mm256_extractf128_ps(both, 1));
                    }
                    for (; j < n; j++) {
                        s0[j] = dot(qt + g * D, krow[j], D);
                        s1[j] = dot(qt + (g + 1) * D, krow[j], D);
                    }
                }
#endif
            for (; g < G; g++) {
                const float *qh = qt + g * D;
                float *s = scores + g * max_seq_len;
                int64_t j = 0;
#if PD_AVX2
                if (D % 8 == 0)
                    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(s + j, dot8_avx2(qh, krow + j, D));
#endif
                for (; j < n; j++) s[j] = dot(qh, krow[j], D);
            }
            for (g = 0; g < G; g++) {
                float *s = scores + g * max_seq_len, mx = -INFINITY;
                for (int64_t j = 0; j < n; j++) {
                    float sc = s[j] * scale;
                    s[j] = sc = soft_cap > 0.0f ? soft_cap * tanhf(sc / soft_cap) : sc;
                    mx = sc > mx ? sc : mx;
                }
                float inv = 1.0f / exp_sub_sum(s, n, mx);
                for (int64_t j = 0; j < n; j++) s[j] *= inv;
            }
            float *ot = out + (qrow * H + kh * G) * D;
            int64_t d = 0;
#if PD_AVX2
            /* up to three heads at a time, 32 dimensions at a time: each value chunk is
             * loaded once for all of them */
            for (; d + 32 <= D; d += 32)
                for (g = 0; g < G; g += 3) {
                    int heads = G - g < 3 ? (int)(G - g) : 3;
                    const float *p = scores + g * max_seq_len;
                    float *o = ot + g * D + d;
                    if (heads == 3) weighted_sum32_avx2(3, p, max_seq_len, vrow, n, d, o, D);
                    else if (heads == 2) weighted_sum32_avx2(2, p, max_seq_len, vrow, n, d, o, D);
                    else weighted_sum32_avx2(1, p, max_seq_len, vrow, n, d, o, D);
                }
#endif
            if (d < D)
                for (g = 0; g < G; g++) {
                    const float *p = scores + g * max_seq_len;
                    float *o = ot + g * D;
                    memset(o + d, 0, (size_t)(D - d) * sizeof(float));
                    for (int64_t j = 0; j < n; j++)
                        for (int64_t e = d; e < D; e++) o[e] += p[j] * vrow[j][e];
                }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
