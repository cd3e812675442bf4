/* The float32 linear on AVX-512F (linear.c has its entry points): out [M, N] = x [M, K] · W [N, K]ᵀ
 * (+ bias), each output one fused multiply-add chain over k in order, the bias added once at the
 * end. Not for speed first but for batch invariance: oneDNN's and MKL's float32 GEMMs pick their
 * kernels and summation orders by the row count (on AMD Zen 5, 1 or 3 rows differ from 8 or more in
 * up to a third of the outputs), so a request's logits — and a seeded sample — would depend on what
 * else is in its batch. Here a row's bits depend only on the row. The weight is packed once as
 * [Nb][K][16] (16 output columns a vector, zero past N); rows in blocks of F32_ROWS against four
 * column vectors, output column groups on the pool (pool.c). */
#include "linear.h"

#if defined(KVTIER_AVX512)
#include <immintrin.h>

#define F32_ROWS 6 /* 6 × 4 accumulators, 4 weight vectors and a broadcast: 29 of 32 registers */

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

void linear_f32_groups(const void *ctx, int64_t g0, int64_t g1) {
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

#endif
