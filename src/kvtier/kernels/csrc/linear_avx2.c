/* The bfloat16 linear's column groups on AVX2 with FMA and no AVX-512 (x86-64-v3: AMD Zen 2/3,
 * Intel client cores): no bfloat16 arithmetic here, and oneDNN's bfloat16 linear runs at about a
 * sixth of its float32 rate. A bfloat16 is a float32's upper half, so the packed tiles (linear.c)
 * widen exactly in registers: each 32-bit lane of a tile row holds one column's pair (2r, 2r + 1),
 * the odd element in float32 position under a mask, the even one after a 16-bit shift. x's rows
 * are widened once per call (Job.xf, linear.c). The sums are VDPBF16PS's, by FMA (a product of
 * two bfloat16 is exact in float32): per k pair the odd product added, then the even one, over k
 * in order, rounded to bfloat16 once — the AVX512-BF16 path's bits, whatever the batch. */
#include "linear.h"

#if defined(KVTIER_AVX2)
#include <immintrin.h>

/* R rows from m0 by T column tiles from nb0: R × T × 2 eight-column float32 accumulators; per k
 * pair each tile row is loaded and widened once and multiplied by every row's pair broadcast */
static inline __attribute__((always_inline)) void avx2_block(const Job *a, int64_t m0,
                                                              int64_t nb0, const int R,
                                                              const int T) {
    const int64_t kbs = (a->k + 31) / 32, xs = kbs * 32;
    const uint16_t *w = a->packed + nb0 * kbs * 512;
    const __m256i odd = _mm256_set1_epi32((int)0xffff0000u);
    __m256 acc[4][2][2];
#pragma GCC unroll 4
    for (int i = 0; i < R; i++)
#pragma GCC unroll 2
        for (int t = 0; t < T; t++) acc[i][t][0] = acc[i][t][1] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < kbs; kb++) {
        const uint16_t *wk = w + kb * 512;
        const float *xk = a->xf + m0 * xs + kb * 32;
#pragma GCC unroll 1
        for (int r = 0; r < 16; r++) {
            __m256 wo[2][2], we[2][2];
#pragma GCC unroll 2
            for (int t = 0; t < T; t++)
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const __m256i v =
                        _mm256_loadu_si256((const __m256i *)(wk + t * kbs * 512 + r * 32 + h * 16));
                    wo[t][h] = _mm256_castsi256_ps(_mm256_and_si256(v, odd));
                    we[t][h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                }
#pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                const __m256 xo = _mm256_broadcast_ss(xk + i * xs + 2 * r + 1);
                const __m256 xe = _mm256_broadcast_ss(xk + i * xs + 2 * r);
#pragma GCC unroll 2
                for (int t = 0; t < T; t++)
#pragma GCC unroll 2
                    for (int h = 0; h < 2; h++) {
                        acc[i][t][h] = _mm256_fmadd_ps(xo, wo[t][h], acc[i][t][h]);
                        acc[i][t][h] = _mm256_fmadd_ps(xe, we[t][h], acc[i][t][h]);
                    }
            }
        }
    }
    float out[4 * 16] __attribute__((aligned(32)));
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < R; i++) {
            _mm256_store_ps(out + i * 16, acc[i][t][0]);
            _mm256_store_ps(out + i * 16 + 8, acc[i][t][1]);
        }
        linear_store_rows(a, out, m0, R, (nb0 + t) * 16);
    }
}

/* A block of up to 4 rows: 3-4 rows one tile at a time (24-32 accumulator registers' worth
 * would not fit 16), 1-2 rows two tiles at a time (more sums in flight for a decode's rows) */
static void avx2_rows(const Job *a, int64_t m0, int rows, int64_t nb0, int tiles) {
    for (int t = 0; t < tiles;) {
        const int two = rows <= 2 && tiles - t >= 2;
        switch (rows * 2 + two) {
        case 2: avx2_block(a, m0, nb0 + t, 1, 1); break;
        case 3: avx2_block(a, m0, nb0 + t, 1, 2); break;
        case 4: avx2_block(a, m0, nb0 + t, 2, 1); break;
        case 5: avx2_block(a, m0, nb0 + t, 2, 2); break;
        case 6: avx2_block(a, m0, nb0 + t, 3, 1); break;
        default: avx2_block(a, m0, nb0 + t, 4, 1); break;
        }
        t += 1 + two;
    }
}

/* Items [i0, i1): column groups by row blocks (item_row_blocks) */
void linear_avx2_groups(const void *job, int64_t i0, int64_t i1) {
    item_row_blocks(job, i0, i1, avx2_rows);
}

#endif
