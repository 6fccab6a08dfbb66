/* The paged KV cache: store new tokens' keys and values at their slots (pd_write_kv) and
 * attend over the cache without gathering it (pd_paged_attention). A bf16 cache
 * (pd_write_kv_bf16, pd_paged_attention_bf16; where the 512-bit path is built) halves the
 * bytes a decode step reads, which bound the float32 kernel: values are widened to
 * float32 as they load, and everything after is the float32 computation. */
#include "pd_kernels.h"

/* query rows per prefill tile (see attend_tile_avx512) */
#define PD_TILE 16

/* Scratch floats per thread for the tiles: K and V chunks, then per query head the
 * transposed queries and output sums [D][16]. */
static inline int64_t tile_scratch_floats(int64_t G, int64_t D) { return 2 * PD_TILE * D + 2 * G * D * PD_TILE; }

/* ------------------------------------------------------------------ paged KV cache
 * Cache layout (one layer): key_cache and value_cache each [num_blocks, block_size,
 * num_kv_heads, head_size] float32 (or bf16), token slot s = block * block_size + offset.
 */

/* Copy T new tokens' keys/values ([T, kvh * D] rows, given strides) to their slots. A prefill's
 * rows are split among the threads: the slots' lines are written from memory (a 1,024-token
 * SmolLM2 layer into a bf16 cache took ~160 us on one thread of a 2-vCPU Xeon). */
#define PD_WRITE_KV_THREADS_FROM 64
void pd_write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *key_cache,
                 float *value_cache, const int64_t *slots, int64_t T, int64_t row) {
#pragma omp parallel for schedule(static) if (T >= PD_WRITE_KV_THREADS_FROM)
    for (int64_t t = 0; t < T; t++) {
        memcpy(key_cache + slots[t] * row, k + t * k_stride, (size_t)row * sizeof(float));
        memcpy(value_cache + slots[t] * row, v + t * v_stride, (size_t)row * sizeof(float));
    }
}

/* The same for a bf16 cache: each value rounded to the nearest bf16 (ties to even). */
void pd_write_kv_bf16(const float *k, int64_t k_stride, const float *v, int64_t v_stride, uint16_t *key_cache,
                      uint16_t *value_cache, const int64_t *slots, int64_t T, int64_t row) {
#pragma omp parallel for schedule(static) if (T >= PD_WRITE_KV_THREADS_FROM)
    for (int64_t t = 0; t < T; t++) {
        pd_bf16_round_row(k + t * k_stride, key_cache + slots[t] * row, row);
        pd_bf16_round_row(v + t * v_stride, value_cache + slots[t] * row, row);
    }
}

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
 * Requests of PD_TILE or more query rows (prefill chunks) go by tiles of 16 rows where
 * pd_attention_tiles says so and there is no soft cap (attend_tile_avx512); the others
 * row at a time: work item = (query row, kv head); within an item, keys are scored for
 * two query heads per pass and values summed for up to three, so each row is loaded
 * fewer times.
 * Returns PD_OK; PD_ERANGE, writing nothing, when a seq_len overruns its block-table row
 * or is shorter than its query; PD_ENOMEM when a thread's scratch rows cannot be
 * allocated.
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
static inline void prefetch_rows(const void *const *rows, int64_t left, int64_t count, int64_t bytes) {
    for (int64_t i = 0; i < count && i < left; i++)
        for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)rows[i] + b, _MM_HINT_T0);
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
        if (off == 0)
            prefetch_rows((const void *const *)(v + j + PD_PREFETCH_ROWS), n - j - PD_PREFETCH_ROWS, 1, ld * 4);
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

#if PD_AVX512
/* 16 cache values from element d of a row, widened to float32 (bf16 -> float32 is exact) */
static inline __attribute__((always_inline)) __m512 kv_load16(const void *row, int64_t d, int kv_bf16) {
    if (kv_bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d))), 16));
    return _mm512_loadu_ps((const float *)row + d);
}

/* lanes [0, min(left, 16)) */
static inline __mmask16 tail_mask16(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

static inline __attribute__((always_inline)) float dot_kv_avx512(const float *q, const void *row, int64_t D,
                                                                 int kv_bf16) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), kv_load16(row, d, kv_bf16), a);
    return _mm512_reduce_add_ps(a);
}

static inline __attribute__((always_inline)) void score8_avx512(int heads, int kv_bf16, const float *q, int64_t D,
                                                                const void *const *k, float *s, int64_t ld) {
    __m512 a[16];
    for (int i = 0; i < 8 * heads; i++) a[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        __m512 q0 = _mm512_loadu_ps(q + d), q1 = heads == 2 ? _mm512_loadu_ps(q + D + d) : q0;
        for (int i = 0; i < 8; i++) {
            __m512 kv = kv_load16(k[i], d, kv_bf16);
            a[i] = _mm512_fmadd_ps(q0, kv, a[i]);
            if (heads == 2) a[8 + i] = _mm512_fmadd_ps(q1, kv, a[8 + i]);
        }
    }
    for (int h = 0; h < heads; h++) {
        __m256 r[8];
        for (int i = 0; i < 8; i++)
            r[i] = _mm256_add_ps(_mm512_castps512_ps256(a[8 * h + i]), _mm512_extractf32x8_ps(a[8 * h + i], 1));
        _mm256_storeu_ps(s + h * ld, hsum8_avx2(r));
    }
}

/* three query heads against four keys: the 12 accumulators stay in registers (three heads
 * against eight keys did not: 24 accumulators spilled), and each key is widened once for
 * the three heads */
static inline __attribute__((always_inline)) void score4x3_avx512(int kv_bf16, const float *q, int64_t D,
                                                                  const void *const *k, float *s, int64_t ld) {
    __m512 a[12];
    for (int i = 0; i < 12; i++) a[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        __m512 q0 = _mm512_loadu_ps(q + d), q1 = _mm512_loadu_ps(q + D + d), q2 = _mm512_loadu_ps(q + 2 * D + d);
        for (int i = 0; i < 4; i++) {
            __m512 kv = kv_load16(k[i], d, kv_bf16);
            a[i] = _mm512_fmadd_ps(q0, kv, a[i]);
            a[4 + i] = _mm512_fmadd_ps(q1, kv, a[4 + i]);
            a[8 + i] = _mm512_fmadd_ps(q2, kv, a[8 + i]);
        }
    }
    for (int h = 0; h < 3; h++) {
        __m256 r[4];
        for (int i = 0; i < 4; i++)
            r[i] = _mm256_add_ps(_mm512_castps512_ps256(a[4 * h + i]), _mm512_extractf32x8_ps(a[4 * h + i], 1));
        __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(r[0], r[1]), _mm256_hadd_ps(r[2], r[3]));
        _mm_storeu_ps(s + h * ld, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
    }
}

static void score_keys3_avx512(int kv_bf16, const float *q, int64_t D, const void *const *krow, int64_t n,
                               float *s, int64_t ld) {
    int64_t j = 0, bytes = D * (kv_bf16 ? 2 : 4);
    for (; j + 4 <= n; j += 4) {
        prefetch_rows(krow + j + PD_PREFETCH_ROWS, n - j - PD_PREFETCH_ROWS, 4, bytes);
        score4x3_avx512(kv_bf16, q, D, krow + j, s + j, ld);
    }
    for (; j < n; j++)
        for (int h = 0; h < 3; h++) s[h * ld + j] = dot_kv_avx512(q + h * D, krow[j], D, kv_bf16);
}

static inline __attribute__((always_inline)) void score_keys_avx512(int heads, int kv_bf16, const float *q,
                                                                    int64_t D, const void *const *krow, int64_t n,
                                                                    float *s, int64_t ld) {
    int64_t j = 0, bytes = D * (kv_bf16 ? 2 : 4);
    for (; j + 8 <= n; j += 8) {
        prefetch_rows(krow + j + PD_PREFETCH_ROWS, n - j - PD_PREFETCH_ROWS, 8, bytes);
        score8_avx512(heads, kv_bf16, q, D, krow + j, s + j, ld);
    }
    for (; j < n; j++)
        for (int h = 0; h < heads; h++) s[h * ld + j] = dot_kv_avx512(q + h * D, krow[j], D, kv_bf16);
}

/* s[0:n] = softmax(scale * s) (soft_cap > 0: of soft_cap * tanh(scale * s / soft_cap)) */
static void softmax_row_avx512(float *s, int64_t n, float scale, float soft_cap) {
    float mx = -INFINITY;
    if (soft_cap > 0.0f) {
        for (int64_t j = 0; j < n; j++) {
            s[j] = soft_cap * tanhf(s[j] * scale / soft_cap);
            mx = s[j] > mx ? s[j] : mx;
        }
        scale = 1.0f;
    } else {
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < n; j += 16) {
            __mmask16 m = tail_mask16(n - j);
            vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_maskz_loadu_ps(m, s + j));
        }
        mx = _mm512_reduce_max_ps(vmax) * scale; /* scale > 0 */
    }
    __m512 vscale = _mm512_set1_ps(scale), vmx = _mm512_set1_ps(mx), vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 m = tail_mask16(n - j);
        __m512 e = exp_avx512(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, s + j), vscale, vmx));
        _mm512_mask_storeu_ps(s + j, m, e);
        vsum = _mm512_mask_add_ps(vsum, m, vsum, e);
    }
    __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 m = tail_mask16(n - j);
        _mm512_mask_storeu_ps(s + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + j), inv));
    }
}

/* For `heads` (1-4) query heads h and `nz` (1 or 4) vectors of 16 dimensions from
 * `off`: out[h * D + off ...] = sum_j p[h * ld + j] * v[j][off ...] */
static inline __attribute__((always_inline)) void wsum_avx512(int heads, int nz, int kv_bf16, const float *p,
                                                              int64_t ld, const void *const *v, int64_t n,
                                                              int64_t off, int64_t D, float *out) {
    __m512 a[16];
    int64_t bytes = D * (kv_bf16 ? 2 : 4);
    for (int i = 0; i < heads * nz; i++) a[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        if (off == 0) prefetch_rows(v + j + PD_PREFETCH_ROWS, n - j - PD_PREFETCH_ROWS, 1, bytes);
        __m512 vz[4];
        for (int z = 0; z < nz; z++) vz[z] = kv_load16(v[j], off + 16 * z, kv_bf16);
        for (int h = 0; h < heads; h++) {
            __m512 pj = _mm512_set1_ps(p[h * ld + j]);
            for (int z = 0; z < nz; z++) a[h * nz + z] = _mm512_fmadd_ps(pj, vz[z], a[h * nz + z]);
        }
    }
    for (int h = 0; h < heads; h++)
        for (int z = 0; z < nz; z++) _mm512_storeu_ps(out + h * D + off + 16 * z, a[h * nz + z]);
}

#define PD_WSUM_HEADS(nz)                                                                   \
    switch (heads) {                                                                        \
    case 4: wsum_avx512(4, nz, kv_bf16, p, ld, vrow, n, d, D, o); break;                    \
    case 3: wsum_avx512(3, nz, kv_bf16, p, ld, vrow, n, d, D, o); break;                    \
    case 2: wsum_avx512(2, nz, kv_bf16, p, ld, vrow, n, d, D, o); break;                    \
    default: wsum_avx512(1, nz, kv_bf16, p, ld, vrow, n, d, D, o); break;                   \
    }

/* One work item of pd_paged_attention with 512-bit vectors (D a multiple of 16): the G
 * query heads at qt against n keys and values (row pointers krow, vrow: float32 rows, or
 * bf16 rows where kv_bf16), scores in scores[g * ld + j], output at ot[g * D]. Same steps
 * as the AVX2 path; keys are scored eight at a time for two heads per pass, values
 * summed for up to four heads. kv_bf16 is a constant at every call (always_inline). */
static inline __attribute__((always_inline)) void attend_avx512(int kv_bf16, const float *qt,
                                                                const void *const *krow, const void *const *vrow,
                                                                int64_t n, int64_t G, int64_t D, float scale,
                                                                float soft_cap, float *scores, int64_t ld,
                                                                float *ot) {
    int64_t g = 0;
    for (; G - g == 3 || G - g > 4; g += 3) score_keys3_avx512(kv_bf16, qt + g * D, D, krow, n, scores + g * ld, ld);
    for (; g + 2 <= G; g += 2) score_keys_avx512(2, kv_bf16, qt + g * D, D, krow, n, scores + g * ld, ld);
    if (g < G) score_keys_avx512(1, kv_bf16, qt + g * D, D, krow, n, scores + g * ld, ld);
    for (g = 0; g < G; g++) softmax_row_avx512(scores + g * ld, n, scale, soft_cap);
    int64_t step = D % 64 == 0 ? 64 : 16;
    for (int64_t d = 0; d < D; d += step)
        for (g = 0; g < G; g += 4) {
            int heads = G - g < 4 ? (int)(G - g) : 4;
            const float *p = scores + g * ld;
            float *o = ot + g * D;
            if (step == 64) {
                PD_WSUM_HEADS(4)
            } else {
                PD_WSUM_HEADS(1)
            }
        }
}
#undef PD_WSUM_HEADS

/* ---------------------------------------------------------------- prefill tiles
 * A request with at least PD_TILE query rows (a prefill chunk) is attended PD_TILE rows at
 * a time: the 16 lanes of a vector are 16 query rows of one head, so a key's score for
 * all of them is D FMAs against broadcasts of the key's values, and each 16-key chunk of
 * keys and values is widened to float32 once per tile (and kv head) instead of once per
 * row. The row-at-a-time path re-read and re-widened every key for every query row and
 * summed each dot product horizontally: a 620-token SmolLM2 prefill spent ~3.6 ms per
 * layer there. Softmax runs online over the chunks (running max and sum per lane, earlier
 * sums rescaled when the max grows), all in float32: the same values as the row path up
 * to summation order. Work item = (request, kv head, tile); its G query heads share the
 * widened chunks. The queries go into lanes, and the sums back into rows, by 16 x 16
 * transposes in registers (as scalar loops they took a third of a 32-token prompt's time). */

/* Keys (or values) j0 .. j0 + n - 1 of kv head kh, widened to float32 rows dst[16][D];
 * rows from n on are zero. */
static inline __attribute__((always_inline)) void tile_chunk(int kv_bf16, const void *cache, const int32_t *bt,
                                                             int64_t block_size, int64_t row, int64_t kh, int64_t D,
                                                             int64_t j0, int64_t n, float *dst) {
    int64_t esize = kv_bf16 ? 2 : 4;
    for (int64_t j = 0; j < PD_TILE; j++) {
        if (j >= n) {
            memset(dst + j * D, 0, (size_t)D * sizeof(float));
            continue;
        }
        int64_t p = j0 + j, slot = (int64_t)bt[p / block_size] * block_size + p % block_size;
        const void *src = (const char *)cache + (slot * row + kh * D) * esize;
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + j * D + d, kv_load16(src, d, kv_bf16));
    }
}

/* Rows i0 .. i0 + nr - 1 (nr <= 16) of request r's queries, kv head kh. pos0 is the
 * position of row i0; rows see keys [max(0, pos + 1 - window), pos]. */
static inline __attribute__((always_inline)) void attend_tile_avx512(
    int kv_bf16, const float *q, int64_t q_stride, const void *key_cache, const void *value_cache,
    const int32_t *bt, int64_t block_size, int64_t qrow0, int64_t nr, int64_t pos0, int64_t kh, int64_t G,
    int64_t KVH, int64_t D, float scale, int64_t window, float *out, int64_t H, float *scratch) {
    int64_t row = KVH * D;
    float *kc = scratch, *vc = kc + PD_TILE * D, *qt = vc + PD_TILE * D, *ot = qt + G * D * PD_TILE;
    /* lane l: row i0 + min(l, nr - 1) (lanes past the rows repeat the last one; never stored),
     * 16 x 16 blocks of rows and dimensions transposed in registers (D % 16 == 0 here) */
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t g = 0; g < G; g++)
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            __m512 r[PD_TILE];
            for (int64_t l = 0; l < PD_TILE; l++) {
                const float *qh = q + (qrow0 + (l < nr ? l : nr - 1)) * q_stride + (kh * G + g) * D;
                r[l] = _mm512_mul_ps(_mm512_loadu_ps(qh + d0), vscale);
            }
            transpose16_ps(r);
            for (int c = 0; c < 16; c++) _mm512_storeu_ps(qt + (g * D + d0 + c) * PD_TILE, r[c]);
        }
    memset(ot, 0, (size_t)(G * D * PD_TILE) * sizeof(float));
    __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i pos = _mm512_min_epi32(_mm512_add_epi32(_mm512_set1_epi32((int)pos0), lane),
                                   _mm512_set1_epi32((int)(pos0 + nr - 1)));
    __m512i first = window > 0 ? _mm512_max_epi32(_mm512_sub_epi32(pos, _mm512_set1_epi32((int)(window - 1))),
                                                  _mm512_setzero_si512())
                               : _mm512_setzero_si512();
    int64_t last = pos0 + nr - 1, lo = window > 0 && pos0 + 1 > window ? pos0 + 1 - window : 0;
    __m512 m[16], lsum[16]; /* per query head (G <= 16 on this path) */
    for (int64_t g = 0; g < G; g++) m[g] = _mm512_set1_ps(-INFINITY), lsum[g] = _mm512_setzero_ps();
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = lo; j0 <= last; j0 += PD_TILE) {
        int64_t n = last + 1 - j0 < PD_TILE ? last + 1 - j0 : PD_TILE;
        tile_chunk(kv_bf16, key_cache, bt, block_size, row, kh, D, j0, n, kc);
        tile_chunk(kv_bf16, value_cache, bt, block_size, row, kh, D, j0, n, vc);
        /* chunks wholly inside every lane's range need no mask */
        int masked = j0 + PD_TILE - 1 > pos0 || (window > 0 && j0 < pos0 + nr - window);
        for (int64_t g = 0; g < G; g++) {
            const float *qg = qt + g * D * PD_TILE;
            __m512 sc[PD_TILE];
            for (int j = 0; j < PD_TILE; j++) sc[j] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d++) {
                __m512 qd = _mm512_loadu_ps(qg + d * PD_TILE);
                for (int j = 0; j < PD_TILE; j++) sc[j] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kc[j * D + d]), sc[j]);
            }
            if (masked)
                for (int j = 0; j < PD_TILE; j++) {
                    __m512i key = _mm512_set1_epi32((int)(j0 + j));
                    __mmask16 ok = _mm512_cmple_epi32_mask(key, pos) & _mm512_cmpge_epi32_mask(key, first);
                    sc[j] = _mm512_mask_blend_ps(ok, ninf, sc[j]);
                }
            __m512 cmax = sc[0];
            for (int j = 1; j < PD_TILE; j++) cmax = _mm512_max_ps(cmax, sc[j]);
            __m512 mnew = _mm512_max_ps(m[g], cmax);
            /* a lane with no key seen yet keeps max -inf: exponents against 0 then give 0 */
            __m512 muse = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mnew, ninf, _CMP_EQ_OQ), mnew, _mm512_setzero_ps());
            __m512 corr = exp_avx512(_mm512_sub_ps(m[g], muse)), psum = _mm512_setzero_ps();
            for (int j = 0; j < PD_TILE; j++) {
                sc[j] = exp_avx512(_mm512_sub_ps(sc[j], muse));
                psum = _mm512_add_ps(psum, sc[j]);
            }
            lsum[g] = _mm512_fmadd_ps(lsum[g], corr, psum);
            m[g] = mnew;
            float *og = ot + g * D * PD_TILE;
            for (int64_t d = 0; d < D; d += 8) {
                __m512 acc[8];
                for (int e = 0; e < 8; e++) acc[e] = _mm512_mul_ps(_mm512_loadu_ps(og + (d + e) * PD_TILE), corr);
                for (int j = 0; j < PD_TILE; j++)
                    for (int e = 0; e < 8; e++)
                        acc[e] = _mm512_fmadd_ps(sc[j], _mm512_set1_ps(vc[j * D + d + e]), acc[e]);
                for (int e = 0; e < 8; e++) _mm512_storeu_ps(og + (d + e) * PD_TILE, acc[e]);
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float inv[PD_TILE], *og = ot + g * D * PD_TILE;
        _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), lsum[g]));
        for (int64_t d0 = 0; d0 < D; d0 += 16) { /* back to rows, 16 x 16 at a time */
            __m512 r[PD_TILE];
            for (int c = 0; c < 16; c++) r[c] = _mm512_loadu_ps(og + (d0 + c) * PD_TILE);
            transpose16_ps(r);
            for (int64_t l = 0; l < nr; l++) {
                float *o = out + ((qrow0 + l) * H + kh * G + g) * D;
                _mm512_storeu_ps(o + d0, _mm512_mul_ps(r[l], _mm512_set1_ps(inv[l])));
            }
        }
    }
}
#endif

/* The request that owns query row t: a binary search over the running row counts. */
static inline int64_t request_of(int64_t t, const int32_t *query_start, int64_t num_reqs) {
    int64_t lo = 0, hi = num_reqs - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (query_start[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* Ask (into L2) for the whole cache slots query row t reads, up to PD_AHEAD_BYTES of keys
 * and as many of values. Where every work item is a decode row with all its kv heads, each
 * thread starts the misses of the row `nth` items on (its likely next one) before attending
 * its own: a row's few dozen keys sit in a few scattered blocks that the model's weights
 * evicted from the last-level cache, and the hardware prefetcher does not follow block
 * tables. 32 rows of 64-96 keys, one SmolLM2 layer: 1.12-1.18x faster (alternating builds). */
#define PD_AHEAD_BYTES (64 << 10)
static void prefetch_row(int64_t t, const int32_t *query_start, const int32_t *seq_lens, int64_t num_reqs,
                         const int32_t *block_tables, int64_t bt_stride, const void *key_cache,
                         const void *value_cache, int64_t block_size, int64_t slot_bytes, int64_t window) {
    int64_t r = request_of(t, query_start, num_reqs), q_len = query_start[r + 1] - query_start[r];
    if (q_len >= PD_TILE) return; /* tiles read their own chunks */
    int64_t pos = seq_lens[r] - q_len + (t - query_start[r]);
    int64_t start = window > 0 && pos + 1 > window ? pos + 1 - window : 0, budget = PD_AHEAD_BYTES;
    const int32_t *bt = block_tables + r * bt_stride;
    for (int64_t p = start; p <= pos && budget > 0;) {
        int64_t blk = p / block_size, o = p - blk * block_size;
        int64_t take = block_size - o < pos + 1 - p ? block_size - o : pos + 1 - p;
        int64_t at = ((int64_t)bt[blk] * block_size + o) * slot_bytes; /* the block's slots are contiguous */
        for (int64_t b = 0; b < take * slot_bytes; b += 64) {
            __builtin_prefetch((const char *)key_cache + at + b, 0, 2); /* 2: into L2, as _MM_HINT_T1 */
            __builtin_prefetch((const char *)value_cache + at + b, 0, 2);
        }
        budget -= take * slot_bytes;
        p += take;
    }
}

static int paged_attention(const float *q, int64_t q_stride, const void *key_cache, const void *value_cache,
                           int kv_bf16, const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                           const int32_t *query_start, const int32_t *row_start, int64_t num_reqs, float *out,
                           int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale, int64_t window,
                           float soft_cap) {
    int64_t esize = kv_bf16 ? 2 : 4;
    /* max_seq_len sizes the scratch rows (at least 1: no malloc of 0 bytes) */
    int64_t T = query_start[num_reqs], G = H / KVH, row = KVH * D, max_seq_len = 1;
    /* every length must fit its block-table row (bt_stride blocks) and cover its queries */
    for (int64_t r = 0; r < num_reqs; r++) {
        if (seq_lens[r] > bt_stride * block_size || seq_lens[r] < query_start[r + 1] - query_start[r])
            return PD_ERANGE;
        max_seq_len = seq_lens[r] > max_seq_len ? seq_lens[r] : max_seq_len;
    }
    /* A work item is one query row and `per` kv heads: all of them where there are rows
     * enough to share among the threads (each item then reads whole cache slots, every
     * kv head's part, in one pass: ~1.3x faster decode attention (1.0-1.5x across
     * alternating runs, 32 rows, 30 layers of cache beyond the last-level cache, Zen 5),
     * else one (a single decode row still splits across threads). */
    /* requests of PD_TILE rows or more go by tiles (the AVX-512 path without a soft cap);
     * tile_end[r]: the running count of their (kv head, tile) items; rows[0 .. nrows): the
     * query rows of the others, the row path's (a prefill's thousand tiled rows used to be
     * walked by the row loop only to be skipped there) */
    int tiles_ok = pd_attention_tiles(D, G) && soft_cap <= 0.0f;
    int64_t *tile_end = (int64_t *)malloc((size_t)(num_reqs + 1 + T) * sizeof(int64_t)), tile_items = 0;
    if (tile_end == NULL) return PD_ENOMEM;
    int64_t *rows = tile_end + num_reqs + 1, nrows = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
        int64_t q_len = query_start[r + 1] - query_start[r];
        if (tiles_ok && q_len >= PD_TILE) tile_items += KVH * ((q_len + PD_TILE - 1) / PD_TILE);
        else
            for (int64_t t = query_start[r]; t < query_start[r + 1]; t++) rows[nrows++] = t;
        tile_end[r] = tile_items;
    }
    int64_t per = nrows >= 4 * (int64_t)omp_get_max_threads() ? KVH : 1;
    int failed = 0;
#pragma omp parallel
    {
        /* per thread: scores [G, max_seq_len], then key and value row pointers */
        float *scores = (float *)malloc((size_t)(G * max_seq_len) * sizeof(float) + 2 * (size_t)max_seq_len * sizeof(float *));
        float *tile_scratch = tile_items ? (float *)malloc((size_t)tile_scratch_floats(G, D) * sizeof(float)) : NULL;
        if (scores == NULL || (tile_items && tile_scratch == NULL)) {
#pragma omp atomic write
            failed = 1;
        }
#if PD_AVX512
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t item = 0; item < tile_items; item++) {
            if (tile_scratch == NULL) continue;
            int64_t r = 0;
            while (tile_end[r] <= item) r++;
            int64_t k = item - (r ? tile_end[r - 1] : 0), kh = k % KVH, i0 = k / KVH * PD_TILE;
            int64_t q_len = query_start[r + 1] - query_start[r], nr = q_len - i0 < PD_TILE ? q_len - i0 : PD_TILE;
            int64_t pos0 = seq_lens[r] - q_len + i0;
            /* a bf16 cache's (the tiles' usual one) common head sizes as constants: the chunks'
             * row offsets become immediates; a float32 cache takes the generic size (each
             * constant size added ~0.4 s to a first build, for a gain within noise) */
#define PD_TILE_CALL(bf16, d)                                                                              \
    attend_tile_avx512(bf16, q, q_stride, key_cache, value_cache, block_tables + r * bt_stride, block_size, \
                       row_start[r] + i0, nr, pos0, kh, G, KVH, d, scale, window, out, H, tile_scratch)
            if (kv_bf16) {
                if (D == 64) PD_TILE_CALL(1, 64);
                else if (D == 128) PD_TILE_CALL(1, 128);
                else PD_TILE_CALL(1, D);
            } else {
                PD_TILE_CALL(0, D);
            }
#undef PD_TILE_CALL
        }
#endif
        int64_t nth = omp_get_num_threads();
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < nrows * (KVH / per); item++) {
            if (scores == NULL) continue;
            int64_t t = rows[item / (KVH / per)], kh0 = item % (KVH / per) * per;
            if (per == KVH && item + nth < nrows)
                prefetch_row(rows[item + nth], query_start, seq_lens, num_reqs, block_tables, bt_stride, key_cache,
                             value_cache, block_size, row * esize, window);
            int64_t r = request_of(t, query_start, num_reqs);
            int64_t q_len = query_start[r + 1] - query_start[r], i = t - query_start[r];
            int64_t pos = seq_lens[r] - q_len + i, qrow = row_start[r] + i;
            int64_t start = window > 0 && pos + 1 > window ? pos + 1 - window : 0, n = pos + 1 - start;
            const int32_t *bt = block_tables + r * bt_stride;
            for (int64_t kh = kh0; kh < kh0 + per; kh++) {
                const void **kptr = (const void **)(scores + G * max_seq_len), **vptr = kptr + max_seq_len;
                /* block by block: one division per block, not two per key */
                for (int64_t j = 0, p = start; j < n;) {
                    int64_t blk = p / block_size, o = p - blk * block_size;
                    int64_t take = block_size - o < n - j ? block_size - o : n - j;
                    int64_t at = (((int64_t)bt[blk] * block_size + o) * row + kh * D) * esize, stride = row * esize;
                    const char *kb = (const char *)key_cache + at, *vb = (const char *)value_cache + at;
                    for (int64_t u = 0; u < take; u++) {
                        kptr[j + u] = kb + u * stride;
                        vptr[j + u] = vb + u * stride;
                    }
                    j += take, p += take;
                }
                /* the loops below prefetch PD_PREFETCH_ROWS rows ahead: start the rows before
                 * that distance now, all at once (many misses in flight, not one per row) */
#if PD_AVX2
                prefetch_rows((const void *const *)kptr, n, PD_PREFETCH_ROWS, D * esize);
                prefetch_rows((const void *const *)vptr, n, PD_PREFETCH_ROWS, D * esize);
#endif
                /* the float32 paths below read these as float rows (a bf16 cache never gets there) */
                const float *const *krow = (const float *const *)kptr, *const *vrow = (const float *const *)vptr;
                const float *qt = q + qrow * q_stride + kh * G * D; /* this kv head's G query heads */
                float *ot = out + (qrow * H + kh * G) * D;
#if PD_AVX512
                if (kv_bf16) {
                    attend_avx512(1, qt, kptr, vptr, n, G, D, scale, soft_cap, scores, max_seq_len, ot);
                    continue;
                }
                if (D % 16 == 0) {
                    attend_avx512(0, qt, kptr, vptr, n, G, D, scale, soft_cap, scores, max_seq_len, ot);
                    continue;
                }
#endif
                int64_t g = 0;
#if PD_AVX2
                /* two query heads per pass over the keys: each key chunk is loaded once */
                if (D % 8 == 0)
                    for (; g + 2 <= G; g += 2) {
                        float *s0 = scores + g * max_seq_len, *s1 = s0 + max_seq_len;
                        int64_t j = 0;
                        for (; j + 4 <= n; j += 4) {
                            if (g == 0)
                                prefetch_rows((const void *const *)(krow + j + PD_PREFETCH_ROWS),
                                              n - j - PD_PREFETCH_ROWS, 4, D * 4);
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
        }
        free(scores);
        free(tile_scratch);
    }
    free(tile_end);
    return failed ? PD_ENOMEM : PD_OK;
}

int pd_paged_attention(const float *q, int64_t q_stride, const float *key_cache, const float *value_cache,
                       const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                       const int32_t *query_start, const int32_t *row_start, int64_t num_reqs, float *out, int64_t H,
                       int64_t KVH, int64_t D, int64_t block_size, float scale, int64_t window, float soft_cap) {
    return paged_attention(q, q_stride, key_cache, value_cache, 0, block_tables, bt_stride, seq_lens, query_start,
                           row_start, num_reqs, out, H, KVH, D, block_size, scale, window, soft_cap);
}

/* pd_paged_attention over a bf16 cache (written by pd_write_kv_bf16); PD_EINVAL where this
 * build has no 512-bit path or D is not a multiple of 16 (pd_has_bf16_kv says which). */
int pd_paged_attention_bf16(const float *q, int64_t q_stride, const uint16_t *key_cache, const uint16_t *value_cache,
                            const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                            const int32_t *query_start, const int32_t *row_start, int64_t num_reqs, float *out,
                            int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale, int64_t window,
                            float soft_cap) {
    if (!PD_AVX512 || D % 16) return PD_EINVAL;
    return paged_attention(q, q_stride, key_cache, value_cache, 1, block_tables, bt_stride, seq_lens, query_start,
                           row_start, num_reqs, out, H, KVH, D, block_size, scale, window, soft_cap);
}

int pd_has_bf16_kv(void) { return PD_AVX512; }

/* 1 where pd_paged_attention takes requests of PD_TILE or more query rows by tiles (this
 * build's 512-bit path, D a multiple of 16, at most 16 query heads per kv head) when the
 * layer has no soft cap; the row-at-a-time path serves them otherwise. */
int pd_attention_tiles(int64_t D, int64_t G) { return PD_AVX512 && D % 16 == 0 && G >= 1 && G <= 16; }
