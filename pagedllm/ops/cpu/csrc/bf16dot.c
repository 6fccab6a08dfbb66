/* A bf16 linear on AVX512-BF16 dot products (VDPBF16PS), for CPUs that multiply bf16 in
 * hardware but have no AMX tiles: AMD Zen 4 / Zen 5, Intel Cooper Lake.
 *
 * Why our own and not oneDNN's packed bf16 linear (which dense.py used on these CPUs): on
 * a 2-core Zen 4, oneDNN took SmolLM2's shapes at 32 rows at 210-340 GFLOP/s against the
 * ~460 these instructions reach, and it takes and returns bf16, so a float32 model paid a
 * conversion op each way and a bf16 rounding of every output. This kernel reads float32
 * activations (rounded to bf16 once, nearest even, as torch does), sums in float32 and
 * writes float32 outputs (+ bias) unrounded, like the AMX kernel.
 *
 * Weight layout: amx.c's tiles (pd_amx_pack). The 16-column strip nb is one stream of
 * bf16 pairs, [Kp / 2][16 columns][2], so one 512-bit load is the operand VDPBF16PS
 * wants for a k pair, and a row's k pair is one 32-bit broadcast.
 * Work: the columns are cut into chunks of three strips (48 columns), shared among the
 * threads; for each chunk every 8 rows of x keep an 8 x 48 block of y in 24 registers
 * while k runs over all of K (the chunk's strips, 96 bytes per k, stay in L2 across the
 * row blocks). Sums follow k in order, two products at a time, so results differ from a
 * float32 GEMM on the bf16-rounded inputs only in float32 rounding order.
 * pd_bf16dot_linear_silu is the gated MLP's gate/up layer in one pass (amx.c's contract):
 * silu(gate) * up applied to the sums in registers, the [M, N] product never written. */
#include "pd_kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PD_BF16DOT 1
#else
#define PD_BF16DOT 0
#endif

#define BD_MR 8      /* rows of y per register block */
#define BD_STRIPS 3  /* 16-column strips per register block */
#define BD_TILE 512  /* bf16 per amx.c tile (16 k pairs x 16 columns x 2) */

#if PD_BF16DOT
/* y rows m0..m0+MR, strips nb..nb+NS (columns n0 = 16 nb ..): mr and ns are constants at
 * every call site, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void bd_block(int mr, int ns, const uint16_t *xa, int64_t Kp,
                                                           const uint16_t *b, int64_t strip, int64_t m0,
                                                           int64_t n0, int64_t N, const float *bias, void *y,
                                                           int y_bf16, int64_t ldy, const char *pf, int64_t npf) {
    __m512 acc[BD_MR][BD_STRIPS];
    for (int i = 0; i < mr; i++)
        for (int s = 0; s < ns; s++) acc[i][s] = _mm512_setzero_ps();
    const int32_t *xr = (const int32_t *)(xa + m0 * Kp);
    int64_t pairs = Kp / 2; /* k pairs, also x's row stride in 32-bit pairs */
    for (int64_t p = 0; p < pairs; p++) {
        if (p < npf) _mm_prefetch(pf + 64 * p, _MM_HINT_T1);
        __m512bh w[BD_STRIPS];
        for (int s = 0; s < ns; s++) w[s] = (__m512bh)_mm512_loadu_si512((const void *)(b + s * strip + p * 32));
        for (int i = 0; i < mr; i++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32(xr[i * pairs + p]);
            for (int s = 0; s < ns; s++) acc[i][s] = _mm512_dpbf16_ps(acc[i][s], xv, w[s]);
        }
    }
    for (int s = 0; s < ns; s++) {
        int64_t c0 = n0 + 16 * s, cols = N - c0 < 16 ? N - c0 : 16;
        __mmask16 mask = (__mmask16)((1u << cols) - 1u);
        __m512 bv = bias != NULL ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++) {
            __m512 v = _mm512_add_ps(acc[i][s], bv);
            if (y_bf16)
                _mm256_mask_storeu_epi16((uint16_t *)y + (m0 + i) * ldy + c0, mask, (__m256i)_mm512_cvtneps_pbh(v));
            else
                _mm512_mask_storeu_ps((float *)y + (m0 + i) * ldy + c0, mask, v);
        }
    }
}

/* A gated block (pd_bf16dot_linear_silu): rows m0..m0+mr of gate strip g and the up strip
 * of the same columns (g + up), written as silu(gate) * up to the 16 columns of y from n0.
 * The sums run as bd_block's do, so the result equals pd_bf16dot_linear then pd_silu_mul. */
static inline __attribute__((always_inline)) void bd_gated_block(int mr, const uint16_t *xa, int64_t Kp,
                                                                 const uint16_t *g, int64_t up, int64_t m0,
                                                                 int64_t n0, int64_t half, const float *bias,
                                                                 float *y, int64_t ldy) {
    __m512 gacc[BD_MR], uacc[BD_MR];
    for (int i = 0; i < mr; i++) gacc[i] = uacc[i] = _mm512_setzero_ps();
    const int32_t *xr = (const int32_t *)(xa + m0 * Kp);
    int64_t pairs = Kp / 2;
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh wg = (__m512bh)_mm512_loadu_si512((const void *)(g + p * 32));
        __m512bh wu = (__m512bh)_mm512_loadu_si512((const void *)(g + up + p * 32));
        for (int i = 0; i < mr; i++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32(xr[i * pairs + p]);
            gacc[i] = _mm512_dpbf16_ps(gacc[i], xv, wg);
            uacc[i] = _mm512_dpbf16_ps(uacc[i], xv, wu);
        }
    }
    __m512 gb = bias != NULL ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    __m512 ub = bias != NULL ? _mm512_loadu_ps(bias + half + n0) : _mm512_setzero_ps();
    for (int i = 0; i < mr; i++) {
        __m512 silu_up = silu_mul_avx512(_mm512_add_ps(gacc[i], gb), _mm512_add_ps(uacc[i], ub));
        _mm512_storeu_ps(y + (m0 + i) * ldy + n0, silu_up);
    }
}

#define BD_ROWS(ns)                                                                                     \
    switch (mr) {                                                                                       \
    case 8: bd_block(8, ns, xa, Kp, b, strip, m0, n0, N, bias, y, y_bf16, ldy, pf, npf); break;                  \
    case 7: bd_block(7, ns, xa, Kp, b, strip, m0, n0, N, bias, y, y_bf16, ldy, pf, npf); break;                  \
    case 6: bd_block(6, ns, xa, Kp, b, strip, m0, n0, N, bias, y, y_bf16, ldy, pf, npf); break;                  \
    case 5: bd_block(5, ns, xa, Kp, b, strip, m0, n0, N, bias, y, y_bf16, ldy, pf, npf); break;                  \
    case 4: bd_block(4, ns, xa, Kp, b, strip, m0, n0, N, bias, y, y_bf16, ldy, pf, npf); break;                  \
    case 3: bd_block(3, ns, xa, Kp, b, strip, m0, n0, N, bias, y, y_bf16, ldy, pf, npf); break;                  \
    case 2: bd_block(2, ns, xa, Kp, b, strip, m0, n0, N, bias, y, y_bf16, ldy, pf, npf); break;                  \
    default: bd_block(1, ns, xa, Kp, b, strip, m0, n0, N, bias, y, y_bf16, ldy, pf, npf); break;                 \
    }
#endif

int pd_has_bf16dot(void) { return PD_BF16DOT; }

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T (+ bias, float32), W from
 * pd_amx_pack; the same contract as pd_amx_linear. PD_EINVAL where this build has no
 * AVX512-BF16; PD_ENOMEM when the bf16 copy of x cannot be allocated. */
int pd_bf16dot_linear(const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, const uint16_t *wp,
                      int64_t N, const float *bias, void *y, int y_bf16, int64_t ldy) {
#if PD_BF16DOT
    if (M <= 0 || N <= 0) return PD_OK;
    int64_t Kp = (K + 31) / 32 * 32, NB = (N + 15) / 16, strip = Kp / 32 * BD_TILE;
    uint16_t *xa = (uint16_t *)aligned_alloc(64, (size_t)(M * Kp) * sizeof(uint16_t));
    if (xa == NULL) return PD_ENOMEM;
    pd_bf16_pack_x(x, x_bf16, ldx, M, K, M, Kp, xa);
    int64_t chunks = (NB + BD_STRIPS - 1) / BD_STRIPS;
#pragma omp parallel for schedule(static) if (M * N * K >= 262144)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t nb = c * BD_STRIPS, ns = NB - nb < BD_STRIPS ? NB - nb : BD_STRIPS, n0 = 16 * nb;
        const uint16_t *b = wp + nb * strip;
        /* the next chunk's strips follow this one's: fetch them into L2 while this one is
         * computed, a share per row block, one 64-byte line per k pair */
        const char *next = (const char *)(b + ns * strip);
        int64_t left = c + 1 < chunks ? (NB - nb - ns < BD_STRIPS ? NB - nb - ns : BD_STRIPS) * strip * 2 / 64 : 0;
        for (int64_t m0 = 0; m0 < M; m0 += BD_MR) {
            int mr = M - m0 < BD_MR ? (int)(M - m0) : BD_MR;
            int64_t npf = left < Kp / 2 ? left : Kp / 2;
            const char *pf = next;
            next += 64 * npf;
            left -= npf;
            if (ns == 3) {
                BD_ROWS(3)
            } else if (ns == 2) {
                BD_ROWS(2)
            } else {
                BD_ROWS(1)
            }
        }
    }
    free(xa);
    return PD_OK;
#else
    (void)x, (void)x_bf16, (void)ldx, (void)M, (void)K, (void)wp, (void)N, (void)bias, (void)y, (void)y_bf16;
    (void)ldy;
    return PD_EINVAL;
#endif
}

/* silu(g) * u for [g | u] = x @ W^T (+ bias): the contract of amx.c's pd_amx_linear_silu
 * (y float32 [M, N / 2], W stacking the gate's N / 2 rows over the up projection's), on
 * AVX512-BF16 dot products: blocks of 8 rows x a gate strip and the up strip of the same
 * columns (16 accumulators; 6 rows x two pairs measured no better on a Xeon's AVX512-BF16).
 * PD_EINVAL where this build has no AVX512-BF16 or N / 2 is not a multiple of 16. */
int pd_bf16dot_linear_silu(const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, const uint16_t *wp,
                           int64_t N, const float *bias, float *y, int64_t ldy) {
#if PD_BF16DOT
    if (N % 32 != 0) return PD_EINVAL;
    if (M <= 0 || N <= 0) return PD_OK;
    int64_t Kp = (K + 31) / 32 * 32, NBh = N / 32, strip = Kp / 32 * BD_TILE, half = N / 2, up = NBh * strip;
    uint16_t *xa = (uint16_t *)aligned_alloc(64, (size_t)(M * Kp) * sizeof(uint16_t));
    if (xa == NULL) return PD_ENOMEM;
    pd_bf16_pack_x(x, x_bf16, ldx, M, K, M, Kp, xa);
#pragma omp parallel for schedule(static) if (M * N * K >= 262144)
    for (int64_t nb = 0; nb < NBh; nb++) {
        const uint16_t *g = wp + nb * strip;
        for (int64_t m0 = 0; m0 < M; m0 += BD_MR) {
            switch (M - m0 < BD_MR ? (int)(M - m0) : BD_MR) {
            case 8: bd_gated_block(8, xa, Kp, g, up, m0, 16 * nb, half, bias, y, ldy); break;
            case 7: bd_gated_block(7, xa, Kp, g, up, m0, 16 * nb, half, bias, y, ldy); break;
            case 6: bd_gated_block(6, xa, Kp, g, up, m0, 16 * nb, half, bias, y, ldy); break;
            case 5: bd_gated_block(5, xa, Kp, g, up, m0, 16 * nb, half, bias, y, ldy); break;
            case 4: bd_gated_block(4, xa, Kp, g, up, m0, 16 * nb, half, bias, y, ldy); break;
            case 3: bd_gated_block(3, xa, Kp, g, up, m0, 16 * nb, half, bias, y, ldy); break;
            case 2: bd_gated_block(2, xa, Kp, g, up, m0, 16 * nb, half, bias, y, ldy); break;
            default: bd_gated_block(1, xa, Kp, g, up, m0, 16 * nb, half, bias, y, ldy); break;
            }
        }
    }
    free(xa);
    return PD_OK;
#else
    (void)x, (void)x_bf16, (void)ldx, (void)M, (void)K, (void)wp, (void)N, (void)bias, (void)y, (void)ldy;
    return PD_EINVAL;
#endif
}
