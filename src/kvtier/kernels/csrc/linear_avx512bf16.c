/* The bfloat16 linear's column groups on AVX512-BF16 (AMD Zen 4/5, Intel Cooper Lake and
 * later): a packed tile's row is one VDPBF16PS operand (16 columns' pair r), multiplied by a
 * row's pair r broadcast; and the rounding of either path's float32 sums into bfloat16 outputs
 * (linear.c dispatches; docs/architecture.md §Kernels). */
#include "linear.h"

#if defined(KVTIER_AVX512BF16)
#include "linear_blocks.h"

void linear_store(const Job *a, const float *acc, int64_t m0, int rows, int64_t n0) {
    const int cols = a->n - n0 < 16 ? (int)(a->n - n0) : 16;
    const __mmask16 mask = (__mmask16)((1u << cols) - 1u);
    const __m512 b = block_bias(a, mask, n0);
    for (int r = 0; r < rows; r++) {
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(acc + r * 16), b));
        _mm256_mask_storeu_epi16(a->out + (m0 + r) * a->n + n0, mask, h);
    }
}

/* b's rows by T column tiles (R = b->rows): R × T float32 accumulators in registers; per k
 * pair, each tile's row (16 columns' pair) is loaded once and multiplied by every row's pair
 * broadcast */
static inline __attribute__((always_inline)) void avx_block(const Job *a, const Block *b,
                                                             const int R, const int T) {
    const int64_t kbs = (a->k + 31) / 32, full = a->k / 32, m0 = b->m0;
    const uint16_t *w = (const uint16_t *)b->w;
    __m512 acc[8][4];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[i][t] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < kbs; kb++) {
        block_prefetch(b, kb, kbs);
        const uint16_t *xs[8];
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) xs[i] = x_block(a, m0 + i, kb, full);
        const uint16_t *wk = w + kb * 512;
#pragma GCC unroll 1 /* unrolled, GCC hoists every pair's broadcasts out and spills them */
        for (int r = 0; r < 16; r++) {
            __m512bh wt[4];
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
                wt[t] = (__m512bh)_mm512_loadu_si512(wk + t * kbs * 512 + r * 32);
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
        const int64_t n0 = (b->nb0 + t) * 16;
        if (a->scales) { /* int8 weights widened (linear_i8_avx512.c) */
            const int cols = a->n - n0 < 16 ? (int)(a->n - n0) : 16;
            const __m512 s = _mm512_maskz_loadu_ps((__mmask16)((1u << cols) - 1u), a->scales + n0);
            for (int i = 0; i < R; i++) acc[i][t] = _mm512_mul_ps(acc[i][t], s);
        }
        for (int i = 0; i < R; i++) _mm512_store_ps(out[t] + i * 16, acc[i][t]);
        linear_store(a, out[t], m0, R, n0);
    }
}

void linear_avx512bf16_block(const Job *a, const Block *b) {
    switch (BLOCK_KEY(b->rows, b->tiles)) { BLOCK_CASES_8X4(avx_block) }
}

/* output column groups of a->tiles 16-column tiles, every row block of a->rows (linear_blocks) */
void linear_avx512bf16_groups(const void *ctx, int64_t i0, int64_t i1) {
    const Job *a = (const Job *)ctx;
    linear_blocks(a, i0, i1, a->packed, 2, linear_avx512bf16_block, NULL);
}
#endif
