/* The bfloat16 linear's column groups on AVX-512 without AVX512-BF16 (Intel Skylake-SP, Cascade
 * Lake, Ice Lake): there oneDNN's bfloat16 linear is emulated and runs at about a fifth of the
 * VDPBF16PS rate it reaches where the instruction exists (docs/kernels.md). As on AVX2
 * (linear_avx2.c), the packed tiles widen exactly in registers: a tile row is one 512-bit load,
 * 16 columns' pair (2r, 2r + 1), the odd element in float32 position under a mask, the even one
 * after a 16-bit shift; x's rows are widened once per call (Job.xf, linear.c), so each row's
 * element is a broadcast from memory folded into the FMA. The sums are VDPBF16PS's by FMA (a
 * product of two bfloat16 is exact in float32): per k pair the odd product added, then the even
 * one, over k in order, rounded to bfloat16 once by f32_to_bf16's rule (block_store) — the
 * AVX512-BF16 path's bits, whatever the batch. The register blocks, the column groups and the
 * prefetch of the next group are the AVX512-BF16 path's (linear_blocks.h). */
#include "linear.h"

#if defined(KVTIER_AVX512_WIDE)
#include "linear_blocks.h"

/* b's rows by T column tiles (R = b->rows): R × T float32 accumulators; per k pair each tile's
 * row is loaded and widened once, then added into every row's sums, its odd half first */
static inline __attribute__((always_inline)) void wide_block(const Job *a, const Block *b,
                                                              const int R, const int T) {
    const int64_t kbs = (a->k + 31) / 32, xs = kbs * 32;
    const uint16_t *w = (const uint16_t *)b->w;
    const __m512i odd = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc[8][4];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[i][t] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < kbs; kb++) {
        block_prefetch(b, kb, kbs);
        const float *xk = a->xf + b->m0 * xs + kb * 32;
        const uint16_t *wk = w + kb * 512;
#pragma GCC unroll 1
        for (int r = 0; r < 16; r++) {
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                const __m512i v = _mm512_loadu_si512(wk + t * kbs * 512 + r * 32);
                const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v, odd));
                const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
#pragma GCC unroll 8
                for (int i = 0; i < R; i++)
                    acc[i][t] = _mm512_fmadd_ps(_mm512_set1_ps(xk[i * xs + 2 * r + 1]), wo, acc[i][t]);
#pragma GCC unroll 8
                for (int i = 0; i < R; i++)
                    acc[i][t] = _mm512_fmadd_ps(_mm512_set1_ps(xk[i * xs + 2 * r]), we, acc[i][t]);
            }
        }
    }
    float out[8 * 16] __attribute__((aligned(64)));
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < R; i++) _mm512_store_ps(out + i * 16, acc[i][t]);
        block_store(a, out, b->m0, R, (b->nb0 + t) * 16);
    }
}

static void wide_run(const Job *a, const Block *b) {
    switch (BLOCK_KEY(b->rows, b->tiles)) { BLOCK_CASES_8X4(wide_block) }
}

/* output column groups of a->tiles 16-column tiles, every row block of a->rows (linear_blocks) */
void linear_wide_avx512_groups(const void *ctx, int64_t i0, int64_t i1) {
    const Job *a = (const Job *)ctx;
    linear_blocks(a, i0, i1, a->packed, 2, wide_run, NULL);
}
#endif
