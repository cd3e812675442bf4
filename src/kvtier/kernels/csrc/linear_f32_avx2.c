/* The float32 linear on AVX2 with FMA and no AVX-512 (x86-64-v3): linear_f32_avx512.c's
 * arithmetic — each output one fused multiply-add chain over k in order, the bias added once at
 * the end — on 8-lane registers, so a row's bits are that path's and never depend on its batch
 * (the reason the kernel exists: linear_f32_avx512.c). The same packed weight, [Nb][K][16]: a
 * 16-column vector is two registers here. Rows in blocks of up to 6 against one column vector,
 * or fewer rows against up to four (12 accumulators at most, of 16 registers). k runs in blocks
 * of F32_KB: a column group's weights for one k block (64 KiB) stay in L2 while every row block
 * reads them, each row block's sums parked in `out` between k blocks (exact: float32 stored and
 * reloaded), the bias added after the last. Unblocked, a group's weights at k = 4864 (1.2 MiB)
 * came from L3 for every 6 rows, and a 512-row prefill ran at half oneDNN's speed. */
#include "linear.h"

#if defined(KVTIER_AVX2)
#include <immintrin.h>

#define F32_KB 256

/* R rows from m0 by T column vectors from nb0 over k in [k0, k1): the sums start at zero
 * (k0 = 0) or where the previous k block parked them in out, and are parked again, or given
 * the bias at k1 = k */
static inline __attribute__((always_inline)) void f32_block(const JobF32 *a, const float *w,
                                                             int64_t m0, int64_t nb0, const int R,
                                                             const int T, int64_t k0, int64_t k1) {
    const int64_t k = a->k;
    __m256 acc[6][4][2];
    float park[6][4][16] __attribute__((aligned(32))); /* the sums between k blocks */
    if (k0 > 0)
        for (int t = 0; t < T; t++) {
            const int64_t n0 = (nb0 + t) * 16;
            const int cols = a->n - n0 < 16 ? (int)(a->n - n0) : 16;
            for (int i = 0; i < R; i++) {
                memset(park[i][t], 0, sizeof(park[i][t]));
                memcpy(park[i][t], a->out + (m0 + i) * a->n + n0, (size_t)cols * sizeof(float));
            }
        }
#pragma GCC unroll 6
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++)
                acc[i][t][h] = k0 > 0 ? _mm256_load_ps(park[i][t] + h * 8) : _mm256_setzero_ps();
    const float *xs[6];
#pragma GCC unroll 6
    for (int i = 0; i < R; i++) xs[i] = a->x + (m0 + i) * a->x_stride;
#pragma GCC unroll 1
    for (int64_t kk = k0; kk < k1; kk++) {
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
#pragma GCC unroll 6
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) _mm256_store_ps(park[i][t] + h * 8, acc[i][t][h]);
    for (int t = 0; t < T; t++) {
        const int64_t n0 = (nb0 + t) * 16;
        const int cols = a->n - n0 < 16 ? (int)(a->n - n0) : 16;
        for (int i = 0; i < R; i++) {
            const float *out = park[i][t];
            float *o = a->out + (m0 + i) * a->n + n0;
            if (k1 < k) memcpy(o, out, (size_t)cols * sizeof(float));
            else
                for (int c = 0; c < cols; c++) o[c] = out[c] + (a->bias ? a->bias[n0 + c] : 0.0f);
        }
    }
}

/* rows from m0 against `tiles` column vectors from nb0: 1 row by up to 4 vectors, 2 by up to
 * 3, 3 by up to 2, 4-6 by 1 */
static void f32_rows(const JobF32 *a, const float *w, int64_t m0, int rows, int64_t nb0,
                     int tiles, int64_t k0, int64_t k1) {
    static const int most[7] = {0, 4, 3, 2, 1, 1, 1};
    for (int t = 0; t < tiles;) {
        const int T = tiles - t < most[rows] ? tiles - t : most[rows];
        const float *wt = w + t * a->k * 16;
        switch (rows * 8 + T) {
        case 9: f32_block(a, wt, m0, nb0 + t, 1, 1, k0, k1); break;
        case 10: f32_block(a, wt, m0, nb0 + t, 1, 2, k0, k1); break;
        case 11: f32_block(a, wt, m0, nb0 + t, 1, 3, k0, k1); break;
        case 12: f32_block(a, wt, m0, nb0 + t, 1, 4, k0, k1); break;
        case 17: f32_block(a, wt, m0, nb0 + t, 2, 1, k0, k1); break;
        case 18: f32_block(a, wt, m0, nb0 + t, 2, 2, k0, k1); break;
        case 19: f32_block(a, wt, m0, nb0 + t, 2, 3, k0, k1); break;
        case 25: f32_block(a, wt, m0, nb0 + t, 3, 1, k0, k1); break;
        case 26: f32_block(a, wt, m0, nb0 + t, 3, 2, k0, k1); break;
        case 33: f32_block(a, wt, m0, nb0 + t, 4, 1, k0, k1); break;
        case 41: f32_block(a, wt, m0, nb0 + t, 5, 1, k0, k1); break;
        default: f32_block(a, wt, m0, nb0 + t, 6, 1, k0, k1); break;
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
        for (int64_t k0 = 0; k0 < a->k; k0 += F32_KB) {
            const int64_t k1 = a->k - k0 < F32_KB ? a->k : k0 + F32_KB;
            for (int64_t m0 = 0; m0 < a->m; m0 += 6) {
                const int rows = a->m - m0 < 6 ? (int)(a->m - m0) : 6;
                f32_rows(a, w, m0, rows, nb0, tiles, k0, k1);
            }
        }
    }
}

#endif
