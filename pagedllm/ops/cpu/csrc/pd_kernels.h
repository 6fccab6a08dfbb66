/* Native CPU kernels for pagedllm, called through ctypes (see ../native.py): what the
 * kernel families share. One .c file per family, all built into one library:
 *   abi.c          pd_abi_version, pd_has_avx2
 *   quant.c        ggml-quantized weights: pd_repack, pd_linear_packed, pd_dequantize
 *   blocks.c       ggml blocks at load: pd_dequantize_k (Q4_K / Q5_K / Q6_K), the rewrites
 *                  pd_q4_k_as_q4_1 and pd_as_q8_0
 *   sgemm.c        dense float32 linear: pd_sgemm_pack, pd_sgemm; pd_linear_packed_gemm (quant.c's
 *                  repacked weights decoded panel by panel into the same GEMM)
 *   elementwise.c  pd_rms_norm, pd_silu_mul, pd_rope_neox, pd_gather_rows(_bf16), pd_argmax_rows
 *   attention.c    the paged KV cache: pd_write_kv, pd_paged_attention (+ _bf16 variants,
 *                  pd_has_bf16_kv), pd_attention_tiles
 *   amx.c          bf16 linear on AMX tiles: pd_has_amx, pd_amx_pack, pd_amx_linear, pd_amx_linear_silu;
 *                  Q4_0 / Q4_1 / Q8_0 blocks dequantized into the tiles: pd_amx_qt_pack, pd_amx_qt_linear(_silu)
 *   bf16dot.c      the same tiles on AVX512-BF16 dot products: pd_has_bf16dot, pd_bf16dot_linear(_silu)
 *   vnni.c         ggml 4/8-bit weights x 14-bit (or, asked for, int8) integer activations on AVX512-VNNI
 *                  (or, without it, AVX2's u8 x s8 pair products):
 *                  pd_has_vnni, pd_vnni_packed_size, pd_vnni_pack, pd_vnni_linear
 *   lut4.c         4-bit codebook weights (bitsandbytes NF4 / FP4): pd_linear_lut4
 *   moe.c          a MoE layer's routed float32 experts in one call: pd_moe_f32
 *   replay.c       a recorded step's kernel calls in one call (step replay): pd_replay
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
 * error (see quantize_rows_i16 in quant.c); everything else computes in float32 as torch
 * would, in another summation order.
 *
 * Threads: OpenMP. torch's CPU wheel ships libgomp.so.1 and loads it first, so these
 * kernels share torch's OpenMP runtime and thread count (torch.set_num_threads).
 * Every function has a portable scalar path; the AVX2/FMA/F16C path is chosen at
 * compile time (the library is built for the machine it runs on, -march=native).
 */
#ifndef PD_KERNELS_H
#define PD_KERNELS_H

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

/* 512-bit paths (Zen 4, Xeons since Skylake-SP) beside the AVX2 ones where they pay */
#if PD_AVX2 && defined(__AVX512F__) && defined(__AVX512DQ__)
#define PD_AVX512 1
#else
#define PD_AVX512 0
#endif

/* What pd_abi_version reports; native.py checks it against its ABI_VERSION at load.
 * Bump both when an exported symbol or a signature changes, or a return code changes
 * in a way native.py's wrappers read differently. */
#define PD_ABI_VERSION 17

/* What the kernels that return an int return (native.py mirrors them by these names).
 * PD_EINVAL: an argument the kernel does not take (a ggml type or K it does not read,
 *            an id outside the table); PD_ENOMEM: a scratch allocation failed;
 * PD_ERANGE: a sequence length overruns its block-table row or is shorter than its query. */
enum { PD_OK = 0, PD_EINVAL = -1, PD_ENOMEM = -2, PD_ERANGE = -3 };

/* ggml type ids (gguf_file.py) of the quantized weights quant.c and sgemm.c read (and
 * vnni.c, which reads Q4_K too; blocks.c converts the K-quants at load) */
enum { PD_Q4_0 = 2, PD_Q4_1 = 3, PD_Q8_0 = 8, PD_Q4_K = 12, PD_Q5_K = 13, PD_Q6_K = 14 };

/* Bytes of one 32-value ggml block of Q4_0 {f16 d; u8 qs[16]}, Q4_1 {f16 d; f16 m; u8 qs[16]}
 * or Q8_0 {f16 d; i8 qs[32]}; 0 for the other types. */
static inline int pd_block_bytes(int qtype) {
    return qtype == PD_Q4_0 ? 18 : qtype == PD_Q4_1 ? 20 : qtype == PD_Q8_0 ? 34 : 0;
}

/* Bytes of one of those blocks' codes (two 4-bit codes a byte, or one 8-bit code). */
static inline int pd_code_bytes(int qtype) { return qtype == PD_Q8_0 ? 32 : 16; }

/* ------------------------------------------------------------------ what the library exports
 * Declared once here, so that every definition is checked against its declaration and the
 * files that call each other's kernels (moe.c runs sgemm.c's GEMM and elementwise.c's silu,
 * replay.c every kernel a forward calls) call them as defined. native.py's _SIGNATURES
 * mirrors these for ctypes. */
int pd_abi_version(void);
int pd_has_avx2(void);
int pd_repack(int qtype, const uint8_t *raw, int64_t N, int64_t K, uint8_t *codes, float *d, float *m);
int pd_linear_packed(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *d,
                     const float *m, int64_t N, float *y, int64_t ldy);
int pd_dequantize(int qtype, const uint8_t *w, int64_t N, int64_t K, float *out);
void pd_sgemm_pack(const float *w, int64_t N, int64_t K, float *wp);
int pd_sgemm(const float *x, int64_t ldx, int64_t M, int64_t K, const float *wp, int64_t N, const float *bias,
             float *y, int64_t ldy);
int pd_linear_packed_gemm(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *d,
                          const float *m, int64_t N, float *y, int64_t ldy);
void pd_rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t T, int64_t H, float eps);
void pd_silu_mul(const float *x, float *out, int64_t T, int64_t I);
void pd_rope_neox(float *x, int64_t T, int64_t stride, int64_t nheads, int64_t D, const float *cos_t,
                  const float *sin_t);
int pd_gather_rows(const float *table, int64_t num_rows, int64_t row_len, const int64_t *ids, int64_t n, float *out);
int pd_gather_rows_bf16(const uint16_t *table, int64_t num_rows, int64_t row_len, const int64_t *ids, int64_t n,
                        float *out);
void pd_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t ld, int64_t *out);
void pd_write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *key_cache,
                 float *value_cache, const int64_t *slots, int64_t T, int64_t row);
void pd_write_kv_bf16(const float *k, int64_t k_stride, const float *v, int64_t v_stride, uint16_t *key_cache,
                      uint16_t *value_cache, const int64_t *slots, int64_t T, int64_t row);
int pd_paged_attention(const float *q, int64_t q_stride, const float *key_cache, const float *value_cache,
                       const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                       const int32_t *query_start, const int32_t *row_start, int64_t num_reqs, float *out, int64_t H,
                       int64_t KVH, int64_t D, int64_t block_size, float scale, int64_t window, float soft_cap);
int pd_paged_attention_bf16(const float *q, int64_t q_stride, const uint16_t *key_cache, const uint16_t *value_cache,
                            const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                            const int32_t *query_start, const int32_t *row_start, int64_t num_reqs, float *out,
                            int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale, int64_t window,
                            float soft_cap);
int pd_has_bf16_kv(void);
int pd_attention_tiles(int64_t D, int64_t G);
int pd_has_amx(void);
int64_t pd_amx_packed_size(int64_t N, int64_t K);
void pd_amx_pack(const float *w, int64_t N, int64_t K, uint16_t *wp);
int pd_amx_linear(const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                  const float *bias, void *y, int y_bf16, int64_t ldy);
int pd_amx_linear_silu(const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                       const float *bias, float *y, int64_t ldy);
int64_t pd_amx_qt_packed_size(int qtype, int64_t N, int64_t K);
int pd_amx_qt_pack(int qtype, const uint8_t *raw, int64_t N, int64_t K, uint8_t *out);
int pd_amx_qt_linear(int qtype, const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *wq, int64_t N,
                     float *y, int64_t ldy);
int pd_amx_qt_linear_silu(int qtype, const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *wq,
                          int64_t N, float *y, int64_t ldy);
int pd_has_bf16dot(void);
int pd_bf16dot_linear(const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                      const float *bias, void *y, int y_bf16, int64_t ldy);
int pd_bf16dot_linear_silu(const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, const uint16_t *wp,
                           int64_t N, const float *bias, float *y, int64_t ldy);
int pd_has_vnni(void);
int64_t pd_vnni_packed_size(int qtype, int64_t N, int64_t K);
int pd_vnni_pack(int qtype, const uint8_t *raw, int64_t N, int64_t K, uint8_t *out);
int pd_vnni_linear(int qtype, int x8, const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *wp, int64_t N,
                   float *y, int64_t ldy);
int pd_linear_lut4(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *lut,
                   const float *absmax, int64_t block, int64_t N, float *y, int64_t ldy);
int pd_moe_f32(const float *x, int64_t T, int64_t H, const int64_t *ids, const float *weights, int64_t k, int64_t E,
               const float *w13p, const float *w2p, int64_t I, int act, float *out);
int pd_replay_kernel(const char *name, char *kinds);
int64_t pd_replay_call_size(void);
/* amx.c's activation rounding, which bf16dot.c shares: rows [0, M) of x (float32, or bf16
 * when x_bf16) -> bf16 [Mp][Kp], zero-padded */
void pd_bf16_pack_x(const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, int64_t Mp, int64_t Kp,
                    uint16_t *xa);

/* ------------------------------------------------------------------ shared helpers
 * hsum256: quant.c, attention.c and dot; dot: quant.c, pd_rms_norm, attention.c; transpose16_ps:
 * attention.c, amx.c;
 * exp_avx2, exp_avx512: pd_silu_mul, attention.c. */
#if PD_AVX2
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#if PD_AVX512
/* attention.c's prefill tiles and pd_amx_pack */
/* r[0..15], 16 rows of 16 floats, replaced by their transpose (r[c] lane l = old r[l] lane c):
 * pairs of rows interleaved, then 4 x 4 blocks within 128-bit lanes, then the lanes. */
static inline __attribute__((always_inline)) void transpose16_ps(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);     /* lane k: r_i[4k], r_i+1[4k], r_i[4k+1], r_i+1[4k+1] */
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]); /* the same for 4k + 2, 4k + 3 */
    }
    for (int a = 0; a < 16; a += 4) { /* u[a + j] lane k: rows a .. a + 3 of column 4k + j */
        u[a] = _mm512_shuffle_ps(t[a], t[a + 2], 0x44);
        u[a + 1] = _mm512_shuffle_ps(t[a], t[a + 2], 0xEE);
        u[a + 2] = _mm512_shuffle_ps(t[a + 1], t[a + 3], 0x44);
        u[a + 3] = _mm512_shuffle_ps(t[a + 1], t[a + 3], 0xEE);
    }
    for (int j = 0; j < 4; j++) { /* column 4k + j: lane k of u[j], u[4 + j], u[8 + j], u[12 + j] */
        __m512 lo0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44), hi0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xEE);
        __m512 lo1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44);
        __m512 hi1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xEE);
        r[j] = _mm512_shuffle_f32x4(lo0, lo1, 0x88);
        r[4 + j] = _mm512_shuffle_f32x4(lo0, lo1, 0xDD);
        r[8 + j] = _mm512_shuffle_f32x4(hi0, hi1, 0x88);
        r[12 + j] = _mm512_shuffle_f32x4(hi0, hi1, 0xDD);
    }
}
#endif

/* f16 bits as a float32 (exact): quant.c, blocks.c */
static inline float f16_from_bits(uint16_t h) {
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

/* The little-endian f16 stored at p, as a float32 */
static inline float f16_to_f32(const uint8_t *p) { return f16_from_bits((uint16_t)(p[0] | (p[1] << 8))); }

/* float32 -> bf16, round to nearest even (NaN stays NaN): torch's .to(torch.bfloat16) */
static inline uint16_t pd_bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline void pd_bf16_round_row(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512BF16__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
#endif
    for (; i < n; i++) dst[i] = pd_bf16_round(src[i]);
}

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

/* exp(x), vectorised: 2^(x log2 e) split into an integer power of two and a degree-6
 * polynomial on [-0.5, 0.5] (PD_EXP_POLY, highest power first); relative error below
 * 2e-7. Inputs are clamped to [-87, 88] (results stay normal floats). exp_avx512 is the
 * same on 16 lanes (the same values: the power of two applied with scalef, exact for these
 * normal results). */
static const float PD_EXP_POLY[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                     5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};
#if PD_AVX2
static inline __m256 exp_avx2(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(t, n); /* [-0.5, 0.5] */
    __m256 p = _mm256_set1_ps(PD_EXP_POLY[0]);
    for (int i = 1; i < 7; i++) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(PD_EXP_POLY[i]));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif
#if PD_AVX512
static inline __m512 exp_avx512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(PD_EXP_POLY[0]);
    for (int i = 1; i < 7; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(PD_EXP_POLY[i]));
    return _mm512_scalef_ps(p, n);
}

/* silu(g) * u = g / (1 + exp(-g)) * u on 16 lanes: the one arithmetic pd_silu_mul and the fused
 * gate/up GEMMs (amx.c, bf16dot.c) share, so a fused result equals the GEMM then the op. */
static inline __m512 silu_mul_avx512(__m512 g, __m512 u) {
    __m512 e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}
#endif

#endif /* PD_KERNELS_H */
