/* The bfloat16 linear's column groups on AVX512-BF16 (AMD Zen 4/5, Intel Cooper Lake and
 * later): a packed tile's row is one VDPBF16PS operand (16 columns' pair r), multiplied by a
 * row's pair r broadcast; and the rounding of either path's float32 sums into bfloat16 outputs
 * (linear.c dispatches; docs/architecture.md §Kernels). */
#include "linear.h"

#if defined(KVTIER_AVX512BF16)
#include <immintrin.h>

void linear_store(const Job *a, const float *acc, int64_t m0, int rows, int64_t n0) {
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
        linear_store(a, out[t], m0, R, (nb0 + t) * 16);
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
 * batch of 7-64 rows on weights that do not fit the cache). The first block takes a share too:
 * its demand misses and the prefetches share the memory queue. */
void linear_avx512bf16_groups(const void *ctx, int64_t i0, int64_t i1) {
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
#endif
