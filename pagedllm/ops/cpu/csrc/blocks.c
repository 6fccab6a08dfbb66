/* ggml blocks at load time: dense float32 copies of K-quant weights (pd_dequantize_k) and
 * the 32-value rewrites the native kernels read (pd_q4_k_as_q4_1, pd_as_q8_0).
 *
 * Why C: gguf_dequant.py and gguf_blocks32.py do the same with vectorized torch ops, a
 * handful of full-size temporaries per step; loading Qwen2.5-Coder-1.5B Q4_K_M spent ~12 s
 * of a ~20 s start-up on a 2-vCPU Xeon there. These loops write each output once.
 *
 * Numerics: value for value what the torch versions compute (the tests compare them
 * bitwise): the same float32 operations in the same order, each rounded once. This file
 * is compiled as ISO C (-std=c11), where GCC does not contract a * b - c into an FMA.
 *
 * Layouts (ggml-common.h; the torch versions say the same in tensor terms):
 *   Q4_K {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}             256 values, 144 bytes
 *   Q5_K {f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}  256 values, 176 bytes
 *   Q6_K {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}            256 values, 210 bytes
 * Q4_K / Q5_K: sub-block j (32 values) = d * sc_j * q - dmin * m_j, 6-bit sc_j and m_j; its
 * low 4 bits of q are nibbles of qs[32 * (j / 2) + t] (low for even j, high for odd), Q5_K's
 * fifth bit is bit j of qh[t]. Q6_K: half h, group g (0..3), value l (0..31) = d * sc *
 * (q - 32) with sc = scales[8h + 2g + l / 16], q's low 4 bits from ql[64h + 32(g & 1) + l]
 * (low nibble for g < 2), its high 2 bits from qh[32h + l] >> 2g.
 */
#include "pd_kernels.h"

/* float32 -> f16 bits, round to nearest even (as torch's .half()); finite inputs */
static inline uint16_t f16_bits(float f) {
#if PD_AVX2
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000, a = u & 0x7FFFFFFF;
    if (a > 0x7F800000) return (uint16_t)(sign | 0x7E00);    /* NaN */
    if (a >= 0x477FF000) return (uint16_t)(sign | 0x7C00);   /* rounds past 65504: infinity */
    if (a < 0x38800000) {                                     /* below f16's normal range */
        if (a < 0x33000000) return (uint16_t)sign;            /* under half the smallest subnormal */
        uint32_t man = (a & 0x7FFFFF) | 0x800000, shift = 126 - (a >> 23); /* value = q * 2^-24 */
        uint32_t q = man >> shift, rest = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        q += rest > half || (rest == half && (q & 1));
        return (uint16_t)(sign | q);
    }
    uint32_t r = a + 0xFFF + ((a >> 13) & 1) - 0x38000000;   /* rebias, round the 13 dropped bits */
    return (uint16_t)(sign | (r >> 13));
#endif
}

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static void dequant_k_block(int qtype, const uint8_t *b, float *y) {
    if (qtype == PD_Q6_K) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        float d = f16_to_f32(b + 208);
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 4; g++) {
                const uint8_t *lo = ql + 64 * h + 32 * (g & 1), *hi = qh + 32 * h;
                int lo_shift = g < 2 ? 0 : 4, hi_shift = 2 * g;
                for (int half = 0; half < 2; half++) { /* 16 values share a scale: a loop the compiler vectorizes */
                    float sc = (float)scales[8 * h + 2 * g + half] * d;
                    for (int l = 16 * half; l < 16 * half + 16; l++) {
                        int q = ((lo[l] >> lo_shift) & 0x0F) | (((hi[l] >> hi_shift) & 3) << 4);
                        y[128 * h + 32 * g + l] = (float)(q - 32) * sc;
                    }
                }
            }
        return;
    }
    float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
    const uint8_t *s = b + 4, *qh = b + 16, *qs = b + (qtype == PD_Q5_K ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        k_scale_min(s, j, &sc, &m);
        float scale = (float)sc * d, min = (float)m * dmin;
        const uint8_t *src = qs + 32 * (j / 2);
        for (int t = 0; t < 32; t++) {
            int q = j & 1 ? src[t] >> 4 : src[t] & 0x0F;
            if (qtype == PD_Q5_K) q |= ((qh[t] >> j) & 1) << 4;
            y[32 * j + t] = (float)q * scale - min;
        }
    }
}

/* nblocks super-blocks of Q4_K, Q5_K or Q6_K -> float32 [nblocks * 256] */
int pd_dequantize_k(int qtype, const uint8_t *raw, int64_t nblocks, float *out) {
    int64_t bytes = qtype == PD_Q4_K ? 144 : qtype == PD_Q5_K ? 176 : qtype == PD_Q6_K ? 210 : 0;
    if (bytes == 0) return PD_EINVAL;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < nblocks; i++) dequant_k_block(qtype, raw + i * bytes, out + i * 256);
    return PD_OK;
}

/* nblocks Q4_K super-blocks -> 8 * nblocks Q4_1 blocks {f16 d; f16 m; u8 qs[16]}: the codes
 * as they are (Q4_1 keeps value t in the low nibble of byte t, value t + 16 in its high
 * nibble), d = d * sc_j and m = -(dmin * m_j) rounded to f16 */
int pd_q4_k_as_q4_1(const uint8_t *raw, int64_t nblocks, uint8_t *out) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < nblocks; i++) {
        const uint8_t *b = raw + i * 144, *s = b + 4, *qs = b + 16;
        float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
        for (int j = 0; j < 8; j++) {
            uint8_t *o = out + (i * 8 + j) * 20;
            int sc, m;
            k_scale_min(s, j, &sc, &m);
            uint16_t hd = f16_bits((float)sc * d), hm = f16_bits(-((float)m * dmin));
            o[0] = (uint8_t)hd, o[1] = (uint8_t)(hd >> 8), o[2] = (uint8_t)hm, o[3] = (uint8_t)(hm >> 8);
            const uint8_t *src = qs + 32 * (j / 2);
            for (int t = 0; t < 16; t++) {
                int lo = j & 1 ? src[t] >> 4 : src[t] & 0x0F, hi = j & 1 ? src[t + 16] >> 4 : src[t + 16] & 0x0F;
                o[4 + t] = (uint8_t)(lo | (hi << 4));
            }
        }
    }
    return PD_OK;
}

/* float32 [nblocks * 32] -> nblocks Q8_0 blocks {f16 d; i8 qs[32]}: d = max |x| / 127
 * rounded up to f16, codes round(x * (1 / d)) (half to even) in [-127, 127].
 * PD_EINVAL where a block holds NaN or infinity, PD_ERANGE where d overflows f16 (the
 * caller names both); the output is then incomplete. */
int pd_as_q8_0(const float *x, int64_t nblocks, uint8_t *out) {
    int status = PD_OK;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < nblocks; i++) {
        const float *v = x + i * 32;
        float hi = v[0], lo = v[0];
        int finite = 1;
        for (int t = 0; t < 32; t++) {
            hi = v[t] > hi ? v[t] : hi, lo = v[t] < lo ? v[t] : lo;
            finite &= isfinite(v[t]) != 0;
        }
        float amax = hi > -lo ? hi : -lo;
        if (!finite) {
#pragma omp atomic write
            status = PD_EINVAL;
            continue;
        }
        float want = amax / 127.0f;
        uint16_t h = f16_bits(want);
        if (f16_from_bits(h) < want) h++; /* the next f16 up (want >= 0, so the bits count up) */
        float d = f16_from_bits(h);
        if (isinf(d)) {
#pragma omp atomic write
            status = PD_ERANGE;
            continue;
        }
        float inv = d > 0.0f ? 1.0f / d : 0.0f;
        uint8_t *o = out + i * 34;
        o[0] = (uint8_t)h, o[1] = (uint8_t)(h >> 8);
        for (int t = 0; t < 32; t++) {
            float q = nearbyintf(v[t] * inv);
            q = q < -127.0f ? -127.0f : q > 127.0f ? 127.0f : q;
            o[2 + t] = (uint8_t)(int8_t)q;
        }
    }
    return status;
}
