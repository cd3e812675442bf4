/* The float32 linear on AVX2 with FMA and no AVX-512 (x86-64-v3): linear_f32_avx512.c's
 * arithmetic — each output one fused multiply-add chain over k in order, the bias added once at
 * the end — on 8-lane registers, so a row's bits are that path's and never depend on its batch
 * (the reason the kernel exists: linear_f32_avx512.c). The same packed weight, [Nb][K][16]: a
 * 16-column vector is two registers here. Rows in blocks of up to 6 against one column vector,
 * or fewer rows against up to four (12 accumulators at most, of 16 registers). Every loop over
 * the accumulators is unrolled: indexed in a loop that was not, they lived on the stack and the
 * kernel ran at a third of its speed. */
#include "linear.h"

#if defined(KVTIER_AVX2)
#include <immintrin.h>

static inline __attribute__((always_inline)) void f32_block(const JobF32 *a, const float *w,
                                                             int64_t m0, int64_t nb0, const int R,
                                                             const int T) {
    const int64_t k = a->k;
    __m256 acc[6][4][2];
#pragma GCC unroll 6
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) acc[i][t][h] = _mm256_setzero_ps();
    const float *xs[6];
#pragma GCC unroll 6
    for (int i = 0; i < R; i++) xs[i] = a->x + (m0 + i) * a->x_stride;
#pragma GCC unroll 1
    for (int64_t kk = 0; kk < k; kk++) {
#pragma GCC unroll 6
        for (int i = 0; i < R; i++) {
            const __m256 xb = _mm256_broadcast_ss(xs[i] + kk);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++)
                    acc[i][t][h] = _mm256_fmadd_ps(
                        xb, _mm256_loadu_ps(w + (t * k + kk) * 16 + h * 8), acc[i][t][h]);
        }
    }
    float out[6][4][16] __attribute__((aligned(32)));
#pragma GCC unroll 6
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) _mm256_store_ps(out[i][t] + h * 8, acc[i][t][h]);
    for (int t = 0; t < T; t++) {
        const int64_t n0 = (nb0 + t) * 16;
        const int cols = a->n - n0 < 16 ? (int)(a->n - n0) : 16;
        for (int i = 0; i < R; i++) {
            float *o = a->out + (m0 + i) * a->n + n0;
            for (int c = 0; c < cols; c++)
                o[c] = out[i][t][c] + (a->bias ? a->bias[n0 + c] : 0.0f);
        }
    }
}

/* rows from m0 against `tiles` column vectors from nb0: 1 row by up to 4 vectors, 2 by up to
 * 3, 3 by up to 2, 4-6 by 1 */
static void f32_rows(const JobF32 *a, const float *w, int64_t m0, int rows, int64_t nb0,
                     int tiles) {
    static const int most[7] = {0, 4, 3, 2, 1, 1, 1};
    for (int t = 0; t < tiles;) {
        const int T = tiles - t < most[rows] ? tiles - t : most[rows];
        const float *wt = w + t * a->k * 16;
        switch (rows * 8 + T) {
        case 9: f32_block(a, wt, m0, nb0 + t, 1, 1); break;
        case 10: f32_block(a, wt, m0, nb0 + t, 1, 2); break;
        case 11: f32_block(a, wt, m0, nb0 + t, 1, 3); break;
        case 12: f32_block(a, wt, m0, nb0 + t, 1, 4); break;
        case 17: f32_block(a, wt, m0, nb0 + t, 2, 1); break;
        case 18: f32_block(a, wt, m0, nb0 + t, 2, 2); break;
        case 19: f32_block(a, wt, m0, nb0 + t, 2, 3); break;
        case 25: f32_block(a, wt, m0, nb0 + t, 3, 1); break;
        case 26: f32_block(a, wt, m0, nb0 + t, 3, 2); break;
        case 33: f32_block(a, wt, m0, nb0 + t, 4, 1); break;
        case 41: f32_block(a, wt, m0, nb0 + t, 5, 1); break;
        default: f32_block(a, wt, m0, nb0 + t, 6, 1); break;
        }
        t += T;
    }
}

/* output column groups [g0, g1) of four 16-column vectors, every row (linear.c's entry) */
void linear_f32_groups(const void *ctx, int64_t g0, int64_t g1) {
    const JobF32 *a = (const JobF32 *)ctx;
    const int64_t nbs = (a->n + 15) / 16;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t nb0 = g * 4;
        const int tiles = nbs - nb0 < 4 ? (int)(nbs - nb0) : 4;
        const float *w = a->packed + nb0 * a->k * 16;
        for (int64_t m0 = 0; m0 < a->m; m0 += 6) {
            const int rows = a->m - m0 < 6 ? (int)(a->m - m0) : 6;
            f32_rows(a, w, m0, rows, nb0, tiles);
        }
    }
}

#endif
