/* The bfloat16 pairs path of the paged attention (attention.c dispatches; docs/architecture.md
 * §Kernels): AVX512-BF16 dot products (VDPBF16PS: 16 float32 lanes, each += a·b over a pair of
 * bfloat16): no conversion to float32, half the multiply-adds. Keys become transposed pairs
 * kp [D/2, CHUNK] (lane j: k_j[2p], k_j[2p + 1]); values pairs of consecutive keys interleaved by
 * dimension, vp [CHUNK/2, D/32, 2, 16] (lane: v_j[d], v_j+1[d]), which leaves each row's
 * accumulator in a permuted order ([D/32, 2, 16], see store_pairs_row); the probabilities are
 * rounded to bfloat16 before they weigh the values, as transformers' eager attention does. Its accuracy
 * against float64 matches transformers' bfloat16 (tests/model/test_goldens.py). */
#include "attention.h"

#if defined(KVTIER_AVX512BF16)
#include "vec512.h"

/* 32 elements of the cache (bfloat16, or fp8 codes converted) at element `at` as bfloat16 */
static inline __m512i load32(const void *cache, int64_t at, int kv_dtype) {
    if (kv_dtype == KV_BF16) return _mm512_loadu_si512((const uint16_t *)cache + at);
    return fp8x32_bf16((const uint8_t *)cache + at, kv_dtype);
}

/* keys from element k of the cache, rows `stride` elements apart */
static void keys_pairs(const void *cache, int64_t k, int kv_dtype, int64_t stride, int64_t n,
                       int64_t D, uint32_t *kp) {
    for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
        __m512 r[16];
        for (int64_t j = 0; j < 16; j++)
            r[j] = j < n ? _mm512_castsi512_ps(load32(cache, k + j * stride + 2 * p0, kv_dtype))
                         : _mm512_setzero_ps();
        transpose16(r);
        for (int64_t p = 0; p < 16; p++) _mm512_store_ps((float *)kp + (p0 + p) * CHUNK, r[p]);
    }
}

static void values_pairs(const void *cache, int64_t v, int kv_dtype, int64_t stride, int64_t n,
                         int64_t D, uint32_t *vp) {
    const int64_t blocks = D / 32;
    for (int64_t jp = 0; jp < CHUNK / 2; jp++) {
        const int64_t j = 2 * jp;
        for (int64_t b = 0; b < blocks; b++) {
            const __m512i x =
                j < n ? load32(cache, v + j * stride + 32 * b, kv_dtype) : _mm512_setzero_si512();
            const __m512i y = j + 1 < n ? load32(cache, v + (j + 1) * stride + 32 * b, kv_dtype)
                                        : _mm512_setzero_si512();
            uint32_t *dst = vp + (jp * blocks + b) * 32;
            _mm512_store_si512(dst, _mm512_unpacklo_epi16(x, y));
            _mm512_store_si512(dst + 16, _mm512_unpackhi_epi16(x, y));
        }
    }
}

#define SEG 32 /* chunks per segment of the two-pass softmax (attend_pairs) */

/* A row of the output: its permuted accumulator × inv, rounded to bfloat16 with f32_to_bf16's
 * bits, 32 dimensions at a time (each block of 32 words holds dimensions 0-3, 8-11, 16-19, 24-27
 * in its first 16 and 4-7, 12-15, 20-23, 28-31 in its second: values_pairs' interleave). */
static void store_pairs_row(const float *acc, float inv, int64_t D, uint16_t *dst) {
    const __m512i first =
        _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second =
        _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512 s = _mm512_set1_ps(inv);
    for (int64_t b = 0; b < D; b += 32) {
        const __m512 x = _mm512_mul_ps(_mm512_load_ps(acc + b), s);
        const __m512 y = _mm512_mul_ps(_mm512_load_ps(acc + b + 16), s);
        _mm256_storeu_si256((__m256i *)(dst + b), bf16_round_16(_mm512_permutex2var_ps(x, first, y)));
        _mm256_storeu_si256((__m256i *)(dst + b + 16),
                            bf16_round_16(_mm512_permutex2var_ps(x, second, y)));
    }
}

typedef struct { /* attend_pairs' buffers, one per work item's thread */
    uint32_t *kp;     /* [D / 2, CHUNK] one chunk's keys as transposed pairs */
    uint32_t *vseg;   /* [SEG][8 D] the segment's values as pairs (values_pairs) */
    float *scores;    /* [rows][SEG][CHUNK] */
    __mmask16 *valid; /* [rows][SEG] keys each row reads in each chunk */
    uint32_t *pp;     /* [rows][SEG][CHUNK / 2] probabilities, bfloat16 pairs */
    int64_t count[SEG]; /* keys of each chunk */
} Scratch;

/* Scores of R query rows (R ≤ 4 a constant after inlining) over one chunk: q · k * scale,
 * soft-capped; sc[g] lane j is key j of the chunk. */
static inline __attribute__((always_inline)) void scores_rows_bf16(
    const int R, const uint16_t *const *q, const uint32_t *kp, int64_t D, float scale,
    float softcap, __m512 *sc) {
    __m512 s2[4]; /* two accumulators per row: half the dependency chain */
    for (int g = 0; g < R; g++) sc[g] = s2[g] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; p += 2) {
        const __m512bh k0 = (__m512bh)_mm512_load_si512(kp + p * CHUNK);
        const __m512bh k1 = (__m512bh)_mm512_load_si512(kp + (p + 1) * CHUNK);
        for (int g = 0; g < R; g++) {
            uint32_t pair[2];
            memcpy(pair, q[g] + 2 * p, 8);
            sc[g] = _mm512_dpbf16_ps(sc[g], k0, (__m512bh)_mm512_set1_epi32((int)pair[0]));
            s2[g] = _mm512_dpbf16_ps(s2[g], k1, (__m512bh)_mm512_set1_epi32((int)pair[1]));
        }
    }
    for (int g = 0; g < R; g++) {
        sc[g] = _mm512_mul_ps(_mm512_add_ps(sc[g], s2[g]), _mm512_set1_ps(scale));
        if (softcap > 0.0f) {
            float tmp[CHUNK];
            _mm512_storeu_ps(tmp, sc[g]);
            for (int64_t j = 0; j < CHUNK; j++) tmp[j] = softcap * tanhf(tmp[j] / softcap);
            sc[g] = _mm512_loadu_ps(tmp);
        }
    }
}

/* acc rows += p · v over the segment's chunks, R rows (R ≤ 4) at once: each value vector loaded
 * serves every row, and the R × 4 accumulators of 64 dimensions are independent chains (one
 * chain per row waited on the multiply-add's latency). pp [rows][SEG][CHUNK / 2] probability
 * pairs; vseg per chunk as values_pairs ([CHUNK / 2][D / 32][32] words). */
static inline __attribute__((always_inline)) void values_rows_bf16(
    const int R, const uint32_t *pp, const uint32_t *vseg, const int64_t *count, int64_t nc,
    int64_t D, float *acc) {
    for (int64_t d0 = 0; d0 < D; d0 += 64) { /* words d0 .. d0 + 63 of each row */
        const int V = D - d0 < 64 ? (int)((D - d0) / 16) : 4; /* D is a multiple of 32 */
        __m512 t[4][4];
        for (int g = 0; g < R; g++)
            for (int u = 0; u < V; u++) t[g][u] = _mm512_load_ps(acc + g * D + d0 + 16 * u);
        for (int64_t c = 0; c < nc; c++) {
            const uint32_t *vc = vseg + c * 8 * D + d0;
            const uint32_t *pc = pp + c * (CHUNK / 2);
            for (int64_t jp = 0; jp < (count[c] + 1) / 2; jp++) {
                __m512bh v[4];
                for (int u = 0; u < V; u++)
                    v[u] = (__m512bh)_mm512_load_si512(vc + jp * D + 16 * u);
                for (int g = 0; g < R; g++) {
                    const __m512bh p =
                        (__m512bh)_mm512_set1_epi32((int)pc[g * SEG * (CHUNK / 2) + jp]);
                    for (int u = 0; u < V; u++) t[g][u] = _mm512_dpbf16_ps(t[g][u], v[u], p);
                }
            }
        }
        for (int g = 0; g < R; g++)
            for (int u = 0; u < V; u++) _mm512_store_ps(acc + g * D + d0 + 16 * u, t[g][u]);
    }
}

/* One KV head of one sequence over its keys [kmin, kmax), in segments of up to SEG chunks: first
 * every chunk's scores (and its values re-laid as pairs), then per row one max, one exponential
 * pass and one sum over the segment (the running max and sum carried across segments, as an
 * online softmax does per chunk), then the values. Per chunk the online form paid a max, a sum
 * and maybe a rescale per row — reductions across lanes whose latency dominated decode. Rows are
 * ordered (query, g); q[row] points at each row's query. */
static void attend_pairs(const Args *a, const uint16_t *const *q, int64_t nq, int64_t G,
                         int64_t row0, const int64_t *table, int64_t h, int64_t kmin, int64_t kmax,
                         Scratch *s, float *m, float *l, float *acc) {
    const int64_t D = a->head_dim, bs = a->block_size, row_size = a->kv_heads * D;
    const int64_t rows = nq * G;
    int64_t ahead = kmin; /* the first key of the next chunk to prefetch */
    for (int64_t i = 0; i < AHEAD && ahead < kmax; i++)
        ahead = prefetch_pairs(a, table, h, ahead, kmax, TO_L2);
    for (int64_t seg0 = kmin; seg0 < kmax;) {
        int64_t nc = 0, c0 = seg0;
        for (; c0 < kmax && nc < SEG; nc++) {
            const int64_t cn = chunk_len(c0, kmax, bs);
            const int64_t kbase = key_row(a, table, c0);
            if (ahead < kmax) ahead = prefetch_pairs(a, table, h, ahead, kmax, TO_L2);
            const int64_t kh = kbase + h * D;
            keys_pairs(a->cache, kh, a->kv_dtype, row_size, cn, D, s->kp);
            values_pairs(a->cache, kh + bs * row_size, a->kv_dtype, row_size, cn, D,
                         s->vseg + nc * 8 * D);
            s->count[nc] = cn;
            for (int64_t qi = 0; qi < nq; qi++) {
                const int64_t lo = a->lo[row0 + qi] > c0 ? a->lo[row0 + qi] - c0 : 0;
                const int64_t hi = a->hi[row0 + qi] < c0 + cn ? a->hi[row0 + qi] - c0 : cn;
                const __mmask16 valid =
                    lo < hi ? (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u)) : 0;
                for (int64_t g0 = 0; g0 < G; g0 += 4) {
                    const int R = G - g0 < 4 ? (int)(G - g0) : 4;
                    __m512 sc[4];
                    const uint16_t *const *qr = q + qi * G + g0;
                    if (R == 4) scores_rows_bf16(4, qr, s->kp, D, a->scale, a->softcap, sc);
                    else if (R == 3) scores_rows_bf16(3, qr, s->kp, D, a->scale, a->softcap, sc);
                    else if (R == 2) scores_rows_bf16(2, qr, s->kp, D, a->scale, a->softcap, sc);
                    else scores_rows_bf16(1, qr, s->kp, D, a->scale, a->softcap, sc);
                    for (int g = 0; g < R; g++) {
                        const int64_t r = qi * G + g0 + g;
                        _mm512_store_ps(s->scores + (r * SEG + nc) * CHUNK, sc[g]);
                        s->valid[r * SEG + nc] = valid;
                    }
                }
            }
            c0 += cn;
        }
        for (int64_t r = 0; r < rows; r++) { /* max, exponentials and sum of the segment */
            const float *sr = s->scores + r * SEG * CHUNK;
            const __mmask16 *vr = s->valid + r * SEG;
            __m512 vmax = _mm512_set1_ps(-INFINITY);
            for (int64_t c = 0; c < nc; c++)
                vmax = _mm512_mask_max_ps(vmax, vr[c], vmax, _mm512_load_ps(sr + c * CHUNK));
            const __m512 mx =
                _mm512_set1_ps(raise_max(_mm512_reduce_max_ps(vmax), D, m + r, l + r, acc + r * D));
            __m512 sum = _mm512_setzero_ps();
            uint32_t *pr = s->pp + r * SEG * (CHUNK / 2);
            for (int64_t c = 0; c < nc; c++) {
                const __m512 e = _mm512_maskz_mov_ps(
                    vr[c], exp_nonpositive(_mm512_sub_ps(_mm512_load_ps(sr + c * CHUNK), mx)));
                sum = _mm512_add_ps(sum, e);
                const __m256bh eb = _mm512_cvtneps_pbh(e);
                memcpy(pr + c * (CHUNK / 2), &eb, sizeof(eb));
            }
            l[r] += _mm512_reduce_add_ps(sum);
        }
        int64_t g = 0;
        for (; g + 4 <= rows; g += 4)
            values_rows_bf16(4, s->pp + g * SEG * (CHUNK / 2), s->vseg, s->count, nc, D, acc + g * D);
        if (rows - g == 3)
            values_rows_bf16(3, s->pp + g * SEG * (CHUNK / 2), s->vseg, s->count, nc, D, acc + g * D);
        else if (rows - g == 2)
            values_rows_bf16(2, s->pp + g * SEG * (CHUNK / 2), s->vseg, s->count, nc, D, acc + g * D);
        else if (rows - g == 1)
            values_rows_bf16(1, s->pp + g * SEG * (CHUNK / 2), s->vseg, s->count, nc, D, acc + g * D);
        seg0 = c0;
    }
}

/* Lays the path's buffers for items of up to `rows` rows out from p (NULL: only counting);
 * returns their bytes. */
static size_t pairs_layout(char *p, int64_t D, int64_t rows, Scratch *s, float **acc, float **m,
                           float **l) {
    size_t at = 0;
    *acc = take(p, &at, sizeof(float) * (size_t)(rows * D));
    *m = take(p, &at, sizeof(float) * (size_t)rows);
    *l = take(p, &at, sizeof(float) * (size_t)rows);
    s->kp = take(p, &at, sizeof(uint32_t) * (size_t)(D / 2 * CHUNK));
    s->vseg = take(p, &at, sizeof(uint32_t) * (size_t)(SEG * 8 * D));
    s->scores = take(p, &at, sizeof(float) * (size_t)(rows * SEG * CHUNK));
    s->pp = take(p, &at, sizeof(uint32_t) * (size_t)(rows * SEG * (CHUNK / 2)));
    s->valid = take(p, &at, sizeof(__mmask16) * (size_t)(rows * SEG));
    return at;
}

size_t attention_pairs_scratch(int64_t D, int64_t max_rows) {
    Scratch s;
    float *acc, *m, *l;
    return pairs_layout(NULL, D, max_rows, &s, &acc, &m, &l);
}

void attention_pairs(const Args *a, const Item *it, char *scratch) {
    const int64_t D = a->head_dim, G = it->G, rows = it->nq * G;
    Scratch s;
    float *acc, *m, *l;
    pairs_layout(scratch, D, rows, &s, &acc, &m, &l);
    const uint16_t *q[rows];
    item_queries(a, it, q);
    memset(acc, 0, sizeof(float) * (size_t)(rows * D));
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    attend_pairs(a, q, it->nq, G, it->row0, it->table, it->h, it->kmin, it->kmax, &s, m, l, acc);
    for (int64_t r = 0; r < rows; r++) {
        const int64_t o = ((it->tok0 + r / G) * a->num_heads + it->h * G + r % G) * D;
        store_pairs_row(acc + r * D, (l[r] > 0.0f ? 1.0f / l[r] : 0.0f) * a->v_scale, D,
                        (uint16_t *)a->out + o);
    }
}
#endif
