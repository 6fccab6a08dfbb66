/* A bf16 linear on Intel AMX tiles (pd_amx_pack, pd_amx_linear), built where the
 * compiler targets a CPU with AMX-BF16 (-march=native on Sapphire Rapids and later).
 * The packed layout is also what bf16dot.c's AVX512-BF16 kernel reads (a tile row is one
 * 512-bit register of 16 column pairs), so pd_amx_pack and the activation rounding are
 * built everywhere.
 *
 * Why our own and not oneDNN's (which torch ships and dense.py also uses): at decode
 * batch sizes (1-64 rows) a linear only streams its weight once, so it should run at
 * memory bandwidth, and oneDNN's brgemm reached 14 GB/s of weight on SmolLM2's shapes
 * at 32 rows on a 2-core Sapphire Rapids, a third of what the memory delivers. It also
 * takes and returns bf16, so a float32 model paid a conversion each way, an op each,
 * and a bf16 rounding of every output. This kernel reads float32 activations (rounded
 * to bf16 once, round-to-nearest-even like torch), multiplies bf16 x bf16 on the tiles
 * with float32 sums, and writes float32 outputs (+ bias) unrounded.
 *
 * Weight layout (pd_amx_pack): W [N, K] float32 -> bf16 tiles [ceil(N/16)][ceil(K/32)]
 * of 16 x 32 bf16, zero-padded: tile (nb, kb) row r holds, for n = 0..15, the pair
 * W[16nb + n][32kb + 2r], W[16nb + n][32kb + 2r + 1] (the "VNNI" pairing TDPBF16PS
 * reads), so the 16-column strip of blocks nb is one contiguous stream of 1 KiB tiles.
 * Work: each thread takes strips two at a time (32 columns) and, for every 32 rows of x
 * (in chunks of AMX_ROW_CHUNK rows), keeps a 32 x 32 block of y in four accumulator tiles
 * while k runs over the strips. pd_amx_linear_silu pairs each gate strip with the up strip
 * of the same columns instead and applies silu(gate) * up to the block's sums.
 * Sums follow k in order within a row, so results differ from a float32 GEMM on the
 * bf16-rounded inputs only by the order of float32 additions inside a 32-wide step.
 */
#define _GNU_SOURCE
#include "pd_kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__x86_64__)
#define PD_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define PD_AMX 0
#endif

#define AMX_TILE_BF16 512 /* bf16 per weight tile: 16 rows of 32 */
#define AMX_PREFETCH 4    /* weight tiles fetched ahead (2, 8 or 16, or into L2, measured no better) */
#define AMX_ROW_CHUNK 128 /* rows of x a thread's strips pass over before the next rows (64-256 alike) */

#if PD_AMX
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands a process the 8 KiB of tile state only when it asks (once per process). */
static int amx_permitted(void) {
    static int state = 0; /* 0 unknown, 1 granted, -1 refused */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

/* tiles 0-3: y blocks (rows 0-15 | 16-31) x (columns 0-15 | 16-31), float32;
 * 4-5: x rows 0-15 and 16-31 over 32 k; 6-7: the two weight strips' tiles */
static void amx_configure(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* One k step of a block: x tiles of rows a0 (and a1 when two_m) times weight tiles kb of
 * strips b0 (and b1 when two_n), summed into accumulator tiles 0-3. */
static inline __attribute__((always_inline)) void amx_kstep(int two_m, int two_n, const uint16_t *a0,
                                                            const uint16_t *a1, int64_t Kp, int64_t kb,
                                                            const uint16_t *b0, const uint16_t *b1) {
    _tile_loadd(4, a0 + kb * 32, Kp * 2);
    _tile_loadd(6, b0 + kb * AMX_TILE_BF16, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two_n) {
        _tile_loadd(7, b1 + kb * AMX_TILE_BF16, 64);
        _tile_dpbf16ps(1, 4, 7);
    }
    if (two_m) {
        _tile_loadd(5, a1 + kb * 32, Kp * 2);
        _tile_dpbf16ps(2, 5, 6);
        if (two_n) _tile_dpbf16ps(3, 5, 7);
    }
}

/* silu(gate) * up for the rows of a gated block (rows m0.., columns n0..n0+15 of y, of N / 2):
 * the gate sums in cbuf's first 16 columns, the up sums in its next 16, plus their bias
 * (gate columns of bias, then up columns from N / 2); the same arithmetic as pd_silu_mul, so
 * the fused result equals the linear followed by it. */
static inline void amx_gated_epilogue(int two_m, int64_t m0, int64_t M, int64_t n0, int64_t N, const float *bias,
                                      float *y, int64_t ldy, float *cbuf) {
    _tile_stored(0, cbuf, 128);
    _tile_stored(1, cbuf + 16, 128);
    if (two_m) {
        _tile_stored(2, cbuf + 512, 128);
        _tile_stored(3, cbuf + 512 + 16, 128);
    }
    int64_t rows = M - m0 < (two_m ? 32 : 16) ? M - m0 : (two_m ? 32 : 16);
    __m512 gate_bias = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    __m512 up_bias = bias ? _mm512_loadu_ps(bias + N / 2 + n0) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cbuf + (r < 16 ? r * 32 : 512 + (r - 16) * 32);
        __m512 g = _mm512_loadu_ps(c), u = _mm512_loadu_ps(c + 16);
        if (bias) g = _mm512_add_ps(g, gate_bias), u = _mm512_add_ps(u, up_bias);
        _mm512_storeu_ps(y + (m0 + r) * ldy + n0, silu_mul_avx512(g, u));
    }
}

/* A block's float32 sums in tiles 0-3 (rows m0.., 32 or 16 columns from n0) written to y with
 * bias, rows < M and columns < N only; a gated block (16 columns of silu(gate) * up) through
 * amx_gated_epilogue. */
static inline __attribute__((always_inline)) void amx_block_store(int two_m, int two_n, int gated, int64_t m0,
                                                                  int64_t M, int64_t n0, int64_t N,
                                                                  const float *bias, void *y, int y_bf16,
                                                                  int64_t ldy, float *cbuf) {
    if (gated) { /* tiles 0 and 2 hold gate sums, 1 and 3 the up sums of the same columns */
        amx_gated_epilogue(two_m, m0, M, n0, N, bias, (float *)y, ldy, cbuf);
        return;
    }
    if (two_m && two_n && bias == NULL && !y_bf16 && m0 + 32 <= M && n0 + 32 <= N) {
        /* a whole float32 block without bias: the tiles go straight to y */
        float *dst = (float *)y + m0 * ldy + n0;
        _tile_stored(0, dst, ldy * 4);
        _tile_stored(1, dst + 16, ldy * 4);
        _tile_stored(2, dst + 16 * ldy, ldy * 4);
        _tile_stored(3, dst + 16 * ldy + 16, ldy * 4);
        return;
    }
    _tile_stored(0, cbuf, 128);
    if (two_n) _tile_stored(1, cbuf + 16, 128);
    if (two_m) _tile_stored(2, cbuf + 512, 128);
    if (two_m && two_n) _tile_stored(3, cbuf + 512 + 16, 128);
    int64_t rows = M - m0 < (two_m ? 32 : 16) ? M - m0 : (two_m ? 32 : 16);
    int64_t cols = N - n0 < (two_n ? 32 : 16) ? N - n0 : (two_n ? 32 : 16);
    for (int64_t r = 0; r < rows; r++) {
        float *c = cbuf + (r < 16 ? r * 32 : 512 + (r - 16) * 32);
        if (bias != NULL)
            for (int64_t j = 0; j < cols; j++) c[j] += bias[n0 + j];
        if (y_bf16) {
            uint16_t *dst = (uint16_t *)y + (m0 + r) * ldy + n0;
            if (cols == 32) {
                _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c)));
                _mm256_storeu_si256((__m256i *)(dst + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c + 16)));
            } else {
                for (int64_t j = 0; j < cols; j++) dst[j] = pd_bf16_round(c[j]);
            }
        } else {
            float *dst = (float *)y + (m0 + r) * ldy + n0;
            if (cols == 32) {
                _mm512_storeu_ps(dst, _mm512_loadu_ps(c));
                _mm512_storeu_ps(dst + 16, _mm512_loadu_ps(c + 16));
            } else {
                memcpy(dst, c, (size_t)cols * sizeof(float));
            }
        }
    }
}

/* The 32 x 32 (or smaller: two_m / two_n false drop the second half) block of y at rows
 * m0.., strips b0 and b1, summed over KB k tiles; written to y with bias, rows < M and
 * columns < N only. */
static inline __attribute__((always_inline)) void amx_block(int two_m, int two_n, int fetch, int gated,
                                                            const uint16_t *xa, int64_t Kp, int64_t KB,
                                                            const uint16_t *b0, const uint16_t *b1, int64_t m0,
                                                            int64_t M, int64_t n0, int64_t N, const float *bias,
                                                            void *y, int y_bf16, int64_t ldy, float *cbuf) {
    _tile_zero(0);
    if (two_n) _tile_zero(1);
    if (two_m) _tile_zero(2);
    if (two_m && two_n) _tile_zero(3);
    const uint16_t *a0 = xa + m0 * Kp, *a1 = a0 + 16 * Kp;
    for (int64_t kb = 0; kb < KB; kb++) {
        /* the tile loads wait for memory (a tile register is not renamed, so the next
         * load cannot start before the product reading it ends): fetch ahead, for the
         * first row block of a chunk only (the later ones find the strips in cache) */
        if (fetch)
            for (int l = 0; l < 16; l++) {
                _mm_prefetch((const char *)(b0 + (kb + AMX_PREFETCH) * AMX_TILE_BF16) + 64 * l, _MM_HINT_T0);
                if (two_n) _mm_prefetch((const char *)(b1 + (kb + AMX_PREFETCH) * AMX_TILE_BF16) + 64 * l, _MM_HINT_T0);
            }
        amx_kstep(two_m, two_n, a0, a1, Kp, kb, b0, b1);
    }
    amx_block_store(two_m, two_n, gated, m0, M, n0, N, bias, y, y_bf16, ldy, cbuf);
}
#endif

/* rows [0, M) of x (row stride ldx; float32, or bf16 when x_bf16) -> bf16 [Mp][Kp],
 * zero-padded to the tile grid */
void pd_bf16_pack_x(const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, int64_t Mp, int64_t Kp,
                    uint16_t *xa) {
#pragma omp parallel for schedule(static) if (M * K >= 32768)
    for (int64_t i = 0; i < Mp; i++) {
        uint16_t *dst = xa + i * Kp;
        int64_t k = 0;
        if (i < M && x_bf16) {
            memcpy(dst, (const uint16_t *)x + i * ldx, (size_t)K * sizeof(uint16_t));
            k = K;
        } else if (i < M) {
            const float *src = (const float *)x + i * ldx;
            pd_bf16_round_row(src, dst, K);
            k = K;
        }
        for (; k < Kp; k++) dst[k] = 0;
    }
}

int pd_has_amx(void) {
#if PD_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

int64_t pd_amx_packed_size(int64_t N, int64_t K) { return (N + 15) / 16 * ((K + 31) / 32) * AMX_TILE_BF16; }

#if PD_AVX512
/* 16 floats -> their bf16 roundings (pd_bf16_round, lane for lane) in the low halves of 16 u32 lanes */
static inline __m512i bf16_round16(__m512 v) {
    __m512i u = _mm512_castps_si512(v), one = _mm512_set1_epi32(1);
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), _mm512_and_si512(_mm512_srli_epi32(u, 16), one)),
        16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

/* A whole tile (16 rows of w from `row`, its 32 columns from k0): each row rounded to 16
 * bf16 pairs (one u32 lane a pair), and the 16 x 16 pairs transposed in registers so
 * that tile row r holds pair r of every weight row. */
static inline void pack_tile_avx512(const float *w, int64_t K, int64_t row, int64_t k0, uint16_t *tile) {
    __m512 r[16];
    for (int n = 0; n < 16; n++) {
        const float *src = w + (row + n) * K + k0;
        __m256i lo = _mm512_cvtepi32_epi16(bf16_round16(_mm512_loadu_ps(src)));
        __m256i hi = _mm512_cvtepi32_epi16(bf16_round16(_mm512_loadu_ps(src + 16)));
        r[n] = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
    }
    transpose16_ps(r);
    for (int q = 0; q < 16; q++) _mm512_storeu_ps((float *)(tile + q * 32), r[q]);
}
#endif

void pd_amx_pack(const float *w, int64_t N, int64_t K, uint16_t *wp) {
    int64_t NB = (N + 15) / 16, KB = (K + 31) / 32;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < NB; nb++)
        for (int64_t kb = 0; kb < KB; kb++) {
            uint16_t *tile = wp + (nb * KB + kb) * AMX_TILE_BF16;
#if PD_AVX512
            if (nb * 16 + 16 <= N && kb * 32 + 32 <= K) {
                pack_tile_avx512(w, K, nb * 16, kb * 32, tile);
                continue;
            }
#endif
            for (int r = 0; r < 16; r++)
                for (int n = 0; n < 16; n++)
                    for (int e = 0; e < 2; e++) {
                        int64_t row = nb * 16 + n, k = kb * 32 + 2 * r + e;
                        tile[r * 32 + n * 2 + e] = row < N && k < K ? pd_bf16_round(w[row * K + k]) : 0;
                    }
        }
}

#if PD_AMX
/* The work of pd_amx_linear (gated 0: strips 2p and 2p + 1 per block) and of
 * pd_amx_linear_silu (gated 1: gate strip p and up strip NB / 2 + p). */
static int amx_run(int gated, const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, const uint16_t *wp,
                   int64_t N, const float *bias, void *y, int y_bf16, int64_t ldy) {
    int64_t Kp = (K + 31) / 32 * 32, KB = Kp / 32, Mp = (M + 15) / 16 * 16, NB = (N + 15) / 16;
    uint16_t *xa = (uint16_t *)aligned_alloc(64, (size_t)(Mp * Kp) * sizeof(uint16_t));
    if (xa == NULL) return PD_ENOMEM;
    pd_bf16_pack_x(x, x_bf16, ldx, M, K, Mp, Kp, xa);
    int64_t pairs = gated ? NB / 2 : (NB + 1) / 2;
#pragma omp parallel
    {
        float cbuf[1024] __attribute__((aligned(64)));
        amx_configure();
        /* rows in chunks whose bf16 copy stays in L2 while a thread's strips pass over it
         * (all rows at once re-read a 1024-row prefill's activations from L3 for every
         * strip pair: 1.3x slower on SmolLM2's shapes, 2-core Xeon with AMX); the static
         * schedule gives a thread the same strips in every chunk, so no barrier between */
        for (int64_t mc = 0; mc < Mp; mc += AMX_ROW_CHUNK) {
            int64_t mend = mc + AMX_ROW_CHUNK < Mp ? mc + AMX_ROW_CHUNK : Mp;
#pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < pairs; p++) {
                int64_t nb = gated ? p : 2 * p;
                int two_n = gated || nb + 1 < NB;
                const uint16_t *b0 = wp + nb * KB * AMX_TILE_BF16;
                const uint16_t *b1 = wp + (gated ? NB / 2 + p : nb + 1) * KB * AMX_TILE_BF16;
                for (int64_t m0 = mc; m0 < mend; m0 += 32) {
                    int two_m = m0 + 16 < Mp, fetch = m0 == mc;
                    if (gated && two_m && fetch)
                        amx_block(1, 1, 1, 1, xa, Kp, KB, b0, b1, m0, M, nb * 16, N, bias, y, 0, ldy, cbuf);
                    else if (gated && two_m)
                        amx_block(1, 1, 0, 1, xa, Kp, KB, b0, b1, m0, M, nb * 16, N, bias, y, 0, ldy, cbuf);
                    else if (gated)
                        amx_block(0, 1, 1, 1, xa, Kp, KB, b0, b1, m0, M, nb * 16, N, bias, y, 0, ldy, cbuf);
                    else if (two_m && two_n && fetch)
                        amx_block(1, 1, 1, 0, xa, Kp, KB, b0, b1, m0, M, nb * 16, N, bias, y, y_bf16, ldy, cbuf);
                    else if (two_m && two_n)
                        amx_block(1, 1, 0, 0, xa, Kp, KB, b0, b1, m0, M, nb * 16, N, bias, y, y_bf16, ldy, cbuf);
                    else if (two_m)
                        amx_block(1, 0, 1, 0, xa, Kp, KB, b0, b1, m0, M, nb * 16, N, bias, y, y_bf16, ldy, cbuf);
                    else if (two_n)
                        amx_block(0, 1, 1, 0, xa, Kp, KB, b0, b1, m0, M, nb * 16, N, bias, y, y_bf16, ldy, cbuf);
                    else
                        amx_block(0, 0, 1, 0, xa, Kp, KB, b0, b1, m0, M, nb * 16, N, bias, y, y_bf16, ldy, cbuf);
                }
            }
        }
        _tile_release();
    }
    free(xa);
    return PD_OK;
}
#endif

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T (+ bias, float32), W from
 * pd_amx_pack. x and y are float32, or bf16 where x_bf16 / y_bf16 (a bf16 model: y is
 * rounded once, after the bias). PD_EINVAL where this build or this process has no AMX;
 * PD_ENOMEM when the bf16 copy of x cannot be allocated. */
int pd_amx_linear(const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                  const float *bias, void *y, int y_bf16, int64_t ldy) {
#if PD_AMX
    if (!amx_permitted()) return PD_EINVAL;
    if (M <= 0 || N <= 0) return PD_OK;
    return amx_run(0, x, x_bf16, ldx, M, K, wp, N, bias, y, y_bf16, ldy);
#else
    (void)x, (void)x_bf16, (void)ldx, (void)M, (void)K, (void)wp, (void)N, (void)bias, (void)y, (void)y_bf16;
    (void)ldy;
    return PD_EINVAL;
#endif
}

/* A gated MLP's first half in one pass: y[M, N / 2] (float32, row stride ldy) =
 * silu(g) * u, where [g | u] = x @ W^T (+ bias) and W (from pd_amx_pack) stacks the gate's
 * N / 2 rows over the up projection's. Each block multiplies a gate strip and the up strip
 * of the same columns, and applies the activation to its float32 sums before they leave
 * the tiles: the [M, N] product is never written (it was 12 MiB, written and read back, per
 * SmolLM2 layer of a 1,024-token prefill). The result equals pd_amx_linear then
 * pd_silu_mul. PD_EINVAL where this build or process has no AMX or N / 2 is not a multiple
 * of 16 (a strip must not hold both gate and up columns). */
int pd_amx_linear_silu(const void *x, int x_bf16, int64_t ldx, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                       const float *bias, float *y, int64_t ldy) {
#if PD_AMX
    if (!amx_permitted() || N % 32 != 0) return PD_EINVAL;
    if (M <= 0 || N <= 0) return PD_OK;
    return amx_run(1, x, x_bf16, ldx, M, K, wp, N, bias, y, 0, ldy);
#else
    (void)x, (void)x_bf16, (void)ldx, (void)M, (void)K, (void)wp, (void)N, (void)bias, (void)y, (void)ldy;
    return PD_EINVAL;
#endif
}

/* ------------------------------------------------- quantized tiles (decode batches)
 * At decode batch sizes (16-128 rows) the bf16 tiles above stream 2 bytes per weight and the
 * GEMM runs at memory speed. pd_amx_qt_linear reads Q4_0 / Q4_1 / Q8_0 blocks instead,
 * repacked so that a tile dequantizes in a few vector instructions per row, and turns tile
 * kb + 1 into bf16 (the float32 value the dense dequantization computes, then bf16 nearest
 * even: what pd_amx_pack gives the dense float32 copy of the same blocks, so results equal
 * pd_amx_linear on that copy) while the products of tile kb run on the tiles.
 *
 * Layout (pd_amx_qt_pack): per 16-column strip nb and 32-wide k block kb, one tile of 16 rows
 * r of codes, then 16 fp16 d and (Q4_1) 16 fp16 m, one per column; Q4 tiles take 320 bytes
 * (16 code bytes a row), Q8_0 tiles 544 (32). Tile row r holds bf16 position j = 2n + e
 * (column n, k = 2r + e). Q4: code byte i's low nibble is position i, its high nibble
 * position 16 + i; Q8_0: byte j is position j. Either way one vcvtne2ps2bf16 of the two
 * halves is the row. */
#define AMX_Q4_TILE 320
#define AMX_Q8_TILE 544

static inline int64_t qt_tile_bytes(int qtype) { return qtype == PD_Q8_0 ? AMX_Q8_TILE : AMX_Q4_TILE; }

/* bytes of a tile's codes: 16 rows of a block's code bytes */
static inline int64_t qt_code_bytes(int qtype) { return 16 * pd_code_bytes(qtype); }

int64_t pd_amx_qt_packed_size(int qtype, int64_t N, int64_t K) {
    return pd_block_bytes(qtype) ? N / 16 * (K / 32) * qt_tile_bytes(qtype) : 0;
}

/* Value k's code in a block: Q4_0 {f16 d; u8 qs[16]}, Q4_1 {f16 d; f16 m; u8 qs[16]} (qs[j]'s
 * low nibble k = j, high nibble k = j + 16), Q8_0 {f16 d; i8 qs[32]} (as its byte). */
static inline int qt_code(int qtype, const uint8_t *block, int k) {
    if (qtype == PD_Q8_0) return block[2 + k];
    const uint8_t *qs = block + (qtype == PD_Q4_1 ? 4 : 2);
    return k < 16 ? qs[k] & 15 : qs[k - 16] >> 4;
}

/* raw: N rows of K / 32 blocks of `qtype` (Q4_0: value d * (q - 8); Q4_1: d * q + m; Q8_0:
 * d * q). PD_EINVAL for another type or where N, K are not multiples of 16, 32. */
int pd_amx_qt_pack(int qtype, const uint8_t *raw, int64_t N, int64_t K, uint8_t *out) {
    int bb = pd_block_bytes(qtype);
    if (bb == 0 || N % 16 != 0 || K % 32 != 0) return PD_EINVAL;
    int64_t KB = K / 32, NB = N / 16, tb = qt_tile_bytes(qtype), codes = qt_code_bytes(qtype);
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < NB; nb++)
        for (int64_t kb = 0; kb < KB; kb++) {
            uint8_t *t = out + (nb * KB + kb) * tb;
            const uint8_t *blk[16];
            memset(t + codes, 0, (size_t)(tb - codes));
            for (int n = 0; n < 16; n++) {
                blk[n] = raw + ((nb * 16 + n) * KB + kb) * bb;
                memcpy(t + codes + 2 * n, blk[n], 2);                                /* d */
                if (qtype == PD_Q4_1) memcpy(t + codes + 32 + 2 * n, blk[n] + 2, 2);  /* m */
            }
            for (int r = 0; r < 16; r++)
                for (int i = 0; i < 16; i++) { /* positions i and 16 + i: column j / 2, k = 2r + j % 2 */
                    int hi = 16 + i;
                    int lo_code = qt_code(qtype, blk[i / 2], 2 * r + i % 2);
                    int hi_code = qt_code(qtype, blk[hi / 2], 2 * r + hi % 2);
                    if (qtype == PD_Q8_0) {
                        t[r * 32 + i] = (uint8_t)lo_code;
                        t[r * 32 + hi] = (uint8_t)hi_code;
                    } else {
                        t[r * 16 + i] = (uint8_t)(lo_code | hi_code << 4);
                    }
                }
        }
    return PD_OK;
}

#if PD_AMX
/* One quantized tile into the 16 x 32 bf16 tile at dst (1 KiB), each value as the dense
 * dequantization computes it in float32 (gguf_dequant: Q4_0 (q - 8) * d, Q4_1 d * q + m,
 * Q8_0 q * d), then rounded to bf16; lo_idx / hi_idx spread the 16 columns' d (and m) over
 * the positions of each half of a row. qtype is a constant at every call site. */
static inline __attribute__((always_inline)) void qt_tile(int qtype, const uint8_t *t, uint16_t *dst,
                                                          __m512i lo_idx, __m512i hi_idx) {
    const int64_t codes = qt_code_bytes(qtype);
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + codes)));
    __m512 dl = _mm512_permutexvar_ps(lo_idx, d), dh = _mm512_permutexvar_ps(hi_idx, d);
    __m512 ml = dl, mh = dh;
    if (qtype == PD_Q4_1) {
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + codes + 32)));
        ml = _mm512_permutexvar_ps(lo_idx, m), mh = _mm512_permutexvar_ps(hi_idx, m);
    }
    const __m512i nibble = _mm512_set1_epi32(15);
    const __m512 eight = _mm512_set1_ps(8.0f);
    for (int r = 0; r < 16; r++) {
        __m512 lo, hi;
        if (qtype == PD_Q8_0) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(t + 32 * r));
            lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v))), dl);
            hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1))), dh);
        } else {
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(t + 16 * r)));
            __m512 ql = _mm512_cvtepi32_ps(_mm512_and_si512(v, nibble));
            __m512 qh = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
            if (qtype == PD_Q4_1) {
                lo = _mm512_fmadd_ps(ql, dl, ml);
                hi = _mm512_fmadd_ps(qh, dh, mh);
            } else {
                lo = _mm512_mul_ps(_mm512_sub_ps(ql, eight), dl);
                hi = _mm512_mul_ps(_mm512_sub_ps(qh, eight), dh);
            }
        }
        _mm512_storeu_si512(dst + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* The work of pd_amx_qt_linear (gated 0: strips 2p and 2p + 1) and pd_amx_qt_linear_silu
 * (gated 1: gate strip p and up strip NB / 2 + p, silu(gate) * up to y's 16 columns 16p..);
 * qtype is a constant at every call site (qt_run). */
static inline __attribute__((always_inline)) int qt_run_type(int qtype, int gated, const float *x, int64_t ldx,
                                                             int64_t M, int64_t K, const uint8_t *wq, int64_t N,
                                                             float *y, int64_t ldy) {
    const int64_t TB = qt_tile_bytes(qtype);
    int64_t KB = K / 32, Mp = (M + 15) / 16 * 16, NB = N / 16, pairs = gated ? NB / 2 : (NB + 1) / 2;
    uint16_t *xa = (uint16_t *)aligned_alloc(64, (size_t)(Mp * K) * sizeof(uint16_t));
    if (xa == NULL) return PD_ENOMEM;
    pd_bf16_pack_x(x, 0, ldx, M, K, Mp, K, xa);
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *buf = (uint16_t *)aligned_alloc(64, (size_t)(2 * KB * AMX_TILE_BF16) * sizeof(uint16_t));
        float cbuf[1024] __attribute__((aligned(64)));
        int lo[16], hi[16];
        for (int i = 0; i < 16; i++) lo[i] = i / 2, hi[i] = 8 + i / 2;
        __m512i lo_idx = _mm512_loadu_si512(lo), hi_idx = _mm512_loadu_si512(hi);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        amx_configure();
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            if (buf == NULL) continue;
            int two_n = gated || 2 * p + 1 < NB;
            const uint8_t *t0 = wq + (gated ? p : 2 * p) * KB * TB;
            const uint8_t *t1 = wq + (gated ? NB / 2 + p : 2 * p + 1) * KB * TB;
            int64_t n0 = gated ? 16 * p : 32 * p;
            uint16_t *b0 = buf, *b1 = buf + KB * AMX_TILE_BF16;
            for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
                int two_m = m0 + 16 < Mp;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                if (m0 == 0) { /* the first row block's products of tile kb run while tile kb + 1 is dequantized */
                    qt_tile(qtype, t0, b0, lo_idx, hi_idx);
                    if (two_n) qt_tile(qtype, t1, b1, lo_idx, hi_idx);
                }
                for (int64_t kb = 0; kb < KB; kb++) {
                    const uint16_t *a0 = xa + m0 * K, *a1 = a0 + 16 * K;
                    if (two_m && two_n) amx_kstep(1, 1, a0, a1, K, kb, b0, b1);
                    else if (two_m) amx_kstep(1, 0, a0, a1, K, kb, b0, b1);
                    else if (two_n) amx_kstep(0, 1, a0, a1, K, kb, b0, b1);
                    else amx_kstep(0, 0, a0, a1, K, kb, b0, b1);
                    if (m0 == 0 && kb + 1 < KB) { /* the next tiles, while the products run; fetch further ahead */
                        for (int l = 0; l < TB; l += 64) {
                            _mm_prefetch((const char *)(t0 + (kb + 32) * TB) + l, _MM_HINT_T0);
                            if (two_n) _mm_prefetch((const char *)(t1 + (kb + 32) * TB) + l, _MM_HINT_T0);
                        }
                        qt_tile(qtype, t0 + (kb + 1) * TB, b0 + (kb + 1) * AMX_TILE_BF16, lo_idx, hi_idx);
                        if (two_n) qt_tile(qtype, t1 + (kb + 1) * TB, b1 + (kb + 1) * AMX_TILE_BF16, lo_idx, hi_idx);
                    }
                }
                amx_block_store(two_m, two_n, gated, m0, M, n0, N, NULL, y, 0, ldy, cbuf);
            }
        }
        _tile_release();
        free(buf);
    }
    free(xa);
    return failed ? PD_ENOMEM : PD_OK;
}

static int qt_run(int qtype, int gated, const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *wq,
                  int64_t N, float *y, int64_t ldy) {
    switch (qtype) {
    case PD_Q4_0: return qt_run_type(PD_Q4_0, gated, x, ldx, M, K, wq, N, y, ldy);
    case PD_Q4_1: return qt_run_type(PD_Q4_1, gated, x, ldx, M, K, wq, N, y, ldy);
    default: return qt_run_type(PD_Q8_0, gated, x, ldx, M, K, wq, N, y, ldy);
    }
}
#endif

/* Both entries below: their checks (a gated weight's halves whole strips), then qt_run. */
static int qt_linear(int gated, int qtype, const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *wq,
                     int64_t N, float *y, int64_t ldy) {
#if PD_AMX
    if (!amx_permitted() || !pd_block_bytes(qtype) || N % (gated ? 32 : 16) != 0 || K % 32 != 0) return PD_EINVAL;
    if (M <= 0 || N <= 0) return PD_OK;
    return qt_run(qtype, gated, x, ldx, M, K, wq, N, y, ldy);
#else
    (void)gated, (void)qtype, (void)x, (void)ldx, (void)M, (void)K, (void)wq, (void)N, (void)y, (void)ldy;
    return PD_EINVAL;
#endif
}

/* y[M, N] (float32, row stride ldy) = x[M, K] (float32, row stride ldx) @ W^T for W from
 * pd_amx_qt_pack of `qtype` blocks: equal to pd_amx_linear on pd_amx_pack of W's float32
 * dequantization. Each thread takes strip pairs; per pair it dequantizes the strips into a
 * buffer, tile kb + 1 while the first row block's products of tile kb run, and the later row
 * blocks reuse the buffer. PD_EINVAL without AMX or for another type; PD_ENOMEM when a
 * buffer cannot be allocated. */
int pd_amx_qt_linear(int qtype, const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *wq, int64_t N,
                     float *y, int64_t ldy) {
    return qt_linear(0, qtype, x, ldx, M, K, wq, N, y, ldy);
}

/* pd_amx_linear_silu's contract on quantized tiles: y[M, N / 2] = silu(g) * u for [g | u] =
 * x @ W^T, the gate's N / 2 rows over the up projection's (no bias); equal to
 * pd_amx_qt_linear then pd_silu_mul. PD_EINVAL without AMX, for another type or where N / 2
 * is not a multiple of 16. */
int pd_amx_qt_linear_silu(int qtype, const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *wq,
                          int64_t N, float *y, int64_t ldy) {
    return qt_linear(1, qtype, x, ldx, M, K, wq, N, y, ldy);
}
