/* ggml 4- and 8-bit weights (Q4_0, Q4_1, Q8_0) times integer activations on AVX512-VNNI
 * (VPDPBUSD: 64 u8 x s8 products into 16 int32 sums per instruction), for the few-row
 * calls of decode and speculative verify steps on Zen 4 / Ice Lake and later Xeons; and
 * the same in an AVX2 form for CPUs without AVX512-VNNI (Zen 3), last paragraph.
 *
 * Why: quant.c's AVX2 kernel keeps float32 accuracy by splitting every activation into two
 * int16 terms and sums each output's products horizontally; on a 2-core Zen 4 it ran
 * SmolLM2's 3072 x 576 Q4_1 layer at one row in ~95 us where streaming its 1.1 MB of
 * blocks takes ~33, and every extra row cost nearly as much again. Here the lanes of a
 * register are 16 output columns, so one block's scale is one vector multiply for 16
 * columns, the weight codes are unpacked once per row block, and each more row costs
 * only its products.
 *
 * Numerics (what `vnni_linear` documents): each 32-value block of an activation row is
 * scaled to integers X in [-8191, 8191] (s = block max / 8191, nearest), so the rounding
 * error is at most 1/16382 of the block's largest value: finer than bf16 rounding for every
 * value above 1/32 of its block's maximum. X = 128 xh + xl with xh in [-64, 63] and xl in
 * [0, 127], two int8 operands; the products of codes and X are exact in int32, then
 * scaled by d * s and summed over blocks in float32. Q4_0's and Q8_0's code offsets
 * (q - 8, and q + 128 stored unsigned) are taken off in int32, exactly; Q4_1's offset m
 * multiplies the block's float32 sum of x. A block holding NaN or infinity makes its row's
 * outputs NaN.
 *
 * With x8 (pd_vnni_linear's int8 form, llama.cpp's numerics, asked for by the user) a block
 * is rounded to X in [-127, 127] instead (s = block max / 127, error at most 1/254 of the
 * block's largest value): one int8 operand, one VPDPBUSD per weight vector and row where
 * the 14-bit form takes two, and half the accumulators, so 12 rows per register block.
 *
 * Weight layout (pd_vnni_pack): 16-column panels; for each 32-value block of K, the codes
 * as 64-byte vectors whose 16 lanes are the columns and whose 4 bytes per lane are 4
 * consecutive k (VPDPBUSD's operand against a row's 4 activations broadcast). Q4 codes
 * pair quads l and l + 4 in one byte's low and high nibble (4 vectors per block), Q8
 * codes are q + 128 (8 vectors). Then the block's 16 scales d and (Q4_1) offsets m as
 * f16, as in the file. Columns past N are zero.
 *
 * Q4_K (value d * sc * q - dmin * m per 32 values, sc and m 6-bit) is read as stored rather
 * than as its Q4_1 rewrite (5 bits per weight): per 256-value super-block of a panel, the
 * 16 columns' d and dmin as f16 (as in the file), then 8 block records of Q4-paired codes and
 * the columns' sc and m as bytes: 4.625 bits per weight, exact (d * sc and dmin * m are exact
 * in float32). Q6_K as stored was tried the same way (6.625 bits against Q8_0's 8.5): on a
 * 2-core Zen 4 its unpacking made it compute-bound, slower than Q8_0 streamed (523 against
 * 455 us for a 1536 x 8704 layer), and it added ~1 s to the build; not kept.
 *
 * The AVX2 form (vn2_*) reads the same panels, 8 columns (a 32-byte half of each code
 * vector) at a time, and computes the same integers with VPMADDUBSW (u8 x s8 products,
 * adjacent pairs summed in int16 with saturation) and VPMADDWD: 4-bit codes (0..15) times
 * xh (-64..63) or xl (0..127) keep a block's eight pair sums within int16 (15 * 127 * 2 * 8 =
 * 30480), widened once per block; Q8_0's codes c = q + 128 times xh reach 255 * 64 * 2 =
 * 32640, and its xl term takes the codes as signed q (xl * q: 127 * 128 * 2 = 32512), each
 * widened at once, so its dot is sum(q * X) + 16384 * sum(xh), the offset taken off like
 * the others'. With int8 activations, Q4 types take X itself in one term; Q8_0 keeps the two
 * (xh is then -1 or 0), the same integers without the speed-up. Results equal the AVX512
 * form's bitwise on Q4_0 / Q8_0 (Q4_1 / Q4_K: a block's float sum of x in another order).
 * It is compiled only where AVX512-VNNI is not (PAGEDLLM_CPU_MAX_ISA=avx2 builds it on any
 * AVX2 CPU, as the tests do). Where the CPU has AVX-VNNI (the VEX-encoded 256-bit VPDPBUSD of
 * Intel cores since Alder Lake, and of Sierra Forest), that instruction takes each maddubs /
 * madd pair: the same integers summed in int32 at once (PAGEDLLM_CPU_MAX_ISA=avx2_vnni). */
#include "pd_kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512DQ__)
#define PD_VNNI 1
#else
#define PD_VNNI 0
#endif

/* The AVX2 form, only where there is no AVX512-VNNI (it would never win there, and its
 * build would lengthen the first start-up). */
#if PD_AVX2 && !PD_VNNI
#define PD_VNNI2 1
#else
#define PD_VNNI2 0
#endif

/* ... with AVX-VNNI (VEX VPDPBUSD on 256 bits: Alder Lake and later Intel cores, Sierra Forest),
 * its u8 x s8 products go straight into int32 sums, as in the AVX512 form */
#if PD_VNNI2 && defined(__AVXVNNI__)
#define PD_VNNI2_DOT 1
#else
#define PD_VNNI2_DOT 0
#endif

/* pd_vnni_linear's flags and pd_has_vnni's forms */
enum { PD_VNNI_INT8 = 1 };
enum { PD_VNNI_FORM_512 = 1, PD_VNNI_FORM_AVX2 = 2, PD_VNNI_FORM_AVX_VNNI = 3 };

#define VN2_MR 4  /* activation rows per register block of the AVX2 form (16 ymm registers) */
#define VN_MR 8   /* activation rows per register block (two int8 terms per activation) */
#define VN_MR8 12 /* the same with one int8 term per activation (half the accumulators) */
#define VN_MR_MAX 12

static int vn_code_bytes(int qtype) { return 16 * pd_code_bytes(qtype); } /* a panel's 16 columns */

/* bytes of one panel's block record: codes, d, (Q4_1) m */
static int vn_record_bytes(int qtype) { return vn_code_bytes(qtype) + 32 + (qtype == PD_Q4_1 ? 32 : 0); }

#define VN_Q4K_SUPER 2368 /* bytes of one panel's Q4_K super-block: 16 d, 16 dmin, 8 records */
#define VN_Q4K_RECORD 288 /* codes 256, sc 16, m 16 */

/* Whether pd_vnni_linear reads `qtype` with rows of K values. */
static int vn_takes(int qtype, int64_t K) {
    if (qtype == PD_Q4_K) return K % 256 == 0;
    return pd_block_bytes(qtype) != 0 && K % 32 == 0;
}

/* Bytes of one 16-column panel over K. */
static int64_t vn_panel_bytes(int qtype, int64_t K) {
    return qtype == PD_Q4_K ? K / 256 * VN_Q4K_SUPER : K / 32 * vn_record_bytes(qtype);
}

/* Whether a block's values carry an offset m times the block's sum of x (Q4_1, Q4_K). */
static inline int vn_has_min(int qtype) { return qtype == PD_Q4_1 || qtype == PD_Q4_K; }

/* Which form this build has: PD_VNNI_FORM_512 (AVX512-VNNI), PD_VNNI_FORM_AVX2 (or, with AVX-VNNI,
 * PD_VNNI_FORM_AVX_VNNI), or 0 (neither). */
int pd_has_vnni(void) {
    return PD_VNNI ? PD_VNNI_FORM_512 : PD_VNNI2_DOT ? PD_VNNI_FORM_AVX_VNNI : PD_VNNI2 ? PD_VNNI_FORM_AVX2 : 0;
}

/* Size in bytes of pd_vnni_pack's output; 0 for a type or K it does not take. */
int64_t pd_vnni_packed_size(int qtype, int64_t N, int64_t K) {
    if (!vn_takes(qtype, K) || N < 0) return 0;
    return (N + 15) / 16 * vn_panel_bytes(qtype, K);
}

/* The 4-bit code of value j (0..255) of a ggml Q4_K super-block: d, dmin (f16), scales[12],
 * qs[128] (32-byte chunk i: values 64 i + t in the low nibbles, 64 i + 32 + t in the high). */
static inline int vn_q4k_code(const uint8_t *b, int j) {
    return b[16 + 32 * (j / 64) + j % 32] >> (4 * (j % 64 / 32)) & 0x0F;
}

/* Sub-block j's (0..7) 6-bit scale and min of a Q4_K super-block's scales[12]. */
static inline void vn_q4k_scale_min(const uint8_t *q, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0x0F) | (q[j - 4] >> 6) << 4);
        *m = (uint8_t)((q[j + 4] >> 4) | (q[j] >> 6) << 4);
    }
}

/* Q4_K rows [N][K/256 super-blocks] -> the panel layout in the header comment. */
static void vn_pack_q4_k(const uint8_t *raw, int64_t N, int64_t K, uint8_t *out) {
    int64_t nsuper = K / 256, panels = (N + 15) / 16;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        for (int64_t sb = 0; sb < nsuper; sb++) {
            uint8_t *r = out + (p * nsuper + sb) * VN_Q4K_SUPER;
            memset(r, 0, VN_Q4K_SUPER);
            for (int c = 0; c < 16 && 16 * p + c < N; c++) {
                const uint8_t *b = raw + ((16 * p + c) * nsuper + sb) * 144;
                memcpy(r + 2 * c, b, 2);           /* d */
                memcpy(r + 32 + 2 * c, b + 2, 2);  /* dmin */
                for (int blk = 0; blk < 8; blk++) {
                    uint8_t *rec = r + 64 + blk * VN_Q4K_RECORD;
                    for (int l = 0; l < 4; l++)
                        for (int t = 0; t < 4; t++)
                            rec[l * 64 + c * 4 + t] = (uint8_t)(vn_q4k_code(b, 32 * blk + 4 * l + t) |
                                                                vn_q4k_code(b, 32 * blk + 4 * (l + 4) + t) << 4);
                    vn_q4k_scale_min(b + 4, blk, rec + 256 + c, rec + 272 + c);
                }
            }
        }
    }
}

/* The code of column n, value k (0..K-1) of raw ggml rows: unsigned, as the layout stores it. */
static inline uint8_t vn_code(int qtype, const uint8_t *raw, int64_t nblocks, int64_t n, int64_t k) {
    const uint8_t *b = raw + (n * nblocks + k / 32) * pd_block_bytes(qtype);
    int j = (int)(k % 32);
    if (qtype == PD_Q8_0) return (uint8_t)((int)(int8_t)b[2 + j] + 128);
    const uint8_t *qs = b + (qtype == PD_Q4_1 ? 4 : 2);
    return j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4;
}

/* raw ggml rows [N][K/32 blocks] -> the panel layout above (pd_vnni_packed_size bytes). */
int pd_vnni_pack(int qtype, const uint8_t *raw, int64_t N, int64_t K, uint8_t *out) {
    if (!vn_takes(qtype, K)) return PD_EINVAL;
    if (qtype == PD_Q4_K) {
        vn_pack_q4_k(raw, N, K, out);
        return PD_OK;
    }
    int bb = pd_block_bytes(qtype);
    int64_t nblocks = K / 32, panels = (N + 15) / 16, rec = vn_record_bytes(qtype), cb = vn_code_bytes(qtype);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        for (int64_t blk = 0; blk < nblocks; blk++) {
            uint8_t *r = out + (p * nblocks + blk) * rec;
            memset(r, 0, (size_t)rec);
            for (int c = 0; c < 16; c++) {
                int64_t n = 16 * p + c;
                if (n >= N) break;
                for (int t = 0; t < 4; t++) {
                    if (qtype == PD_Q8_0) {
                        for (int l = 0; l < 8; l++) r[l * 64 + c * 4 + t] = vn_code(qtype, raw, nblocks, n, 32 * blk + 4 * l + t);
                    } else {
                        for (int l = 0; l < 4; l++)
                            r[l * 64 + c * 4 + t] = (uint8_t)(vn_code(qtype, raw, nblocks, n, 32 * blk + 4 * l + t) |
                                                              vn_code(qtype, raw, nblocks, n, 32 * blk + 4 * (l + 4) + t) << 4);
                    }
                }
                const uint8_t *b = raw + (n * nblocks + blk) * bb;
                memcpy(r + cb + 2 * c, b, 2); /* d */
                if (qtype == PD_Q4_1) memcpy(r + cb + 32 + 2 * c, b + 2, 2); /* m */
            }
        }
    }
    return PD_OK;
}

#if PD_VNNI
/* One row's blocks as int8 xh, xl [K] each, a float scale s per block, the block's float32
 * sum (Q4_1's offset term) and offset * sum(X) (Q4_0 / Q8_0's, taken off the int32 dot). */
static inline __attribute__((always_inline)) void vn_quantize_row(int x8, const float *x, int64_t K, int offset,
                                                                   int8_t *xh, int8_t *xl, float *s, float *xsum,
                                                                   int32_t *xoff) {
    const float top = x8 ? 127.0f : 8191.0f;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512i low7 = _mm512_set1_epi32(127);
    for (int64_t blk = 0; blk < K / 32; blk++) {
        __m512 a = _mm512_loadu_ps(x + 32 * blk), b = _mm512_loadu_ps(x + 32 * blk + 16);
        __mmask16 bad = _mm512_fpclass_ps_mask(a, 0x99) | _mm512_fpclass_ps_mask(b, 0x99); /* NaN, +-inf */
        float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
        xsum[blk] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        float inv = mx > 0.0f ? top / mx : 0.0f;
        s[blk] = bad ? NAN : mx / top;
        __m512 vinv = _mm512_set1_ps(bad ? 0.0f : inv);
        __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, vinv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, vinv));
        xoff[blk] = offset * _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
        if (x8) {
            _mm_storeu_si128((__m128i *)(xh + 32 * blk), _mm512_cvtepi32_epi8(qa));
            _mm_storeu_si128((__m128i *)(xh + 32 * blk + 16), _mm512_cvtepi32_epi8(qb));
            continue;
        }
        _mm_storeu_si128((__m128i *)(xh + 32 * blk), _mm512_cvtepi32_epi8(_mm512_srai_epi32(qa, 7)));
        _mm_storeu_si128((__m128i *)(xh + 32 * blk + 16), _mm512_cvtepi32_epi8(_mm512_srai_epi32(qb, 7)));
        _mm_storeu_si128((__m128i *)(xl + 32 * blk), _mm512_cvtepi32_epi8(_mm512_and_si512(qa, low7)));
        _mm_storeu_si128((__m128i *)(xl + 32 * blk + 16), _mm512_cvtepi32_epi8(_mm512_and_si512(qb, low7)));
    }
}

/* Scratch per activation row: xh, xl (K each), then per block s, xsum, xoff. */
static inline int64_t vn_row_bytes(int x8, int64_t K) { return (x8 ? K : 2 * K) + 12 * (K / 32); }

/* y[m0 .. m0 + mr, columns 16 p ..] for one panel; qtype, x8 and mr are constants at every
 * call site, so the 3 mr accumulators (2 mr with x8) stay in registers. */
static inline __attribute__((always_inline)) void vn_block(int qtype, int x8, int mr, const uint8_t *panel,
                                                           int64_t nblocks, const uint8_t *xq, int64_t K, int64_t m0,
                                                           int64_t c0, __mmask16 mask, float *y, int64_t ldy) {
    const int64_t rb = vn_row_bytes(x8, K), xb = x8 ? K : 2 * K;
    const int64_t rec = vn_record_bytes(qtype), cb = vn_code_bytes(qtype);
    const __m512i nib = _mm512_set1_epi8(0x0F);
    __m512 acc[VN_MR_MAX];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < nblocks; blk++) {
        const uint8_t *super = qtype == PD_Q4_K ? panel + blk / 8 * VN_Q4K_SUPER : panel; /* Q4_K: d, dmin, records */
        const uint8_t *r = qtype == PD_Q4_K ? super + 64 + blk % 8 * VN_Q4K_RECORD : panel + blk * rec;
        __m512i ih[VN_MR_MAX], il[VN_MR_MAX];
        for (int i = 0; i < mr; i++) ih[i] = il[i] = _mm512_setzero_si512();
        for (int l = 0; l < (qtype == PD_Q8_0 ? 8 : 4); l++) {
            __m512i v = _mm512_loadu_si512((const void *)(r + 64 * l)), w0, w1 = v;
            if (qtype == PD_Q8_0) {
                w0 = v;
            } else {
                w0 = _mm512_and_si512(v, nib);
                w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
            }
            for (int i = 0; i < mr; i++) {
                const int8_t *xh = (const int8_t *)(xq + (m0 + i) * rb), *xl = xh + K;
                int64_t k0 = 32 * blk + 4 * l;
                ih[i] = _mm512_dpbusd_epi32(ih[i], w0, _mm512_set1_epi32(*(const int32_t *)(xh + k0)));
                if (!x8) il[i] = _mm512_dpbusd_epi32(il[i], w0, _mm512_set1_epi32(*(const int32_t *)(xl + k0)));
                if (qtype != PD_Q8_0) {
                    ih[i] = _mm512_dpbusd_epi32(ih[i], w1, _mm512_set1_epi32(*(const int32_t *)(xh + k0 + 16)));
                    if (!x8)
                        il[i] = _mm512_dpbusd_epi32(il[i], w1, _mm512_set1_epi32(*(const int32_t *)(xl + k0 + 16)));
                }
            }
        }
        __m512 d, mv = _mm512_setzero_ps();
        if (qtype == PD_Q4_K) {
            __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r + 256))));
            __m512 m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r + 272))));
            __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(super + 32)));
            d = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)super)), sc);
            mv = _mm512_sub_ps(mv, _mm512_mul_ps(dmin, m)); /* -dmin * m */
        } else {
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r + cb)));
            if (qtype == PD_Q4_1) mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r + cb + 32)));
        }
        for (int i = 0; i < mr; i++) {
            const uint8_t *row = xq + (m0 + i) * rb + xb;
            const float *s = (const float *)row, *xsum = s + nblocks;
            const int32_t *xoff = (const int32_t *)(xsum + nblocks);
            __m512i dotq = x8 ? ih[i] : _mm512_add_epi32(_mm512_slli_epi32(ih[i], 7), il[i]);
            if (!vn_has_min(qtype)) dotq = _mm512_sub_epi32(dotq, _mm512_set1_epi32(xoff[blk]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dotq), _mm512_mul_ps(d, _mm512_set1_ps(s[blk])), acc[i]);
            if (vn_has_min(qtype)) acc[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[blk]), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) _mm512_mask_storeu_ps(y + (m0 + i) * ldy + c0, mask, acc[i]);
}

#define VN_CALL(q, x8, r) vn_block(q, x8, r, panel, nblocks, xq, K, m0, c0, mask, y, ldy)
#define VN_ROWS(q, x8)                                                               \
    switch (mr) {                                                                    \
    case VN_MR8: if (x8) VN_CALL(q, x8, VN_MR8); break; /* int8 terms only */    \
    case 8: VN_CALL(q, x8, 8); break;                                                \
    case 4: VN_CALL(q, x8, 4); break;                                                \
    case 2: VN_CALL(q, x8, 2); break;                                                \
    default: VN_CALL(q, x8, 1); break;                                               \
    }
#define VN_TYPES(x8)                                                                 \
    if (qtype == PD_Q4_0) {                                                          \
        VN_ROWS(PD_Q4_0, x8)                                                         \
    } else if (qtype == PD_Q4_1) {                                                   \
        VN_ROWS(PD_Q4_1, x8)                                                         \
    } else if (qtype == PD_Q4_K) {                                                   \
        VN_ROWS(PD_Q4_K, x8)                                                         \
    } else {                                                                         \
        VN_ROWS(PD_Q8_0, x8)                                                         \
    }
#endif

#if PD_VNNI2
static inline float vn2_hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float vn2_hsum(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

static inline int32_t vn2_hsum_i32(__m256i v) {
    __m128i m = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(m, _mm_shuffle_epi32(m, 0xB1)));
}

/* 32 int32 values (each in int8 range) -> 32 bytes in order */
static inline void vn2_store_i8(int8_t *dst, __m256i a, __m256i b, __m256i c, __m256i d) {
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    _mm256_storeu_si256((__m256i *)dst, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* vn_quantize_row for the AVX2 form: the same s and xsum; split rows as xh = X >> 7 and
 * xl = X & 127 (also int8 ones against Q8_0, X in [-127, 127]: xh is then -1 or 0), else
 * X itself in xh; xoff is what the kernel's int32 dot holds beyond sum(value codes * X):
 * Q4_0's 8 * sum(X), Q8_0's 16384 * sum(xh) (the header's last paragraph). */
static void vn2_quantize_row(int x8, int split, int qtype, const float *x, int64_t K, int8_t *xh, int8_t *xl,
                             float *s, float *xsum, int32_t *xoff) {
    const float top = x8 ? 127.0f : 8191.0f;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i low7 = _mm256_set1_epi32(127);
    for (int64_t blk = 0; blk < K / 32; blk++) {
        __m256 v[4], mx = _mm256_setzero_ps(), sum = _mm256_setzero_ps(), inf_nan = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(x + 32 * blk + 8 * j);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
            sum = _mm256_add_ps(sum, v[j]);
            __m256 z = _mm256_sub_ps(v[j], v[j]); /* NaN exactly where v is NaN or infinite */
            inf_nan = _mm256_or_ps(inf_nan, _mm256_cmp_ps(z, z, _CMP_UNORD_Q));
        }
        int bad = _mm256_movemask_ps(inf_nan) != 0;
        float amax = vn2_hmax(mx);
        xsum[blk] = vn2_hsum(sum);
        float inv = amax > 0.0f ? top / amax : 0.0f;
        s[blk] = bad ? NAN : amax / top;
        __m256 vinv = _mm256_set1_ps(bad ? 0.0f : inv);
        __m256i q[4], hi[4], lo[4], qsum = _mm256_setzero_si256(), hsum = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vinv));
            hi[j] = _mm256_srai_epi32(q[j], 7);
            lo[j] = _mm256_and_si256(q[j], low7);
            qsum = _mm256_add_epi32(qsum, q[j]);
            hsum = _mm256_add_epi32(hsum, hi[j]);
        }
        xoff[blk] = qtype == PD_Q4_0 ? 8 * vn2_hsum_i32(qsum) : qtype == PD_Q8_0 ? 16384 * vn2_hsum_i32(hsum) : 0;
        if (split) {
            vn2_store_i8(xh + 32 * blk, hi[0], hi[1], hi[2], hi[3]);
            vn2_store_i8(xl + 32 * blk, lo[0], lo[1], lo[2], lo[3]);
        } else {
            vn2_store_i8(xh + 32 * blk, q[0], q[1], q[2], q[3]);
        }
    }
}

/* Scratch per activation row of the AVX2 form: xh (and xl when split), then s, xsum, xoff. */
static inline int64_t vn2_row_bytes(int split, int64_t K) { return (split ? 2 * K : K) + 12 * (K / 32); }

static inline __m256i vn2_bcast(const int8_t *p) { return _mm256_set1_epi32(*(const int32_t *)p); }

/* y[m0 .. m0 + mr, columns 8 h .. 8 h + 7 of the panel] in the AVX2 form (one 256-bit half
 * of each 64-byte code vector); qtype, split and mr are constants at every call site. */
static inline __attribute__((always_inline)) void vn2_block(int qtype, int split, int mr, const uint8_t *panel,
                                                            int64_t nblocks, const uint8_t *xq, int64_t K, int64_t m0,
                                                            int h, int cols, float *y, int64_t ldy, int64_t c0) {
    const int64_t rb = vn2_row_bytes(split, K), xb = split ? 2 * K : K;
    const int64_t rec = vn_record_bytes(qtype), cb = vn_code_bytes(qtype);
    const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[VN2_MR];
    for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < nblocks; blk++) {
        const uint8_t *super = qtype == PD_Q4_K ? panel + blk / 8 * VN_Q4K_SUPER : panel;
        const uint8_t *r = qtype == PD_Q4_K ? super + 64 + blk % 8 * VN_Q4K_RECORD : panel + blk * rec;
        __m256i ih[VN2_MR], il[VN2_MR];
        for (int i = 0; i < mr; i++) ih[i] = il[i] = _mm256_setzero_si256();
        if (qtype == PD_Q8_0) {
            /* codes c = q + 128: c * xh (|c * xh| pairs <= 32640) and xl * q (<= 32512) fit the
             * int16 pair sums of maddubs, each widened to int32 at once */
            for (int l = 0; l < 8; l++) {
                __m256i c = _mm256_loadu_si256((const __m256i *)(r + 64 * l + 32 * h)), q = _mm256_xor_si256(c, flip);
                for (int i = 0; i < mr; i++) {
                    const int8_t *xh = (const int8_t *)(xq + (m0 + i) * rb), *xl = xh + K;
                    int64_t k0 = 32 * blk + 4 * l;
#if PD_VNNI2_DOT
                    ih[i] = _mm256_dpbusd_avx_epi32(ih[i], c, vn2_bcast(xh + k0));
                    il[i] = _mm256_dpbusd_avx_epi32(il[i], vn2_bcast(xl + k0), q);
#else
                    __m256i hi = _mm256_maddubs_epi16(c, vn2_bcast(xh + k0));
                    __m256i lo = _mm256_maddubs_epi16(vn2_bcast(xl + k0), q);
                    ih[i] = _mm256_add_epi32(ih[i], _mm256_madd_epi16(hi, ones));
                    il[i] = _mm256_add_epi32(il[i], _mm256_madd_epi16(lo, ones));
#endif
                }
            }
            for (int i = 0; i < mr; i++) ih[i] = _mm256_add_epi32(_mm256_slli_epi32(ih[i], 7), il[i]);
        } else {
            /* 4-bit codes: a block's eight products per lane pair stay within int16
             * (15 * 127 * 2 * 8 = 30480), widened once per block */
            for (int l = 0; l < 4; l++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(r + 64 * l + 32 * h));
                __m256i w0 = _mm256_and_si256(v, nib), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
                for (int i = 0; i < mr; i++) {
                    const int8_t *xh = (const int8_t *)(xq + (m0 + i) * rb), *xl = xh + K;
                    int64_t k0 = 32 * blk + 4 * l;
#if PD_VNNI2_DOT
                    ih[i] = _mm256_dpbusd_avx_epi32(ih[i], w0, vn2_bcast(xh + k0));
                    ih[i] = _mm256_dpbusd_avx_epi32(ih[i], w1, vn2_bcast(xh + k0 + 16));
                    if (split) {
                        il[i] = _mm256_dpbusd_avx_epi32(il[i], w0, vn2_bcast(xl + k0));
                        il[i] = _mm256_dpbusd_avx_epi32(il[i], w1, vn2_bcast(xl + k0 + 16));
                    }
#else
                    ih[i] = _mm256_add_epi16(ih[i], _mm256_maddubs_epi16(w0, vn2_bcast(xh + k0)));
                    ih[i] = _mm256_add_epi16(ih[i], _mm256_maddubs_epi16(w1, vn2_bcast(xh + k0 + 16)));
                    if (split) {
                        il[i] = _mm256_add_epi16(il[i], _mm256_maddubs_epi16(w0, vn2_bcast(xl + k0)));
                        il[i] = _mm256_add_epi16(il[i], _mm256_maddubs_epi16(w1, vn2_bcast(xl + k0 + 16)));
                    }
#endif
                }
            }
            for (int i = 0; i < mr; i++) {
#if PD_VNNI2_DOT
                if (split) ih[i] = _mm256_add_epi32(_mm256_slli_epi32(ih[i], 7), il[i]);
#else
                ih[i] = _mm256_madd_epi16(ih[i], split ? _mm256_set1_epi16(128) : ones);
                if (split) ih[i] = _mm256_add_epi32(ih[i], _mm256_madd_epi16(il[i], ones));
#endif
            }
        }
        __m256 d, mv = _mm256_setzero_ps();
        if (qtype == PD_Q4_K) {
            __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(r + 256 + 8 * h))));
            __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(r + 272 + 8 * h))));
            __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(super + 32 + 16 * h)));
            d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(super + 16 * h))), sc);
            mv = _mm256_sub_ps(mv, _mm256_mul_ps(dmin, m));
        } else {
            d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r + cb + 16 * h)));
            if (qtype == PD_Q4_1) mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r + cb + 32 + 16 * h)));
        }
        for (int i = 0; i < mr; i++) {
            const float *s = (const float *)(xq + (m0 + i) * rb + xb), *xsum = s + nblocks;
            const int32_t *xoff = (const int32_t *)(xsum + nblocks);
            __m256i dotq = ih[i];
            if (!vn_has_min(qtype)) dotq = _mm256_sub_epi32(dotq, _mm256_set1_epi32(xoff[blk]));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dotq), _mm256_mul_ps(d, _mm256_set1_ps(s[blk])), acc[i]);
            if (vn_has_min(qtype)) acc[i] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xsum[blk]), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) {
        float *dst = y + (m0 + i) * ldy + c0 + 8 * h;
        if (cols >= 8) {
            _mm256_storeu_ps(dst, acc[i]);
        } else {
            float part[8];
            _mm256_storeu_ps(part, acc[i]);
            memcpy(dst, part, (size_t)cols * sizeof(float));
        }
    }
}

#define VN2_CALL(q, sp, r) vn2_block(q, sp, r, panel, nblocks, xq, K, m0, h, cols, y, ldy, c0)
#define VN2_ROWS(q, sp)                                                              \
    switch (mr) {                                                                    \
    case 4: VN2_CALL(q, sp, 4); break;                                               \
    case 2: VN2_CALL(q, sp, 2); break;                                               \
    default: VN2_CALL(q, sp, 1); break;                                              \
    }

/* pd_vnni_linear's AVX2 form (the header's AVX2 paragraph). */
static int vn2_linear(int qtype, int x8, const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *wp,
                      int64_t N, float *y, int64_t ldy) {
    int split = !x8 || qtype == PD_Q8_0;
    int64_t nblocks = K / 32, rb = vn2_row_bytes(split, K), panels = (N + 15) / 16, pbytes = vn_panel_bytes(qtype, K);
    uint8_t *xq = (uint8_t *)aligned_alloc(64, (size_t)((M * rb + 63) / 64 * 64));
    if (xq == NULL) return PD_ENOMEM;
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) {
        int8_t *row = (int8_t *)(xq + m * rb);
        float *s = (float *)(row + (split ? 2 * K : K));
        vn2_quantize_row(x8, split, qtype, x + m * ldx, K, row, row + K, s, s + nblocks, (int32_t *)(s + 2 * nblocks));
    }
    /* a thread takes a panel's 8-column half: twice the work items of whole panels */
#pragma omp parallel for schedule(static) if (M * N * K >= 262144)
    for (int64_t ph = 0; ph < 2 * panels; ph++) {
        int64_t p = ph / 2, c0 = 16 * p;
        int h = (int)(ph % 2);
        int64_t cols64 = N - c0 - 8 * h;
        if (cols64 <= 0) continue;
        int cols = cols64 < 8 ? (int)cols64 : 8;
        const uint8_t *panel = wp + p * pbytes;
        for (int64_t m0 = 0, mr; m0 < M; m0 += mr) {
            int64_t left = M - m0;
            mr = left >= 4 ? 4 : left >= 2 ? 2 : 1;
            if (qtype == PD_Q4_0) {
                if (split) { VN2_ROWS(PD_Q4_0, 1) } else { VN2_ROWS(PD_Q4_0, 0) }
            } else if (qtype == PD_Q4_1) {
                if (split) { VN2_ROWS(PD_Q4_1, 1) } else { VN2_ROWS(PD_Q4_1, 0) }
            } else if (qtype == PD_Q4_K) {
                if (split) { VN2_ROWS(PD_Q4_K, 1) } else { VN2_ROWS(PD_Q4_K, 0) }
            } else {
                VN2_ROWS(PD_Q8_0, 1)
            }
        }
    }
    free(xq);
    return PD_OK;
}
#endif

#if PD_VNNI
static int vn512_linear(int qtype, int x8, const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *wp,
                        int64_t N, float *y, int64_t ldy) {
    int64_t nblocks = K / 32, rb = vn_row_bytes(x8, K), panels = (N + 15) / 16, pbytes = vn_panel_bytes(qtype, K);
    int block_rows = x8 ? VN_MR8 : VN_MR;
    uint8_t *xq = (uint8_t *)aligned_alloc(64, (size_t)((M * rb + 63) / 64 * 64));
    if (xq == NULL) return PD_ENOMEM;
    int offset = qtype == PD_Q4_0 ? 8 : qtype == PD_Q8_0 ? 128 : 0;
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) {
        uint8_t *row = xq + m * rb;
        float *s = (float *)(row + (x8 ? K : 2 * K));
        if (x8)
            vn_quantize_row(1, x + m * ldx, K, offset, (int8_t *)row, NULL, s, s + nblocks,
                            (int32_t *)(s + 2 * nblocks));
        else
            vn_quantize_row(0, x + m * ldx, K, offset, (int8_t *)row, (int8_t *)row + K, s, s + nblocks,
                            (int32_t *)(s + 2 * nblocks));
    }
#pragma omp parallel for schedule(static) if (M * N * K >= 262144)
    for (int64_t p = 0; p < panels; p++) {
        const uint8_t *panel = wp + p * pbytes;
        int64_t c0 = 16 * p, cols = N - c0 < 16 ? N - c0 : 16;
        __mmask16 mask = (__mmask16)((1u << cols) - 1u);
        /* rows in blocks of block_rows, then 8, 4, 2, 1 (7 rows: 4 + 2 + 1): the few block
         * sizes keep the build small, and a block re-reads the panel from L1 */
        for (int64_t m0 = 0, mr; m0 < M; m0 += mr) {
            int64_t left = M - m0;
            mr = left >= block_rows ? block_rows : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            if (x8) {
                VN_TYPES(1)
            } else {
                VN_TYPES(0)
            }
        }
    }
    free(xq);
    return PD_OK;
}
#endif

/* y[M, N] (row stride ldy) = x[M, K] (float32, row stride ldx) @ W^T, W from pd_vnni_pack,
 * in this build's form (pd_has_vnni). flags: PD_VNNI_INT8, activations rounded to int8 per
 * block (the header's int8 paragraph), else to 14-bit integers. PD_EINVAL for a type or K it
 * does not take or a build with neither form; PD_ENOMEM when the activations' scratch cannot
 * be allocated. */
int pd_vnni_linear(int qtype, int flags, const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *wp,
                   int64_t N, float *y, int64_t ldy) {
    if (!vn_takes(qtype, K) || !pd_has_vnni()) return PD_EINVAL;
    if (M <= 0 || N <= 0) return PD_OK;
    int x8 = (flags & PD_VNNI_INT8) != 0;
#if PD_VNNI
    return vn512_linear(qtype, x8, x, ldx, M, K, wp, N, y, ldy);
#elif PD_VNNI2
    return vn2_linear(qtype, x8, x, ldx, M, K, wp, N, y, ldy);
#else
    (void)x8, (void)x, (void)ldx, (void)wp, (void)y, (void)ldy;
    return PD_EINVAL;
#endif
}
