/* Dense float32 linear: pack W once (pd_sgemm_pack), then a register-blocked GEMM
 * (pd_sgemm). */
#include "pd_kernels.h"

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

/* Where a 16-column panel of W comes from, for rows [k0, k0 + kc) of K: pd_sgemm's
 * packed copy (a pointer into it), or decoded on the fly into `buf` (kc x 16 floats, the
 * calling thread's) by pd_linear_packed_gemm. */
typedef const float *(*sg_panel_fn)(const void *ctx, int64_t p, int64_t k0, int64_t kc, float *buf);

typedef struct {
    const float *wp;
    int64_t K;
} sg_dense_src;

static const float *sg_dense_panel(const void *ctx, int64_t p, int64_t k0, int64_t kc, float *buf) {
    (void)kc;
    (void)buf;
    const sg_dense_src *src = (const sg_dense_src *)ctx;
    return src->wp + p * src->K * SG_NR + k0 * SG_NR;
}

/* The GEMM driver both entry points share. Work items are (block of rows, run of
 * 16-column panels); threads take them dynamically, each packing its own x block (and
 * decoding its own panels). `kalign`: K blocks start at multiples of it. */
static int sgemm_run(const float *x, int64_t ldx, int64_t M, int64_t K, sg_panel_fn panel, const void *ctx,
                     int64_t kalign, int64_t N, const float *bias, float *y, int64_t ldy) {
    if (M <= 0 || N <= 0) return PD_OK;
    int64_t panels = (N + SG_NR - 1) / SG_NR;
    int64_t kblocks = (K + SG_KC - 1) / SG_KC, kcb = kblocks ? (K + kblocks - 1) / kblocks : 0;
    kcb = (kcb + kalign - 1) / kalign * kalign;
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
        return PD_OK;
    }
    int failed = 0;
#pragma omp parallel
    {
        float *xp = (float *)malloc((size_t)(mcb * kcb + kcb * SG_NR) * sizeof(float));
        float *wbuf = xp == NULL ? NULL : xp + mcb * kcb;
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
                        const float *wpp = panel(ctx, p, k0, kc, wbuf);
                        for (int64_t i = 0; i < mc; i += SG_MR)
                            sgemm_tile(kc, xp + i * kc, wpp, y + (i0 + i) * ldy + n0, ldy,
                                       (int)(mc - i < SG_MR ? mc - i : SG_MR), nr, k0 > 0,
                                       bias != NULL ? bias + n0 : NULL);
                    }
                }
            }
        free(xp);
    }
    return failed ? PD_ENOMEM : PD_OK;
}

/* y (row stride ldy) = x [M, K] (row stride ldx) @ W^T + bias (may be NULL), W from
 * pd_sgemm_pack. Returns PD_OK, or PD_ENOMEM when out of memory. */
int pd_sgemm(const float *x, int64_t ldx, int64_t M, int64_t K, const float *wp, int64_t N, const float *bias,
             float *y, int64_t ldy) {
    sg_dense_src src = {wp, K};
    return sgemm_run(x, ldx, M, K, sg_dense_panel, &src, 1, N, bias, y, ldy);
}

/* ------------------------------------------------------------------ quantized GEMM
 * y = x @ W^T for W in pd_repack's layout (quant.c: codes, and float32 d, m per 32-value
 * block; m NULL for Q8_0), for batches large enough that the product is compute bound:
 * each 16-row panel of W is decoded into the panel layout above (per thread, per block of
 * x rows and of K) and multiplied by the same register-blocked kernel. A weight is decoded
 * once per block of up to 96 rows of x instead of once per row (pd_linear_packed), and no
 * dense copy is kept. Values are d*q + m (fmaf) in float32, as gguf_dequant.py and
 * quant.c's scalar path compute them. */
typedef struct {
    int qtype;
    const uint8_t *codes;
    const float *d, *m;
    int64_t N, K;
} sg_quant_src;

static const float *sg_quant_panel(const void *ctx, int64_t p, int64_t k0, int64_t kc, float *buf) {
    const sg_quant_src *src = (const sg_quant_src *)ctx;
    int q8 = src->qtype == PD_Q8_0; /* Q4_0 and Q4_1 share the nibble layout (m = -8d for Q4_0) */
    int64_t nblocks = src->K / 32, cb = q8 ? 32 : 16;
    for (int j = 0; j < SG_NR; j++) {
        int64_t n = p * SG_NR + j;
        if (n >= src->N) {
            for (int64_t k = 0; k < kc; k++) buf[k * SG_NR + j] = 0.0f;
            continue;
        }
        const uint8_t *cn = src->codes + n * nblocks * cb;
        for (int64_t blk = k0 / 32; blk < (k0 + kc) / 32; blk++) {
            float db = src->d[n * nblocks + blk], mb = src->m != NULL ? src->m[n * nblocks + blk] : 0.0f;
            const uint8_t *c = cn + blk * cb;
            float *dst = buf + (blk * 32 - k0) * SG_NR + j;
            if (q8) {
                for (int i = 0; i < 32; i++) dst[i * SG_NR] = db * (float)(int8_t)c[i];
            } else {
                for (int i = 0; i < 16; i++) {
                    dst[i * SG_NR] = fmaf((float)(c[i] & 0x0F), db, mb);
                    dst[(i + 16) * SG_NR] = fmaf((float)(c[i] >> 4), db, mb);
                }
            }
        }
    }
    return buf;
}

int pd_linear_packed_gemm(int qtype, const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *d,
                          const float *m, int64_t N, float *y, int64_t ldy) {
    if ((qtype != PD_Q4_0 && qtype != PD_Q4_1 && qtype != PD_Q8_0) || K % 32 != 0) return PD_EINVAL;
    sg_quant_src src = {qtype, codes, d, qtype == PD_Q8_0 ? NULL : m, N, K};
    return sgemm_run(x, K, M, K, sg_quant_panel, &src, 32, N, NULL, y, ldy);
}
