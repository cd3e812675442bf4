/* The item loop the AVX-512 tile linears share (linear_avx512bf16.c: bfloat16 weights,
 * linear_i8_avx512.c: int8 weights, linear_w8a8_avx512.c: int8 weights and activations;
 * docs/kernels.md): each walks a call's items as register blocks of a->rows rows by a->tiles
 * column tiles and plans the same prefetch of the next column group; only a block's arithmetic
 * differs, which each file writes once as its BlockFn. Included by those files, which are
 * compiled with AVX-512 (the int8 ones also without BF16: W8A16's int16 blocks with AVX512-BW,
 * W8A8 with AVX512-VNNI). */
#ifndef KVTIER_LINEAR_BLOCKS_H
#define KVTIER_LINEAR_BLOCKS_H

#include <immintrin.h>

#include "linear.h"

/* One register block: rows [m0, m0 + rows) by `tiles` 16-column tiles from tile nb0, whose
 * packed weights start at `w`; and its share of the next column group's weights to prefetch into
 * L2, pf_lines 64-byte lines from `pf` (block_prefetch). */
typedef struct {
    const void *w;
    const char *pf;
    int64_t m0, nb0, pf_lines;
    int rows, tiles;
} Block;

/* A path's block: its switch on BLOCK_KEY(rows, tiles) picks a body unrolled for that shape */
typedef void (*BlockFn)(const Job *a, const Block *b);

/* the bfloat16 path's block (linear_avx512bf16.c), which also runs int8 tiles widened into
 * bfloat16 (linear_i8_avx512.c), their column scales applied before the bias */
void linear_avx512bf16_block(const Job *a, const Block *b);

#define BLOCK_KEY(rows, tiles) ((rows) * 8 + (tiles))
/* a case of a BlockFn's switch: `body` (an always-inline function of a, b and the shape) for R
 * rows by T tiles */
#define BLOCK_CASE(body, R, T)     \
    case BLOCK_KEY(R, T):          \
        body(a, b, (R), (T));      \
        break;

/* every register block the bfloat16 path's shapes make (linear.c avx_block_shape): 1-6 rows by
 * 1-4 tiles, 7-8 rows by 1-3 (8 × 4 accumulators would not fit 32 registers) */
#define BLOCK_CASES_T3(body, R) BLOCK_CASE(body, R, 1) BLOCK_CASE(body, R, 2) BLOCK_CASE(body, R, 3)
#define BLOCK_CASES_T4(body, R) BLOCK_CASES_T3(body, R) BLOCK_CASE(body, R, 4)
#define BLOCK_CASES_8X4(body)                                                                   \
    BLOCK_CASES_T4(body, 1) BLOCK_CASES_T4(body, 2) BLOCK_CASES_T4(body, 3)                     \
    BLOCK_CASES_T4(body, 4) BLOCK_CASES_T4(body, 5) BLOCK_CASES_T4(body, 6)                     \
    BLOCK_CASES_T3(body, 7) BLOCK_CASES_T3(body, 8)

/* The bias of output columns n0.. (the `mask` of them that exist) as float32, zero without one */
static inline __m512 block_bias(const Job *a, __mmask16 mask, int64_t n0) {
    if (!a->bias) return _mm512_setzero_ps();
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, a->bias + n0)), 16));
}

/* A block's rows of float32 [rows][16] (+ bias) rounded into out's columns n0..: linear_store
 * (VCVTNEPS2BF16) with AVX512-BF16; without it (the int8 paths on Cascade Lake and Ice Lake)
 * f32_to_bf16's integer rule, 16 a vector */
static inline void block_store(const Job *a, const float *acc, int64_t m0, int rows, int64_t n0) {
#if defined(KVTIER_AVX512BF16)
    linear_store(a, acc, m0, rows, n0);
#else
    const int cols = a->n - n0 < 16 ? (int)(a->n - n0) : 16;
    const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
    const __m512 b = block_bias(a, mask, n0);
    for (int r = 0; r < rows; r++) {
        const __m512 v = _mm512_add_ps(_mm512_loadu_ps(acc + r * 16), b);
        const __m512i u = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        const __m512i even = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
        const __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x400000));
        const __m512i h = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), even, quiet);
        _mm256_mask_storeu_epi16(a->out + (m0 + r) * a->n + n0, mask,
                                 _mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
    }
#endif
}

#define BLOCK_PREFETCH_MAX (256 << 10) /* a next group's bytes prefetched into L2, at most */

/* The block's prefetch share for k block kb of kbs: spread evenly over its k blocks */
static inline __attribute__((always_inline)) void block_prefetch(const Block *b, int64_t kb,
                                                                 int64_t kbs) {
    for (int64_t l = kb * b->pf_lines / kbs; l < (kb + 1) * b->pf_lines / kbs; l++)
        _mm_prefetch(b->pf + l * 64, _MM_HINT_T1);
}

#if defined(KVTIER_AVX512BF16)
/* `count` int8 weights (a multiple of 32) as bfloat16, which holds every int8 exactly */
static inline void widen_i8(const int8_t *w, int64_t count, uint16_t *out) {
    for (int64_t i = 0; i < count; i += 32) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + i))));
        const __m512 hi =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + i + 16))));
        _mm512_store_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}
#else
/* Without AVX512-BF16 only the int8 blocks include this file, and they never widen (the
 * W8A16 widened path is built with BF16 only) */
static inline void widen_i8(const int8_t *w, int64_t count, uint16_t *out) {
    (void)w, (void)count, (void)out;
    __builtin_trap();
}
#endif

/* Items [i0, i1) of a call (item_span) on tiles packed `elem` bytes an element from `packed`:
 * output column groups of a->tiles tiles, every row block of a->rows rows, each run by `run`. The
 * first row block streams the group's weights from memory; the others read them from L2 and are
 * bound by arithmetic. Every block prefetches a share of the next group's weights into L2, which
 * its first block then finds there: memory and arithmetic overlap instead of taking turns (a
 * batch of 7-64 rows on weights that do not fit the cache). The first block takes a share too:
 * its demand misses and the prefetches share the memory queue. With `wide` (int8 tiles, elem 1),
 * a group's tiles are widened into it once, before its first block, and every block reads them
 * there: the widening is paid once per group, not once per row block. */
static inline __attribute__((always_inline)) void linear_blocks(const Job *a, int64_t i0,
                                                                int64_t i1, const void *packed,
                                                                int64_t elem, BlockFn run,
                                                                uint16_t *wide) {
    const int64_t nbs = (a->n + 15) / 16, kbs = (a->k + 31) / 32;
    const int64_t tile = kbs * 512 * elem; /* a column tile's bytes, every k block */
    const int64_t T = a->tiles, R = a->rows;
    for (int64_t item = i0; item < i1; item++) {
        int64_t g, r0, r1;
        item_span(a, item, &g, &r0, &r1);
        const int64_t nb0 = g * T, blocks = (r1 - r0 + R - 1) / R;
        const int tiles = nbs - nb0 < T ? (int)(nbs - nb0) : (int)T;
        const char *src = (const char *)packed + nb0 * tile;
        const void *w = src;
        if (wide) {
            widen_i8((const int8_t *)src, tiles * tile, wide);
            w = wide;
        }
        const int64_t next_tiles =
            item + 1 < i1 && g + 1 < a->groups ? (nbs - nb0 - T < T ? nbs - nb0 - T : T) : 0;
        const int64_t next_bytes = next_tiles * tile;
        const int prefetch = blocks > 1 && next_bytes > 0 && next_bytes <= BLOCK_PREFETCH_MAX;
        const int64_t share = prefetch ? (next_bytes / 64 + blocks - 1) / blocks : 0;
        for (int64_t m0 = r0; m0 < r1; m0 += R) {
            const int64_t j = (m0 - r0) / R, first = j * share;
            Block b = {.w = w, .pf = src + tiles * tile + first * 64, .m0 = m0, .nb0 = nb0,
                       .rows = r1 - m0 < R ? (int)(r1 - m0) : (int)R, .tiles = tiles};
            if (prefetch && first < next_bytes / 64)
                b.pf_lines = first + share <= next_bytes / 64 ? share : next_bytes / 64 - first;
            run(a, &b);
        }
    }
}

#endif
