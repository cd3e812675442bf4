/* What the two AVX2 int8 linears share (linear_i8_avx2.c: W8A16, linear_w8a8_avx2.c: W8A8;
 * docs/kernels.md), as linear_blocks.h is the AVX-512 paths': x's rows in int16 [m][k blocks][32]
 * (Job.xq) against the int8 tiles sign-extended to int16, one k block's int32 sums of R rows by
 * T tiles (`kblock_sums`), the register block that sums k and stores (`int16_block_avx2`), and
 * the choice of blocks (INT8_AVX2_ROWS). Only what a path does with a block's sums differs (its
 * `w8a8` flag). Included by those two files, compiled for AVX2. */
#ifndef KVTIER_LINEAR_INT8_AVX2_H
#define KVTIER_LINEAR_INT8_AVX2_H

#include <immintrin.h>

#include "linear.h"

static inline __m256 widen_bf16(__m128i h) { /* 8 bfloat16 → 8 float32, exactly */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* k block kb's int32 sums, R rows from m0 by T column tiles from w (the packed tiles of the
 * block's column group): per k pair each tile row is loaded and sign-extended once and
 * multiplied by every row's pair broadcast, VPMADDWD + VPADDD (exact: no pair saturates) */
static inline __attribute__((always_inline)) void kblock_sums(const Job *a, const int8_t *w,
                                                               int64_t m0, int64_t kb, const int R,
                                                               const int T, __m256i sum[4][4][2]) {
    const int64_t kbs = (a->k + 31) / 32;
    const int8_t *wk = w + kb * 512;
    const int32_t *xp[4]; /* a row's int16 values in this k block, as k pairs */
#pragma GCC unroll 4
    for (int i = 0; i < R; i++) xp[i] = (const int32_t *)(a->xq + ((m0 + i) * kbs + kb) * 32);
#pragma GCC unroll 4
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) sum[i][t][0] = sum[i][t][1] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int r = 0; r < 16; r++) {
        __m256i wt[4][2];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++)
                wt[t][h] = _mm256_cvtepi8_epi16(
                    _mm_loadu_si128((const __m128i *)(wk + t * kbs * 512 + r * 32 + h * 16)));
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            const __m256i xb = _mm256_set1_epi32(xp[i][r]);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++)
                    sum[i][t][h] = _mm256_add_epi32(sum[i][t][h], _mm256_madd_epi16(xb, wt[t][h]));
        }
    }
}

/* R rows from m0 by T column tiles from nb0: each k block's int32 sums (kblock_sums); W8A16
 * (`w8a8` 0) scales them into float32 accumulators by the row's k-block scale, W8A8 (x quantized
 * per row) adds them into int32 totals, scaled once at the end: (sum × column scale) × row scale.
 * Both are kept in memory, touched once a block: summing all of k in registers instead ran 1.4×
 * slower (GCC kept those sums on the stack across the k loop). */
static inline __attribute__((always_inline)) void int16_block_avx2(const Job *a, int64_t m0,
                                                                    int64_t nb0, const int R,
                                                                    const int T, const int w8a8) {
    const int64_t kbs = (a->k + 31) / 32;
    const int8_t *w = a->packed8 + nb0 * kbs * 512;
    __m256 acc[4][4][2];
    __m256i tot[4][4][2];
#pragma GCC unroll 4
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                acc[i][t][h] = _mm256_setzero_ps();
                tot[i][t][h] = _mm256_setzero_si256();
            }
    for (int64_t kb = 0; kb < kbs; kb++) {
        __m256i sum[4][4][2];
        kblock_sums(a, w, m0, kb, R, T, sum);
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            const __m256 s = _mm256_set1_ps(w8a8 ? 0.0f : a->xs[(m0 + i) * kbs + kb]);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    if (w8a8)
                        tot[i][t][h] = _mm256_add_epi32(tot[i][t][h], sum[i][t][h]);
                    else
                        acc[i][t][h] =
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i][t][h]), s, acc[i][t][h]);
                }
        }
    }
    float out[4 * 16];
#pragma GCC unroll 4 /* constant indices: the sums stay in registers */
    for (int t = 0; t < T; t++) {
        const int64_t n0 = (nb0 + t) * 16;
        const int cols = a->n - n0 < 16 ? (int)(a->n - n0) : 16;
        float scales[16] = {0};
        memcpy(scales, a->scales + n0, (size_t)cols * sizeof(float));
#pragma GCC unroll 4
        for (int i = 0; i < R; i++)
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __m256 c = _mm256_loadu_ps(scales + h * 8);
                const __m256 v =
                    w8a8 ? _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(tot[i][t][h]), c),
                                         _mm256_set1_ps(a->xs[m0 + i]))
                         : _mm256_mul_ps(acc[i][t][h], c);
                _mm256_storeu_ps(out + i * 16 + h * 8, v);
            }
        linear_store_rows(a, out, m0, R, n0);
    }
}

/* A path's rows_fn for item_row_blocks (`name`), running int16_block_avx2 with the path's `w8a8`
 * for R rows by T tiles: 1 row by up to 4 tiles (only its sums stay in registers: each widened
 * tile row is used once), 2 rows by up to 2, 3-4 rows one tile at a time */
#define INT8_AVX2_ROWS(name, w8a8)                                                               \
    static void name(const Job *a, int64_t m0, int rows, int64_t nb0, int tiles) {               \
        for (int t = 0; t < tiles;) {                                                            \
            const int left = tiles - t;                                                          \
            const int T = rows == 1 ? (left < 4 ? left : 4) : rows == 2 ? (left < 2 ? left : 2) : 1; \
            switch (rows * 4 + T) {                                                              \
            case 5: int16_block_avx2(a, m0, nb0 + t, 1, 1, w8a8); break;                         \
            case 6: int16_block_avx2(a, m0, nb0 + t, 1, 2, w8a8); break;                         \
            case 7: int16_block_avx2(a, m0, nb0 + t, 1, 3, w8a8); break;                         \
            case 8: int16_block_avx2(a, m0, nb0 + t, 1, 4, w8a8); break;                         \
            case 9: int16_block_avx2(a, m0, nb0 + t, 2, 1, w8a8); break;                         \
            case 10: int16_block_avx2(a, m0, nb0 + t, 2, 2, w8a8); break;                        \
            case 13: int16_block_avx2(a, m0, nb0 + t, 3, 1, w8a8); break;                        \
            default: int16_block_avx2(a, m0, nb0 + t, 4, 1, w8a8); break;                        \
            }                                                                                    \
            t += T;                                                                              \
        }                                                                                        \
    }

#endif
