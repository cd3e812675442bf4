/* Paged attention straight from the KV cache for decodes, draft verification and a prompt's chunk
 * (in a step the one-call layers run): no gather copy; work items of (sequence, KV head, block of
 * up to QBLOCK queries), each reading its keys once, up to its last query; float32
 * accumulation with an online softmax (per chunk of keys; per segment of up to SEG chunks in the
 * bfloat16 pairs path, see attend_pairs). Built and loaded by kvtier/model/native.py (plain C, no
 * Python or torch headers); called through ctypes, which releases the GIL.
 *
 * Cache layout [num_blocks, 2, block_size, kv_heads, head_dim] (K then V per block), contiguous.
 * q is [tokens, heads, head_dim] with a token stride (a view of the fused qkv output); out is
 * contiguous [tokens, heads, head_dim]. Query head h reads KV head h / group. Each query row r of
 * a sequence attends to key positions [lo[r], hi[r]) (causal, window and chunk masks are all
 * one range per query). Element type: 0 float32, 1 bfloat16 (round to nearest even on output).
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "vexp.h"

typedef struct {
    const void *q;
    int64_t q_stride;
    const void *cache;
    void *out;
    const int64_t *tables; /* [num_seqs, table_stride] block ids */
    int64_t table_stride;
    const int64_t *seq_token; /* [num_seqs] batch index of each sequence's first query */
    const int64_t *seq_qlen;  /* [num_seqs] queries of each sequence */
    const int64_t *seq_row;   /* [num_seqs] index of its first query in lo / hi */
    const int64_t *lo, *hi;   /* [rows] key range of each query */
    int64_t num_heads, kv_heads, head_dim, block_size;
    float scale, softcap;
    int dtype;
    const int64_t *items; /* [n][3]: sequence, KV head, first query of a block of ≤ QBLOCK */
    int64_t begin, end;   /* the items of this thread */
    int status;           /* 0, or -1: out of memory (its rows of out are not written) */
    int amx;              /* items of ≤ 16 query rows on AMX tiles (attend_amx) */
} Args;

/* Queries of one sequence and KV head attended together (one work item): decodes and drafts are
 * one block; a prompt's chunk is split so both threads share it and a block reads only the keys
 * up to its own last query. */
#define QBLOCK 32

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static void load_row(const void *base, int64_t offset, int64_t n, int dtype, float *dst) {
    if (dtype == 1) {
        const uint16_t *src = (const uint16_t *)base + offset;
#pragma omp simd
        for (int64_t d = 0; d < n; d++) dst[d] = bf16_to_f32(src[d]);
    } else {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
    }
}

#define CHUNK 16 /* keys scored together: one AVX-512 register of float32 scores */

/* Keys c0.. of the chunk starting at c0 (at most CHUNK, within one block) */
static int64_t chunk_len(int64_t c0, int64_t kmax, int64_t bs) {
    const int64_t off = c0 % bs;
    int64_t cn = bs - off < kmax - c0 ? bs - off : kmax - c0;
    return cn < CHUNK ? cn : CHUNK;
}

/* Where key c's row (every KV head) starts in the cache, in elements: its block's K half; the
 * value row is bs rows further */
static inline int64_t key_row(const Args *a, const int64_t *table, int64_t c) {
    const int64_t bs = a->block_size;
    return ((table[c / bs] * 2 * bs) + c % bs) * a->kv_heads * a->head_dim;
}

static void prefetch_chunk(const char *k, int64_t bytes, int64_t value) {
    for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(k + b);
        __builtin_prefetch(k + value + b);
    }
}


/* The three steps on a chunk of up to CHUNK consecutive keys of one block and KV head:
 *   keys_t:  keys transposed to kt [D, CHUNK] float32 (key j in lane j) and values to
 *            vf [CHUNK, D] float32;
 *   softmax: scores of one query row sc[j] = q . k_j, then the online-softmax update of the
 *            row's running max m, sum l and accumulator acc [D] with keys [lo, hi) of the chunk.
 * An AVX-512 version (gathers, masked lanes, scalef-based exp) and a portable one. */
#if defined(__AVX512F__)
#include <immintrin.h>

/* r[0..15] (row j: 16 floats) → r[0..15] (row d: lane j), in registers */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    /* u[4k + m] holds, per 128-bit lane l, element m of rows 4l'..: combine lanes across rows */
    for (int m = 0; m < 4; m++) {
        const __m512 a = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x88);
        const __m512 b = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xdd);
        const __m512 c = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x88);
        const __m512 d = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xdd);
        r[m] = _mm512_shuffle_f32x4(a, c, 0x88);
        r[m + 8] = _mm512_shuffle_f32x4(a, c, 0xdd);
        r[m + 4] = _mm512_shuffle_f32x4(b, d, 0x88);
        r[m + 12] = _mm512_shuffle_f32x4(b, d, 0xdd);
    }
}

static inline __m512 load16(const void *base, int64_t offset, int dtype) {
    if (dtype == 1) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + offset));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + offset);
}

static void keys_t(const void *cache, int64_t kbase, int64_t vbase, int64_t stride, int64_t n,
                   int64_t D, int dtype, float *kt, float *vf) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) { /* keys: rows loaded whole, transposed in registers */
        __m512 r[16];
        for (int64_t j = 0; j < 16; j++)
            r[j] = j < n ? load16(cache, kbase + j * stride + d0, dtype) : _mm512_setzero_ps();
        transpose16(r);
        for (int64_t d = 0; d < 16; d++) _mm512_store_ps(kt + (d0 + d) * CHUNK, r[d]);
    }
    for (int64_t j = 0; j < n; j++)
        for (int64_t d = 0; d < D; d += 16)
            _mm512_store_ps(vf + j * D + d, load16(cache, vbase + j * stride + d, dtype));
}

static inline __m512 exp_nonpositive(__m512 x) { /* vexp.h; about 2 ulp; e^-87 below -87 */
    return exp_clamped(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)));
}

/* A row's running max m becomes max(m, new_max); its sum l and accumulator acc [D] are rescaled
 * to it. Returns the max. */
static inline float raise_max(float new_max, int64_t D, float *m, float *l, float *acc) {
    if (!(new_max > *m)) return *m; /* NaN included: as before, no rescale */
    const float c = *m == -INFINITY ? 0.0f : expf(*m - new_max);
    *l *= c;
    for (int64_t d = 0; d < D; d += 16)
        _mm512_store_ps(acc + d, _mm512_mul_ps(_mm512_load_ps(acc + d), _mm512_set1_ps(c)));
    *m = new_max;
    return new_max;
}

/* R query rows at once (R a constant after inlining: 4, 2 or 1), so each key and value vector
 * loaded serves R rows. Row g is qr + g * D, its state m[g], l[g], acc + g * D. */
static inline __attribute__((always_inline)) void softmax_rows(
    const int R, const float *qr, const float *kt, const float *vf, int64_t D, int64_t lo,
    int64_t hi, float softcap, float *m, float *l, float *acc) {
    __m512 sc[4], p[4];
    for (int g = 0; g < R; g++) sc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m512 k = _mm512_load_ps(kt + d * CHUNK);
        for (int g = 0; g < R; g++) sc[g] = _mm512_fmadd_ps(_mm512_set1_ps(qr[g * D + d]), k, sc[g]);
    }
    const __mmask16 valid = (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
    for (int g = 0; g < R; g++) {
        if (softcap > 0.0f) {
            float tmp[CHUNK];
            _mm512_storeu_ps(tmp, sc[g]);
            for (int64_t j = lo; j < hi; j++) tmp[j] = softcap * tanhf(tmp[j] / softcap);
            sc[g] = _mm512_loadu_ps(tmp);
        }
        const float mx = raise_max(_mm512_mask_reduce_max_ps(valid, sc[g]), D, m + g, l + g,
                                   acc + g * D);
        p[g] = _mm512_maskz_mov_ps(valid, exp_nonpositive(_mm512_sub_ps(sc[g], _mm512_set1_ps(mx))));
        l[g] += _mm512_reduce_add_ps(p[g]);
    }
    float pj[4][CHUNK];
    for (int g = 0; g < R; g++) _mm512_storeu_ps(pj[g], p[g]);
    for (int64_t d = 0; d < D; d += 16) {
        __m512 t[4];
        for (int g = 0; g < R; g++) t[g] = _mm512_load_ps(acc + g * D + d);
        for (int64_t j = lo; j < hi; j++) {
            const __m512 v = _mm512_load_ps(vf + j * D + d);
            for (int g = 0; g < R; g++) t[g] = _mm512_fmadd_ps(_mm512_set1_ps(pj[g][j]), v, t[g]);
        }
        for (int g = 0; g < R; g++) _mm512_store_ps(acc + g * D + d, t[g]);
    }
}

static void softmax(int64_t rows, const float *qr, const float *kt, const float *vf, int64_t D,
                    int64_t lo, int64_t hi, float softcap, float *m, float *l, float *acc) {
    int64_t g = 0;
    for (; g + 4 <= rows; g += 4)
        softmax_rows(4, qr + g * D, kt, vf, D, lo, hi, softcap, m + g, l + g, acc + g * D);
    if (g + 2 <= rows) {
        softmax_rows(2, qr + g * D, kt, vf, D, lo, hi, softcap, m + g, l + g, acc + g * D);
        g += 2;
    }
    if (g < rows) softmax_rows(1, qr + g * D, kt, vf, D, lo, hi, softcap, m + g, l + g, acc + g * D);
}

#if defined(__AVX512BF16__)
#define PAIRS_PATH 1
/* bfloat16 with AVX512-BF16 dot products (VDPBF16PS: 16 float32 lanes, each += a·b over a pair of
 * bfloat16): no conversion to float32, half the multiply-adds. Keys become transposed pairs
 * kp [D/2, CHUNK] (lane j: k_j[2p], k_j[2p + 1]); values pairs of consecutive keys interleaved by
 * dimension, vp [CHUNK/2, D/32, 2, 16] (lane: v_j[d], v_j+1[d]), which leaves each row's
 * accumulator in a permuted order ([D/32, 2, 16], see store_pairs_row); the probabilities are rounded
 * to bfloat16 before they weigh the values, as transformers' eager attention does. Its accuracy
 * against float64 matches transformers' bfloat16 (tests/model/test_goldens.py). */
static void keys_pairs(const uint16_t *k, int64_t stride, int64_t n, int64_t D, uint32_t *kp) {
    for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
        __m512 r[16];
        for (int64_t j = 0; j < 16; j++)
            r[j] = j < n ? _mm512_castsi512_ps(_mm512_loadu_si512(k + j * stride + 2 * p0))
                         : _mm512_setzero_ps();
        transpose16(r);
        for (int64_t p = 0; p < 16; p++) _mm512_store_ps((float *)kp + (p0 + p) * CHUNK, r[p]);
    }
}

static void values_pairs(const uint16_t *v, int64_t stride, int64_t n, int64_t D, uint32_t *vp) {
    const int64_t blocks = D / 32;
    for (int64_t jp = 0; jp < CHUNK / 2; jp++) {
        const int64_t j = 2 * jp;
        for (int64_t b = 0; b < blocks; b++) {
            const __m512i x = j < n ? _mm512_loadu_si512(v + j * stride + 32 * b) : _mm512_setzero_si512();
            const __m512i y = j + 1 < n ? _mm512_loadu_si512(v + (j + 1) * stride + 32 * b)
                                        : _mm512_setzero_si512();
            uint32_t *dst = vp + (jp * blocks + b) * 32;
            _mm512_store_si512(dst, _mm512_unpacklo_epi16(x, y));
            _mm512_store_si512(dst + 16, _mm512_unpackhi_epi16(x, y));
        }
    }
}

#define SEG 32 /* chunks per segment of the two-pass softmax (attend_pairs) */

/* Chunks of keys whose lines attend_pairs requests ahead of use. A chunk is usually a block of
 * its own (block size 16) somewhere in the pool, so the hardware's stride prefetchers meet each
 * one cold; decoding at the 0.5B shape with its KV in memory (24 layers × 16 sequences × 160
 * keys, two threads, AMD Zen 5) one chunk ahead took 4.8 → 4.2 ms, two 3.0, three and more no
 * better. (On the Intel box a prefetch of the next chunk had measured slower, cache hot or not.) */
#define AHEAD 2

/* Request the lines of head h's keys and values in the chunk starting at key c (of < kmax);
 * returns the next chunk's first key. */
static int64_t prefetch_pairs(const Args *a, const int64_t *table, int64_t h, int64_t c,
                              int64_t kmax) {
    const int64_t D = a->head_dim, bs = a->block_size, row_size = a->kv_heads * D;
    const int64_t cn = chunk_len(c, kmax, bs);
    const uint16_t *k = (const uint16_t *)a->cache + key_row(a, table, c);
    for (int64_t j = 0; j < cn; j++)
        for (int64_t kv = 0; kv < 2; kv++) { /* key j, then value j */
            const char *row = (const char *)(k + (kv * bs + j) * row_size + h * D);
            for (uintptr_t line = (uintptr_t)row & ~(uintptr_t)63; line < (uintptr_t)(row + 2 * D);
                 line += 64)
                __builtin_prefetch((const void *)line);
        }
    return c + cn;
}

static inline __m256i round_bf16(__m512 f) { /* f32_to_bf16 on 16 lanes */
    const __m512i u = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r =
        _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, quiet));
}

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
        _mm256_storeu_si256((__m256i *)(dst + b), round_bf16(_mm512_permutex2var_ps(x, first, y)));
        _mm256_storeu_si256((__m256i *)(dst + b + 16),
                            round_bf16(_mm512_permutex2var_ps(x, second, y)));
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
        ahead = prefetch_pairs(a, table, h, ahead, kmax);
    for (int64_t seg0 = kmin; seg0 < kmax;) {
        int64_t nc = 0, c0 = seg0;
        for (; c0 < kmax && nc < SEG; nc++) {
            const int64_t cn = chunk_len(c0, kmax, bs);
            const int64_t kbase = key_row(a, table, c0);
            if (ahead < kmax) ahead = prefetch_pairs(a, table, h, ahead, kmax);
            const uint16_t *kh = (const uint16_t *)a->cache + kbase + h * D;
            keys_pairs(kh, row_size, cn, D, s->kp);
            values_pairs(kh + bs * row_size, row_size, cn, D, s->vseg + nc * 8 * D);
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define AMX_PATH 1
#include "amx.h"

/* Decode and short drafts on AMX tiles: a work item's query rows (≤ 16, its queries × the group)
 * are the 16 columns of every tile product, so the keys go into tiles as they lie in the cache —
 * no transpose of the keys, which with its multiply-adds was the pairs path's cost (58-77 ns a
 * key and KV head from L2 at seven query heads on Sapphire Rapids; its 256 bytes of KV stream
 * in ~25 ns on one core).
 *   scores^T [16 keys, 16 rows] = K [16 keys, 32 dims] · Q^T, the keys tile-loaded from the
 *            cache where they lie (a row stride of every KV head), Q^T built once per item;
 *   softmax  per row = per lane: the max and the sum are lane-wise over key vectors, no
 *            reduction across lanes; the probabilities are transposed back per chunk and rounded
 *            to bfloat16 (as the pairs path and transformers' eager attention do);
 *   out [16 rows, D] += P [16 rows, 32 keys] · V, the values re-laid as pairs of keys per
 *            dimension (the B operand's layout), accumulated in tiles over a segment.
 * Two passes per segment of up to AMX_SEG chunks, like attend_pairs. */
#define AMX_SEG 16
#define AMX_MAX_D 128 /* Q^T in four tile registers at most */

typedef struct { /* attend_amx's buffers, one per work item's thread */
    uint32_t *bq;     /* [D / 32][16 pairs][16 rows] the queries as B tiles */
    float *scores;    /* [AMX_SEG][16][16]: a chunk's scores tile, then its rows' scores */
    __mmask16 *valid; /* [16 rows][AMX_SEG] keys each row reads in each chunk */
    uint16_t *pt;     /* [AMX_SEG / 2][16 rows][32 keys] probabilities as A tiles */
    uint16_t *vt;     /* [AMX_SEG / 2][D / 16][16 key pairs][16 dims × 2] values as B tiles */
    uint16_t *kb;     /* [16][D] a chunk's keys, where a tile load would read past its block */
    float *acc;       /* [16 rows][D] */
} AmxScratch;

static _Atomic int amx_on = -1; /* -1: not asked yet; 0: off; 1: on (the OS granted the tiles) */

/* want 1: use the tiles where the OS grants them; 0: never (the pairs path); -1: ask only.
 * Returns whether the tiles are in use. */
int kvtier_attention_amx(int want) {
    static _Atomic int granted = -1;
    if (granted < 0) granted = amx_granted();
    if (want >= 0) amx_on = want && granted;
    else if (amx_on < 0) amx_on = granted;
    return amx_on;
}

/* Lays attend_amx's buffers out from p (64-byte aligned; NULL: lays nothing out) and returns
 * the bytes they take. */
static size_t amx_scratch(char *p, int64_t D, AmxScratch *s) {
    size_t at = 0;
#define TAKE(field, bytes) \
    (p ? (void)(s->field = (void *)(p + at)) : (void)0, at += (((size_t)(bytes)) + 63) / 64 * 64)
    TAKE(bq, sizeof(uint32_t) * (size_t)(D / 32) * 256);
    TAKE(scores, sizeof(float) * AMX_SEG * 256);
    TAKE(valid, sizeof(__mmask16) * AMX_SEG * 16);
    TAKE(pt, 2 * (size_t)(AMX_SEG / 2) * 512);
    TAKE(vt, 2 * (size_t)(AMX_SEG / 2) * (D / 16) * 512);
    TAKE(kb, 2 * 16 * (size_t)D);
    TAKE(acc, sizeof(float) * 16 * (size_t)D);
#undef TAKE
    return at;
}

/* A chunk's values as rows of its P · V block's B tiles: the rows of key pairs (2jp, 2jp + 1),
 * jp < 8, of each 16 dimensions' tile (vt: the chunk's first row in the first tile; tiles 512
 * words apart), dimension by dimension the two keys' values; keys from cn on are zeros (a chunk
 * past the keys, cn 0, reads nothing). */
static inline void amx_values(const uint16_t *vh, int64_t row_size, int64_t cn, int64_t KB,
                              uint16_t *vt) {
    const __m512i lo = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003,
                                         0x00240004, 0x00250005, 0x00260006, 0x00270007,
                                         0x00280008, 0x00290009, 0x002a000a, 0x002b000b,
                                         0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16)); /* dims 16-31 */
    for (int64_t jp = 0; jp < 8; jp++) {
        const int64_t j = 2 * jp;
        for (int64_t b = 0; b < KB; b++) { /* 32 dimensions: two tiles' rows */
            const __m512i x =
                j < cn ? _mm512_loadu_si512(vh + j * row_size + 32 * b) : _mm512_setzero_si512();
            const __m512i y = j + 1 < cn ? _mm512_loadu_si512(vh + (j + 1) * row_size + 32 * b)
                                         : _mm512_setzero_si512();
            _mm512_store_si512(vt + (2 * b) * 512 + jp * 32, _mm512_permutex2var_epi16(x, lo, y));
            _mm512_store_si512(vt + (2 * b + 1) * 512 + jp * 32,
                               _mm512_permutex2var_epi16(x, hi, y));
        }
    }
}

/* Chunk nc's scores tile [16 keys][16 rows] (stored by attend_amx) becomes, in place, its first
 * `rows` rows' scores [rows][16 keys], scaled and soft-capped, with each row's valid keys. */
static inline void amx_rows(const Args *a, AmxScratch *s, int64_t nc, int64_t c0, int64_t cn,
                            int64_t rows, int64_t G, int64_t row0) {
    float *sc = s->scores + nc * 256;
    __m512 t[16];
    for (int64_t j = 0; j < 16; j++) t[j] = _mm512_load_ps(sc + j * 16);
    transpose16(t); /* t[r]: row r's scores of the chunk's keys */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t qi = r / G;
        const int64_t lo = a->lo[row0 + qi] > c0 ? a->lo[row0 + qi] - c0 : 0;
        const int64_t hi = a->hi[row0 + qi] < c0 + cn ? a->hi[row0 + qi] - c0 : cn;
        s->valid[r * AMX_SEG + nc] =
            lo < hi ? (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u)) : 0;
        __m512 x = _mm512_mul_ps(t[r], _mm512_set1_ps(a->scale));
        if (a->softcap > 0.0f) {
            float tmp[16];
            _mm512_storeu_ps(tmp, x);
            for (int j = 0; j < 16; j++) tmp[j] = a->softcap * tanhf(tmp[j] / a->softcap);
            x = _mm512_loadu_ps(tmp);
        }
        _mm512_store_ps(sc + r * 16, x);
    }
}

/* Scores^T of a chunk into tile C (tile registers are named in the instruction, so C is a
 * literal): K from src (rows `stride` bytes apart) in tiles 1 and 2 by turns, against Q^T in
 * tiles 4.., stored to sc. */
#define AMX_SCORES(C)                                                                              \
    do {                                                                                           \
        _tile_zero(C);                                                                             \
        _tile_loadd(1, src, stride);                                                               \
        _tile_dpbf16ps(C, 1, 4);                                                                   \
        if (KB > 1) {                                                                              \
            _tile_loadd(2, src + 32, stride);                                                      \
            _tile_dpbf16ps(C, 2, 5);                                                               \
        }                                                                                          \
        if (KB > 2) {                                                                              \
            _tile_loadd(1, src + 64, stride);                                                      \
            _tile_dpbf16ps(C, 1, 6);                                                               \
        }                                                                                          \
        if (KB > 3) {                                                                              \
            _tile_loadd(2, src + 96, stride);                                                      \
            _tile_dpbf16ps(C, 2, 7);                                                               \
        }                                                                                          \
        _tile_stored(C, sc, 64);                                                                   \
    } while (0)

/* One KV head of one sequence over its keys [kmin, kmax) for rows = nq × G ≤ 16 query rows
 * (ordered (query, g); q[row] points at each): writes the rows' unnormalized outputs to s->acc
 * [16][D] and their softmax sums to l [16]. */
static void attend_amx(const Args *a, const uint16_t *const *q, int64_t nq, int64_t G,
                       int64_t row0, const int64_t *table, int64_t h, int64_t kmin, int64_t kmax,
                       AmxScratch *s, float *l) {
    const int64_t D = a->head_dim, bs = a->block_size, row_size = a->kv_heads * D;
    const int64_t rows = nq * G, KB = D / 32, DB = D / 16;
    /* Columns of Q^T past `rows`, rows of P past `rows` and so those score columns and output
     * rows hold whatever was there: a product's row or column depends on its operands' alone,
     * and none of those is read */
    for (int64_t r = 0; r < rows; r++)
        for (int64_t p = 0; p < D / 2; p++) {
            uint32_t pair;
            memcpy(&pair, q[r] + 2 * p, 4);
            s->bq[(p / 16) * 256 + (p % 16) * 16 + r] = pair;
        }
    float m[16];
    for (int64_t r = 0; r < 16; r++) m[r] = -INFINITY, l[r] = 0.0f;
    memset(s->acc, 0, sizeof(float) * (size_t)(rows * D));
    int64_t ahead = kmin;
    for (int64_t i = 0; i < AHEAD && ahead < kmax; i++)
        ahead = prefetch_pairs(a, table, h, ahead, kmax);
    for (int64_t seg0 = kmin; seg0 < kmax;) {
        /* every chunk of the segment: its scores, transposed to one row per query row; its
         * values as B tiles */
        _tile_loadd(4, s->bq, 64);
        if (KB > 1) _tile_loadd(5, s->bq + 256, 64);
        if (KB > 2) _tile_loadd(6, s->bq + 512, 64);
        if (KB > 3) _tile_loadd(7, s->bq + 768, 64);
        int64_t nc = 0, c0 = seg0, c0s[AMX_SEG], cns[AMX_SEG];
        for (; c0 < kmax && nc < AMX_SEG; nc++) {
            const int64_t cn = chunk_len(c0, kmax, bs);
            const int64_t kbase = key_row(a, table, c0);
            if (ahead < kmax) ahead = prefetch_pairs(a, table, h, ahead, kmax);
            const uint16_t *kh = (const uint16_t *)a->cache + kbase + h * D;
            const uint16_t *src = kh;
            int64_t stride = row_size * 2;
            if (c0 % bs + 16 > bs) { /* the tile's 16 rows would leave the block's keys */
                for (int64_t j = 0; j < cn; j++)
                    memcpy(s->kb + j * D, kh + j * row_size, 2 * (size_t)D);
                src = s->kb, stride = 2 * D;
            }
            float *sc = s->scores + nc * 256;
            if (nc % 2 == 0) /* two score tiles in turn: a chunk's product need not wait for
                                the previous chunk's store */
                AMX_SCORES(0);
            else
                AMX_SCORES(3);
            const uint16_t *vh = kh + bs * row_size;
            uint16_t *vt = s->vt + (nc / 2) * DB * 512 + (nc % 2) * 8 * 32;
            amx_values(vh, row_size, cn, KB, vt);
            if (nc > 0) /* the previous chunk's scores, its tile stored by now */
                amx_rows(a, s, nc - 1, c0s[nc - 1], cns[nc - 1], rows, G, row0);
            c0s[nc] = c0, cns[nc] = cn;
            c0 += cn;
        }
        amx_rows(a, s, nc - 1, c0s[nc - 1], cns[nc - 1], rows, G, row0);
        if (nc % 2) { /* a P · V block takes two chunks: the last one's partner has no keys */
            amx_values(NULL, 0, 0, KB, s->vt + (nc / 2) * DB * 512 + 8 * 32);
            for (int64_t r = 0; r < rows; r++) s->valid[r * AMX_SEG + nc] = 0;
        }
        for (int64_t r = 0; r < rows; r++) { /* max, exponentials and sum of the segment */
            const __mmask16 *vr = s->valid + r * AMX_SEG;
            __m512 vmax = _mm512_set1_ps(-INFINITY);
            for (int64_t c = 0; c < nc; c++)
                vmax = _mm512_mask_max_ps(vmax, vr[c], vmax,
                                          _mm512_load_ps(s->scores + c * 256 + r * 16));
            const __m512 mx = _mm512_set1_ps(
                raise_max(_mm512_reduce_max_ps(vmax), D, m + r, l + r, s->acc + r * D));
            __m512 sum = _mm512_setzero_ps();
            for (int64_t c = 0; c < nc + nc % 2; c++) {
                const __m512 e = _mm512_maskz_mov_ps(
                    vr[c], exp_nonpositive(
                               _mm512_sub_ps(_mm512_load_ps(s->scores + c * 256 + r * 16), mx)));
                sum = _mm512_add_ps(sum, e);
                const __m256bh eb = _mm512_cvtneps_pbh(e);
                memcpy(s->pt + (c / 2) * 512 + r * 32 + (c % 2) * 16, &eb, sizeof(eb));
            }
            l[r] += _mm512_reduce_add_ps(sum);
        }
        /* out += P · V, four tiles of 16 dimensions at a time */
        const int64_t nb = (nc + 1) / 2;
        for (int64_t dg = 0; dg < DB; dg += 4) {
            const int64_t tiles = DB - dg < 4 ? DB - dg : 4;
            float *acc = s->acc + dg * 16;
            const int64_t acc_stride = 4 * D;
            _tile_loadd(4, acc, acc_stride);
            if (tiles > 1) _tile_loadd(5, acc + 16, acc_stride);
            if (tiles > 2) _tile_loadd(6, acc + 32, acc_stride);
            if (tiles > 3) _tile_loadd(7, acc + 48, acc_stride);
            for (int64_t b = 0; b < nb; b++) {
                const uint16_t *vt = s->vt + (b * DB + dg) * 512;
                _tile_loadd(0, s->pt + b * 512, 64);
                _tile_loadd(1, vt, 64);
                _tile_dpbf16ps(4, 0, 1);
                if (tiles > 1) {
                    _tile_loadd(2, vt + 512, 64);
                    _tile_dpbf16ps(5, 0, 2);
                }
                if (tiles > 2) {
                    _tile_loadd(3, vt + 1024, 64);
                    _tile_dpbf16ps(6, 0, 3);
                }
                if (tiles > 3) {
                    _tile_loadd(1, vt + 1536, 64);
                    _tile_dpbf16ps(7, 0, 1);
                }
            }
            _tile_stored(4, acc, acc_stride);
            if (tiles > 1) _tile_stored(5, acc + 16, acc_stride);
            if (tiles > 2) _tile_stored(6, acc + 32, acc_stride);
            if (tiles > 3) _tile_stored(7, acc + 48, acc_stride);
        }
        seg0 = c0;
    }
}

/* A row of the output: acc × inv rounded to bfloat16 (f32_to_bf16's bits), natural order */
static void store_row(const float *acc, float inv, int64_t D, uint16_t *dst) {
    for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256((__m256i *)(dst + d),
                            round_bf16(_mm512_mul_ps(_mm512_load_ps(acc + d), _mm512_set1_ps(inv))));
}
#endif
#endif
#else
static void keys_t(const void *cache, int64_t kbase, int64_t vbase, int64_t stride, int64_t n,
                   int64_t D, int dtype, float *kt, float *vf) {
    float row[512];
    for (int64_t j = 0; j < CHUNK; j++) {
        if (j >= n) {
            for (int64_t d = 0; d < D; d++) kt[d * CHUNK + j] = 0.0f;
            continue;
        }
        load_row(cache, kbase + j * stride, D, dtype, row);
        for (int64_t d = 0; d < D; d++) kt[d * CHUNK + j] = row[d];
        load_row(cache, vbase + j * stride, D, dtype, vf + j * D);
    }
}

static inline float exp_nonpositive(float x) { /* about 2 ulp; 0 below -87 */
    if (x < -87.0f) return 0.0f;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return ldexpf(p * r * r + r + 1.0f, (int)n);
}

static void softmax_row(const float *qr, const float *kt, const float *vf, int64_t D, int64_t lo,
                        int64_t hi, float softcap, float *m, float *l, float *acc) {
    float sc[CHUNK] = {0};
    for (int64_t d = 0; d < D; d++)
        for (int j = 0; j < CHUNK; j++) sc[j] += qr[d] * kt[d * CHUNK + j];
    float mx = *m;
    for (int64_t j = lo; j < hi; j++) {
        if (softcap > 0.0f) sc[j] = softcap * tanhf(sc[j] / softcap);
        mx = sc[j] > mx ? sc[j] : mx;
    }
    if (mx > *m) {
        const float c = *m == -INFINITY ? 0.0f : expf(*m - mx);
        *l *= c;
        for (int64_t d = 0; d < D; d++) acc[d] *= c;
        *m = mx;
    }
    for (int64_t j = lo; j < hi; j++) {
        const float p = exp_nonpositive(sc[j] - mx);
        *l += p;
        for (int64_t d = 0; d < D; d++) acc[d] += p * vf[j * D + d];
    }
}

static void softmax(int64_t rows, const float *qr, const float *kt, const float *vf, int64_t D,
                    int64_t lo, int64_t hi, float softcap, float *m, float *l, float *acc) {
    for (int64_t g = 0; g < rows; g++)
        softmax_row(qr + g * D, kt, vf, D, lo, hi, softcap, m + g, l + g, acc + g * D);
}
#endif

/* Work item w = one sequence, every KV head: its keys are read as whole contiguous rows
 * [kv_heads, head_dim] of each block, which the hardware prefetchers follow. */
static int64_t block_queries(const Args *a, const int64_t *item) {
    const int64_t left = a->seq_qlen[item[0]] - item[2];
    return left < QBLOCK ? left : QBLOCK;
}

static void run(Args *a) {
    const int64_t D = a->head_dim, bs = a->block_size, kvh = a->kv_heads;
    const int64_t G = a->num_heads / kvh, size = a->dtype == 1 ? 2 : 4;
    int64_t max_rows = 0;
    for (int64_t w = a->begin; w < a->end; w++) {
        const int64_t rows = block_queries(a, a->items + 3 * w) * G;
        if (rows > max_rows) max_rows = rows;
    }
    a->status = 0;
    if (max_rows == 0) return;
#if defined(PAIRS_PATH)
    const int pairs = a->dtype == 1 && D % 32 == 0;
#else
    const int pairs = 0;
#endif
    /* qf, acc: [queries, G, D] of one KV head; kt: [D, CHUNK]; vf: [CHUNK, D]; m, l: [rows];
     * the pairs path: its Scratch after them */
    const size_t floats = (size_t)(2 * max_rows * D + 2 * CHUNK * D + 2 * max_rows);
#if defined(PAIRS_PATH)
    const size_t pair_words =
        pairs ? (size_t)(SEG * 8 * D + max_rows * SEG * (CHUNK + CHUNK / 2 + 1)) : 0;
#else
    const size_t pair_words = 0;
#endif
    float *buf = NULL;
    if (posix_memalign((void **)&buf, 64, sizeof(float) * (floats + 16 + pair_words)) != 0) {
        a->status = -1;
        return;
    }
    float *qf = buf, *acc = qf + max_rows * D, *kt = acc + max_rows * D, *vf = kt + CHUNK * D;
    float *m = vf + CHUNK * D, *l = m + max_rows;
#if defined(AMX_PATH)
    const int amx = pairs && a->amx && D <= AMX_MAX_D;
    AmxScratch amx_s = {0};
    char *amx_buf = NULL; /* allocated and the tiles configured at this call's first such item */
#endif
#if defined(PAIRS_PATH)
    Scratch scratch = {0};
    if (pairs) {
        float *p = buf + ((floats + 15) / 16) * 16; /* 64-byte aligned */
        scratch.kp = (uint32_t *)kt;
        scratch.vseg = (uint32_t *)p;
        scratch.scores = p + SEG * 8 * D;
        scratch.pp = (uint32_t *)(scratch.scores + max_rows * SEG * CHUNK);
        scratch.valid = (__mmask16 *)(scratch.pp + max_rows * SEG * (CHUNK / 2));
    }
#endif
    for (int64_t w = a->begin; w < a->end; w++) {
        const int64_t *item = a->items + 3 * w;
        const int64_t seq = item[0], h = item[1], q0 = item[2];
        const int64_t nq = block_queries(a, item);
        const int64_t tok0 = a->seq_token[seq] + q0, row0 = a->seq_row[seq] + q0;
        const int64_t rows = nq * G; /* ordered (query, g) */
        int64_t kmin = INT64_MAX, kmax = 0;
        for (int64_t j = 0; j < nq; j++) {
            if (a->lo[row0 + j] < kmin) kmin = a->lo[row0 + j];
            if (a->hi[row0 + j] > kmax) kmax = a->hi[row0 + j];
        }
        for (int64_t j = 0; j < nq && !pairs; j++) /* the pairs path reads q where it is */
            for (int64_t g = 0; g < G; g++) {
                float *qr = qf + (j * G + g) * D;
                load_row(a->q, (tok0 + j) * a->q_stride + (h * G + g) * D, D, a->dtype, qr);
                for (int64_t d = 0; d < D; d++) qr[d] *= a->scale;
            }
        memset(acc, 0, sizeof(float) * (size_t)(rows * D));
        for (int64_t r = 0; r < rows; r++) {
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }
        const int64_t *table = a->tables + seq * a->table_stride;
        const int64_t row_size = kvh * D; /* elements of one key (every head) */
#if defined(PAIRS_PATH)
        if (pairs) {
            const uint16_t *qrows[rows];
            for (int64_t j = 0; j < nq; j++)
                for (int64_t g = 0; g < G; g++)
                    qrows[j * G + g] =
                        (const uint16_t *)a->q + (tok0 + j) * a->q_stride + (h * G + g) * D;
#if defined(AMX_PATH)
            if (amx && rows <= 16) {
                if (!amx_buf) {
                    if (posix_memalign((void **)&amx_buf, 64, amx_scratch(NULL, D, &amx_s))) {
                        a->status = -1;
                        break;
                    }
                    amx_scratch(amx_buf, D, &amx_s);
                    static const uint8_t tiles[8] = {16, 16, 16, 16, 16, 16, 16, 16};
                    amx_configure(tiles);
                }
                float sums[16];
                attend_amx(a, qrows, nq, G, row0, table, h, kmin, kmax, &amx_s, sums);
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t qi = r / G, g = r % G;
                    const int64_t o = ((tok0 + qi) * a->num_heads + h * G + g) * D;
                    store_row(amx_s.acc + r * D, sums[r] > 0.0f ? 1.0f / sums[r] : 0.0f, D,
                              (uint16_t *)a->out + o);
                }
                continue;
            }
#endif
            attend_pairs(a, qrows, nq, G, row0, table, h, kmin, kmax, &scratch, m, l, acc);
        }
#endif
        for (int64_t c0 = kmin; c0 < kmax && !pairs;) { /* chunks of keys within one block */
            const int64_t cn = chunk_len(c0, kmax, bs);
            const int64_t kbase = key_row(a, table, c0);
            if (c0 + cn < kmax) { /* the next chunk's lines, while this one computes */
                const int64_t n1 = c0 + cn, cn1 = chunk_len(n1, kmax, bs);
                const int64_t k1 = key_row(a, table, n1);
                prefetch_chunk((const char *)a->cache + k1 * size, cn1 * row_size * size,
                               bs * row_size * size);
            }
            keys_t(a->cache, kbase + h * D, kbase + bs * row_size + h * D, row_size, cn, D,
                   a->dtype, kt, vf);
            for (int64_t qi = 0; qi < nq; qi++) {
                const int64_t lo = a->lo[row0 + qi] > c0 ? a->lo[row0 + qi] - c0 : 0;
                const int64_t hi = a->hi[row0 + qi] < c0 + cn ? a->hi[row0 + qi] - c0 : cn;
                if (lo >= hi) continue;
                const int64_t r = qi * G; /* the query's G rows */
                softmax(G, qf + r * D, kt, vf, D, lo, hi, a->softcap, m + r, l + r, acc + r * D);
            }
            c0 += cn;
        }
        for (int64_t qi = 0; qi < nq; qi++)
            for (int64_t g = 0; g < G; g++) {
                const int64_t r = qi * G + g;
                const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
                const int64_t o = ((tok0 + qi) * a->num_heads + h * G + g) * D;
#if defined(PAIRS_PATH)
                if (pairs) {
                    store_pairs_row(acc + r * D, inv, D, (uint16_t *)a->out + o);
                    continue;
                }
#endif
                if (a->dtype == 1) {
                    uint16_t *dst = (uint16_t *)a->out + o;
                    for (int64_t d = 0; d < D; d++) dst[d] = f32_to_bf16(acc[r * D + d] * inv);
                } else {
                    float *dst = (float *)a->out + o;
                    for (int64_t d = 0; d < D; d++) dst[d] = acc[r * D + d] * inv;
                }
            }
    }
#if defined(AMX_PATH)
    if (amx_buf) _tile_release();
    free(amx_buf);
#endif
    free(buf);
}

typedef struct {
    Args base;
    _Atomic int status;
} Job;

static void run_chunk(const void *ctx, int64_t begin, int64_t end) { /* items [begin, end) */
    Job *job = (Job *)ctx;
    Args a = job->base;
    a.begin = begin;
    a.end = end;
    run(&a);
    if (a.status) atomic_store(&job->status, a.status);
}

/* Returns 0, or -1 when scratch memory could not be allocated (out is then incomplete). */
int kvtier_paged_attention(const void *q, int64_t q_stride, const void *cache, void *out,
                           const int64_t *tables, int64_t table_stride, const int64_t *seq_token,
                           const int64_t *seq_qlen, const int64_t *seq_row, const int64_t *lo,
                           const int64_t *hi, int64_t num_seqs, int64_t num_heads,
                           int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                           float softcap, int dtype, int num_threads) {
    int64_t items = 0, keys = 0; /* work items; the work: keys read, summed over sequences */
    for (int64_t i = 0; i < num_seqs; i++)
        if (seq_qlen[i] > 0) {
            items += kv_heads * ((seq_qlen[i] + QBLOCK - 1) / QBLOCK);
            keys += hi[seq_row[i] + seq_qlen[i] - 1] - lo[seq_row[i]];
        }
    if (items == 0) return 0;
    int64_t *table = malloc(sizeof(int64_t) * 3 * (size_t)items);
    if (!table) return -1;
    int64_t w = 0;
    for (int64_t i = 0; i < num_seqs; i++) /* sequence-major: a thread's items share its keys */
        for (int64_t h = 0; h < kv_heads; h++)
            for (int64_t q0 = 0; q0 < seq_qlen[i]; q0 += QBLOCK) {
                table[3 * w] = i;
                table[3 * w + 1] = h;
                table[3 * w + 2] = q0;
                w++;
            }
    if (keys * kv_heads * head_dim < (1 << 17)) num_threads = 1; /* waking a helper costs more */
    if (num_threads < 1) num_threads = 1;
    if (num_threads > items) num_threads = (int)items;
    Job job = {{q,        q_stride, cache,   out,        tables,     table_stride, seq_token,
                seq_qlen, seq_row,  lo,      hi,         num_heads,  kv_heads,     head_dim,
                block_size, scale,  softcap, dtype,      table,      0,            items,
                0,        0},
               0};
#if defined(AMX_PATH)
    job.base.amx = kvtier_attention_amx(-1);
#endif
    /* chunks of a quarter of a thread's share: sequences differ in length */
    pool_run(run_chunk, &job, items, items / (4 * num_threads), num_threads);
    free(table);
    return atomic_load(&job.status);
}
