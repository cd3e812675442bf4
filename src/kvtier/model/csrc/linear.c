/* bfloat16 linear layers for few rows: out [M, N] = x [M, K] · W [N, K]ᵀ (+ bias), float32
 * accumulation over k in order, rounded to bfloat16 once (round to nearest even), as oneDNN's
 * bf16 matmul. oneDNN's call costs 10–40 µs before it multiplies anything at the small models'
 * shapes (its primitive set-up per call); these kernels need a few µs for the same products
 * there. At the end of the file, float32 linear layers (their own comment). Built and loaded by
 * kvtier/model/native.py; plain C, no Python or torch headers.
 *
 * Weights are packed once into 16 × 32 tiles in the pair layout TDPBF16PS reads: tile (nb, kb) is
 * 16 rows of k pairs (2r, 2r + 1) by 16 output columns, [Nb][Kb][16][16][2], zero past N and K.
 * The same layout serves both instruction sets: on AMX a tile is one TDPBF16PS operand; with
 * AVX512-BF16 only (AMD Zen 4/5, Intel Cooper Lake) a tile row is one 512-bit VDPBF16PS operand
 * (16 columns' pair r), multiplied by a row's pair r broadcast. Either way each output sums its
 * k pairs in order into one float32 accumulator.
 * Output columns are split in groups of four tiles among the pool's threads (pool.h): each
 * element is computed by one thread in one order, so results do not depend on the thread count.
 * `kvtier_linear_available` returns 1 (AMX, granted by the OS), 2 (AVX512-BF16) or 0 (neither:
 * the caller uses oneDNN).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

void kvtier_linear_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed) {
    const int64_t nbs = (n + 15) / 16, kbs = (k + 31) / 32;
    for (int64_t nb = 0; nb < nbs; nb++)
        for (int64_t kb = 0; kb < kbs; kb++) {
            uint16_t *tile = packed + (nb * kbs + kb) * 512;
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++)
                    for (int e = 0; e < 2; e++) {
                        const int64_t col = nb * 16 + c, kk = kb * 32 + 2 * r + e;
                        tile[(r * 16 + c) * 2 + e] = col < n && kk < k ? w[col * k + kk] : 0;
                    }
        }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

typedef struct {
    const uint16_t *x, *packed, *bias, *tail; /* tail: x's last k block, zero padded [m][32] */
    uint16_t *out;
    int64_t m, n, k, x_stride;
    int tiles, rows; /* 16-column tiles per column group, rows per block (avx_groups) */
    int64_t groups, chunk_rows; /* column groups; rows per row chunk (an item: see kvtier_linear) */
} Job;

/* item `item` of a call (kvtier_linear): column group *g of the rows [*r0, *r1) */
static inline void item_span(const Job *a, int64_t item, int64_t *g, int64_t *r0, int64_t *r1) {
    *g = item % a->groups;
    *r0 = item / a->groups * a->chunk_rows;
    *r1 = *r0 + a->chunk_rows < a->m ? *r0 + a->chunk_rows : a->m;
}

static void store(const Job *a, const float *acc, int64_t m0, int rows, int64_t n0) {
    const int cols = a->n - n0 < 16 ? (int)(a->n - n0) : 16;
    const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
    __m512 b = _mm512_setzero_ps();
    if (a->bias)
        b = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, a->bias + n0)), 16));
    for (int r = 0; r < rows; r++) {
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(acc + r * 16), b));
        _mm256_mask_storeu_epi16(a->out + (m0 + r) * a->n + n0, mask, h);
    }
}

/* k block kb of x's row `row`: its 32 bf16, from x or the zero-padded tail */
static inline const uint16_t *x_block(const Job *a, int64_t row, int64_t kb, int64_t full) {
    return kb < full ? a->x + row * a->x_stride + kb * 32 : a->tail + row * 32;
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include "amx.h"

/* tiles 0–3: accumulators (rows × 16 float32); 4: x rows × 32 bf16; 5, 6: weight tiles */
static void configure(int rows) {
    const uint8_t r = (uint8_t)rows, tiles[8] = {r, r, r, r, r, 16, 16, 0};
    amx_configure(tiles);
}

#define AMX_AHEAD 8 /* k blocks ahead the first row block prefetches its weight tiles into L1 */

/* items [i0, i1) (kvtier_linear): a column group of four 16-column tiles by a chunk of rows, every
 * row block of 16. The first row block streams the group's weights from memory and prefetches
 * each tile AMX_AHEAD k blocks ahead (likely more misses in flight than the hardware prefetcher
 * keeps: one thread on the 0.5B shape's weights −10 … −15 % at one row, −2 … −9 % at 16, paired
 * runs on Sapphire Rapids); the other row blocks find the tiles in L2, where prefetching them
 * again cost 12–14 %. */
static void amx_groups(const void *ctx, int64_t i0, int64_t i1) {
    const Job *a = (const Job *)ctx;
    const int64_t nbs = (a->n + 15) / 16, kbs = (a->k + 31) / 32, full = a->k / 32;
    float acc[4][256] __attribute__((aligned(64)));
    int configured = 0;
    for (int64_t item = i0; item < i1; item++) {
        int64_t g, r0, r1;
        item_span(a, item, &g, &r0, &r1);
        const int64_t nb0 = g * 4;
        const int tiles = nbs - nb0 < 4 ? (int)(nbs - nb0) : 4;
        const uint16_t *w = a->packed + nb0 * kbs * 512;
        for (int64_t m0 = r0; m0 < r1; m0 += 16) {
            const int rows = r1 - m0 < 16 ? (int)(r1 - m0) : 16;
            if (rows != configured) {
                configure(rows);
                configured = rows;
            }
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < kbs; kb++) {
                if (kb < full)
                    _tile_loadd(4, a->x + m0 * a->x_stride + kb * 32, a->x_stride * 2);
                else
                    _tile_loadd(4, a->tail + m0 * 32, 64);
                const uint16_t *b = w + kb * 512;
                if (m0 == 0 && kb + AMX_AHEAD < kbs)
                    for (int t = 0; t < tiles; t++)
                        for (int line = 0; line < 16; line++)
                            _mm_prefetch((const char *)(b + (t * kbs + AMX_AHEAD) * 512) + line * 64,
                                         _MM_HINT_T0);
                _tile_loadd(5, b, 64);
                _tile_dpbf16ps(0, 4, 5);
                if (tiles > 1) {
                    _tile_loadd(6, b + kbs * 512, 64);
                    _tile_dpbf16ps(1, 4, 6);
                }
                if (tiles > 2) {
                    _tile_loadd(5, b + 2 * kbs * 512, 64);
                    _tile_dpbf16ps(2, 4, 5);
                }
                if (tiles > 3) {
                    _tile_loadd(6, b + 3 * kbs * 512, 64);
                    _tile_dpbf16ps(3, 4, 6);
                }
            }
            _tile_stored(0, acc[0], 64);
            if (tiles > 1) _tile_stored(1, acc[1], 64);
            if (tiles > 2) _tile_stored(2, acc[2], 64);
            if (tiles > 3) _tile_stored(3, acc[3], 64);
            for (int t = 0; t < tiles; t++) store(a, acc[t], m0, rows, (nb0 + t) * 16);
        }
    }
    if (configured) _tile_release();
}

#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* rows [m0, m0 + R) by T column tiles: R × T float32 accumulators in registers; per k pair, each
 * tile's row (16 columns' pair) is loaded once and multiplied by every row's pair broadcast */
static inline __attribute__((always_inline)) void avx_block(const Job *a, const uint16_t *w,
                                                             int64_t m0, int64_t nb0, const char *pf,
                                                             int64_t pf_lines, const int R,
                                                             const int T) {
    const int64_t kbs = (a->k + 31) / 32, full = a->k / 32;
    __m512 acc[8][4];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[i][t] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < kbs; kb++) {
        for (int64_t l = kb * pf_lines / kbs; l < (kb + 1) * pf_lines / kbs; l++)
            _mm_prefetch(pf + l * 64, _MM_HINT_T1);
        const uint16_t *xs[8];
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) xs[i] = x_block(a, m0 + i, kb, full);
        const uint16_t *b = w + kb * 512;
#pragma GCC unroll 1 /* unrolled, GCC hoists every pair's broadcasts out and spills them */
        for (int r = 0; r < 16; r++) {
            __m512bh wt[4];
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
                wt[t] = (__m512bh)_mm512_loadu_si512(b + t * kbs * 512 + r * 32);
#pragma GCC unroll 8
            for (int i = 0; i < R; i++) {
                int32_t pair;
                memcpy(&pair, xs[i] + 2 * r, sizeof pair);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], xb, wt[t]);
            }
        }
    }
    float out[4][8 * 16] __attribute__((aligned(64)));
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < R; i++) _mm512_store_ps(out[t] + i * 16, acc[i][t]);
        store(a, out[t], m0, R, (nb0 + t) * 16);
    }
}

#define AVX_PREFETCH_MAX (256 << 10) /* a next group's bytes prefetched into L2, at most */
#define AVX_CASE(R, T)                                     \
    case (R) * 8 + (T):                                    \
        avx_block(a, w, m0, nb0, pf, pf_lines, (R), (T));  \
        break;
#define AVX_CASES3(R) AVX_CASE(R, 1) AVX_CASE(R, 2) AVX_CASE(R, 3)
#define AVX_CASES(R) AVX_CASES3(R) AVX_CASE(R, 4)

/* output column groups [g0, g1) of a->tiles 16-column tiles, every row block of a->rows. The
 * first row block streams the group's weights from memory; the others read them from L2 and are
 * bound by arithmetic. Every block prefetches a share of the next group's weights into L2, which
 * its first block then finds there: memory and arithmetic overlap instead of taking turns (a
 * batch of 7-64 rows on weights that do not fit the cache). Shares in the later blocks only:
 * −5 … −10 % at 32–64 rows on the 0.5B shape's 96 linears, none at 16; in every block, the
 * first too (its demand misses and the prefetches share the memory queue): another −6 … −15 %
 * at 16–32 rows, −4 … −6 % at 64. */
static void avx_groups(const void *ctx, int64_t i0, int64_t i1) {
    const Job *a = (const Job *)ctx;
    const int64_t nbs = (a->n + 15) / 16, kbs = (a->k + 31) / 32;
    const int64_t T = a->tiles, R = a->rows;
    for (int64_t item = i0; item < i1; item++) {
        int64_t g, r0, r1;
        item_span(a, item, &g, &r0, &r1);
        const int64_t nb0 = g * T, blocks = (r1 - r0 + R - 1) / R;
        const int tiles = nbs - nb0 < T ? (int)(nbs - nb0) : (int)T;
        const uint16_t *w = a->packed + nb0 * kbs * 512;
        const int64_t next_tiles =
            item + 1 < i1 && g + 1 < a->groups ? (nbs - nb0 - T < T ? nbs - nb0 - T : T) : 0;
        const int64_t next_bytes = next_tiles * kbs * 1024;
        const int prefetch = blocks > 1 && next_bytes > 0 && next_bytes <= AVX_PREFETCH_MAX;
        const int64_t share = prefetch ? (next_bytes / 64 + blocks - 1) / blocks : 0;
        for (int64_t m0 = r0; m0 < r1; m0 += R) {
            const int rows = r1 - m0 < R ? (int)(r1 - m0) : (int)R;
            const int64_t j = (m0 - r0) / R, first = j * share;
            const char *pf = (const char *)(w + tiles * kbs * 512) + first * 64;
            int64_t pf_lines = 0;
            if (prefetch && first < next_bytes / 64)
                pf_lines = first + share <= next_bytes / 64 ? share : next_bytes / 64 - first;
            switch (rows * 8 + tiles) {
                AVX_CASES(1) AVX_CASES(2) AVX_CASES(3) AVX_CASES(4) AVX_CASES(5) AVX_CASES(6)
                AVX_CASES3(7) AVX_CASES3(8) /* 8 × 4 accumulators would not fit 32 registers */
            }
        }
    }
}

#define CHUNK_X (256 << 10)    /* bytes of x in a row chunk, at most (kvtier_linear) */
#define CHUNK_WEIGHT (1 << 20) /* bytes of a weight whose rows are chunked, at most */

static ChunkFn groups_fn; /* set by kvtier_linear_available: AMX's or AVX512-BF16's */

int kvtier_linear_available(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
    if (amx_granted()) {
        groups_fn = amx_groups;
        return 1;
    }
#endif
    groups_fn = avx_groups;
    return 2;
}

/* x [m, k] bf16 rows `x_stride` apart; packed by kvtier_linear_pack; out [m, n] contiguous.
 * Call kvtier_linear_available first. Returns 0, or -1 when the scratch for x's last partial k
 * block could not be allocated. */
int kvtier_linear(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                  int64_t n, int64_t k, const uint16_t *bias, uint16_t *out, int threads) {
    uint16_t *tail = NULL;
    if (k % 32) {
        tail = calloc((size_t)(m * 32), sizeof(uint16_t));
        if (!tail) return -1;
        for (int64_t r = 0; r < m; r++)
            memcpy(tail + r * 32, x + r * x_stride + (k / 32) * 32, (size_t)(k % 32) * 2);
    }
    /* 6 rows by 4 tiles a block (24 accumulators), but 7-16 rows in one or two blocks of at most 8
     * by 3 tiles: 16 rows as 8 + 8 read each weight twice, as 6 + 6 + 4 three times, the first
     * pass from memory and the others from L2 (the 0.5B shape's 96 linears at 16 rows −6 %, at 8
     * −3 %; at 4, 32 and 64 rows 4 tiles were as fast or faster). AMX: 16 rows by 4 tiles. */
    int tiles = 4, rows = 6;
    if (groups_fn == avx_groups && m > 6 && m <= 16) {
        tiles = 3;
        rows = m > 8 ? (int)(m + 1) / 2 : (int)m;
    }
    /* an item: a column group by a chunk of rows. On a weight that stays in L2 (CHUNK_WEIGHT), a
     * chunk's x fits there with it (CHUNK_X), and the chunks run one after another, so each group
     * re-reads the chunk's x from L2 instead of streaming all of x again: the small models' linears
     * at 1,024-8,192 rows 0.54-0.89x the time in one chunk (AMX, paired). A larger weight is read
     * once per chunk from memory, so it keeps all rows in one. */
    const int64_t groups = ((n + 15) / 16 + tiles - 1) / tiles;
    int64_t chunk_rows = m;
    if (n * k * 2 <= CHUNK_WEIGHT && m * k * 2 > CHUNK_X) {
        chunk_rows = CHUNK_X / (k * 2) / 16 * 16;
        if (chunk_rows < 16) chunk_rows = 16;
    }
    const int64_t items = groups * ((m + chunk_rows - 1) / chunk_rows);
    const Job job = {x, packed, bias, tail, out, m, n, k, x_stride, tiles, rows, groups, chunk_rows};
    /* multiply-adds: below 512K (a 1 MiB weight at one row, ~40 µs from memory on one core) a
     * helper saves less than it costs; 2M while the helpers slept between calls (pool.c) */
    const int64_t work = m * n * k;
    pool_run(groups_fn, &job, items, items / (4 * threads), work < (1 << 19) ? 1 : threads);
    free(tail);
    return 0;
}
#else
int kvtier_linear_available(void) { return 0; }
#endif

/* float32 linears at any row count, on AVX-512F: out [M, N] = x [M, K] · W [N, K]ᵀ (+ bias), each
 * output one fused multiply-add chain over k in order, the bias added once at the end. Not for
 * speed first but for batch invariance: oneDNN's and MKL's float32 GEMMs pick their kernels and
 * summation orders by the row count (on AMD Zen 5, 1 or 3 rows differ from 8 or more in up to a
 * third of the outputs), so a request's logits — and a seeded sample — would depend on what else
 * is in its batch. Here a row's bits depend only on the row. The weight is packed once as
 * [Nb][K][16] (16 output columns a vector, zero past N); rows in blocks of F32_ROWS against
 * four column vectors, output column groups on the pool as above. */
#if defined(__AVX512F__)
#include <immintrin.h>

#define F32_ROWS 6 /* 6 × 4 accumulators, 4 weight vectors and a broadcast: 29 of 32 registers */

void kvtier_linear_f32_pack(const float *w, int64_t n, int64_t k, float *packed) {
    const int64_t nbs = (n + 15) / 16;
    for (int64_t nb = 0; nb < nbs; nb++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int c = 0; c < 16; c++) {
                const int64_t col = nb * 16 + c;
                packed[(nb * k + kk) * 16 + c] = col < n ? w[col * k + kk] : 0.0f;
            }
}

typedef struct {
    const float *x, *packed, *bias;
    float *out;
    int64_t m, n, k, x_stride;
} JobF32;

static inline __attribute__((always_inline)) void f32_block(const JobF32 *a, const float *w,
                                                             int64_t m0, int64_t nb0, const int R,
                                                             const int T) {
    const int64_t k = a->k;
    __m512 acc[F32_ROWS][4];
#pragma GCC unroll 6
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[i][t] = _mm512_setzero_ps();
    const float *xs[F32_ROWS];
#pragma GCC unroll 6
    for (int i = 0; i < R; i++) xs[i] = a->x + (m0 + i) * a->x_stride;
#pragma GCC unroll 1
    for (int64_t kk = 0; kk < k; kk++) {
        __m512 wt[4];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) wt[t] = _mm512_loadu_ps(w + (t * k + kk) * 16);
#pragma GCC unroll 6
        for (int i = 0; i < R; i++) {
            const __m512 xb = _mm512_set1_ps(xs[i][kk]);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) acc[i][t] = _mm512_fmadd_ps(xb, wt[t], acc[i][t]);
        }
    }
    for (int t = 0; t < T; t++) {
        const int64_t n0 = (nb0 + t) * 16;
        const int cols = a->n - n0 < 16 ? (int)(a->n - n0) : 16;
        const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
        const __m512 b = a->bias ? _mm512_maskz_loadu_ps(mask, a->bias + n0) : _mm512_setzero_ps();
        for (int i = 0; i < R; i++)
            _mm512_mask_storeu_ps(a->out + (m0 + i) * a->n + n0, mask, _mm512_add_ps(acc[i][t], b));
    }
}

#define F32_CASE(R, T)                       \
    case (R) * 8 + (T):                      \
        f32_block(a, w, m0, nb0, (R), (T));  \
        break;
#define F32_CASES(R) F32_CASE(R, 1) F32_CASE(R, 2) F32_CASE(R, 3) F32_CASE(R, 4)

static void f32_groups(const void *ctx, int64_t g0, int64_t g1) {
    const JobF32 *a = (const JobF32 *)ctx;
    const int64_t nbs = (a->n + 15) / 16;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t nb0 = g * 4;
        const int tiles = nbs - nb0 < 4 ? (int)(nbs - nb0) : 4;
        const float *w = a->packed + nb0 * a->k * 16;
        for (int64_t m0 = 0; m0 < a->m; m0 += F32_ROWS) {
            const int rows = a->m - m0 < F32_ROWS ? (int)(a->m - m0) : F32_ROWS;
            switch (rows * 8 + tiles) {
                F32_CASES(1) F32_CASES(2) F32_CASES(3) F32_CASES(4) F32_CASES(5) F32_CASES(6)
            }
        }
    }
}

/* x [m, k] float32 rows `x_stride` apart; packed by kvtier_linear_f32_pack; out [m, n]. */
void kvtier_linear_f32(const float *x, int64_t x_stride, int64_t m, const float *packed, int64_t n,
                       int64_t k, const float *bias, float *out, int threads) {
    const JobF32 job = {x, packed, bias, out, m, n, k, x_stride};
    const int64_t groups = ((n + 15) / 16 + 3) / 4;
    const int64_t work = m * n * k;
    pool_run(f32_groups, &job, groups, groups / (4 * threads), work < (1 << 20) ? 1 : threads);
}
#endif
