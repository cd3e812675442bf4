/* The int8-weight linear (W8A16) on AVX2 with FMA without AVX-512 (x86-64-v3: KVTIER_INT8_AVX2),
 * at every row count: the AVX-512 int16 blocks' arithmetic (linear_i8_avx512.c) on 256-bit
 * registers.
 * x's rows become int16 fixed point a k block of 32 at a time (the same power-of-two scale a
 * block), a tile row's int8 weights are sign-extended to int16, and VPMADDWD + VPADDD sum each
 * k block exactly in int32 (VPDPWSSD's sum: no product pair can saturate, |x| < 2^15, |w| ≤ 127);
 * the block's sum is scaled into a float32 accumulator by FMA, a column's scale applied once at
 * the end, then the bias and the one bfloat16 rounding. So a row's bits equal the VNNI path's and
 * never depend on its batch. Without this a CPU of this kind dequantized every int8 weight to
 * bfloat16 on each call. Above a few rows the AVX-512 paths widen the weights to bfloat16 instead
 * (their multiply-adds are cheaper than the int16 blocks'); here an int16 pair product is one
 * instruction for two multiply-adds, as cheap as the bfloat16 path's FMAs, so one path serves
 * every row count (linear.c dispatches; docs/kernels.md). */
#include <math.h>

#include "linear.h"

#if defined(KVTIER_INT8_AVX2)
#include "linear_int8_avx2.h"

/* v * 2^s for s in [-150, 160], in two exact power-of-two steps (2^s alone may not be a float;
 * AVX-512's VSCALEFPS takes s as it is): the result is VSCALEFPS's wherever it rounds to a
 * nonzero int16 */
static inline __m256 scale_pow2(__m256 v, int s) {
    const int half = s / 2;
    return _mm256_mul_ps(_mm256_mul_ps(v, _mm256_set1_ps(ldexpf(1.0f, half))),
                         _mm256_set1_ps(ldexpf(1.0f, s - half)));
}

/* x's rows in int16 blocks as linear_i8_avx512.c makes them: a block's largest magnitude a with
 * 2^e ≤ a < 2^(e+1) scales it by 2^(14 - e), rounded to nearest even; a block with a NaN or an
 * infinity is zeros with a NaN scale, an all-zero block zeros with a zero scale */
void linear_i8_quantize_x(const Job *a, int16_t *xq, float *xs) {
    const int64_t kbs = (a->k + 31) / 32;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t row = 0; row < a->m; row++)
        for (int64_t kb = 0; kb < kbs; kb++) {
            const uint16_t *src = a->x + row * a->x_stride + kb * 32;
            const int64_t left = a->k - kb * 32;
            uint16_t part[32] = {0};
            if (left < 32) {
                memcpy(part, src, (size_t)left * 2);
                src = part;
            }
            __m256 v[4];
            int nan = 0;
            __m256 amax = _mm256_setzero_ps();
            for (int q = 0; q < 4; q++) {
                v[q] = widen_bf16(_mm_loadu_si128((const __m128i *)(src + q * 8)));
                nan |= _mm256_movemask_ps(_mm256_cmp_ps(v[q], v[q], _CMP_UNORD_Q));
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[q]));
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, amax);
            float m = 0.0f;
            for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
            int16_t *out = xq + (row * kbs + kb) * 32;
            float *scale = xs + row * kbs + kb;
            if (nan || !(m > 0.0f) || !isfinite(m)) {
                memset(out, 0, 64);
                *scale = !nan && m == 0.0f ? 0.0f : NAN;
                continue;
            }
            const int e = ilogbf(m);
            for (int q = 0; q < 4; q += 2) {
                const __m256i lo = _mm256_cvtps_epi32(scale_pow2(v[q], 14 - e));
                const __m256i hi = _mm256_cvtps_epi32(scale_pow2(v[q + 1], 14 - e));
                /* packs interleaves 128-bit halves: put them back in order */
                const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xd8);
                _mm256_storeu_si256((__m256i *)(out + q * 8), packed);
            }
            *scale = ldexpf(1.0f, e - 14);
        }
}

INT8_AVX2_ROWS(i8_rows, 0)

/* Items [i0, i1): column groups by row blocks (item_row_blocks) */
void linear_i8_avx2_groups(const void *job, int64_t i0, int64_t i1) {
    item_row_blocks(job, i0, i1, i8_rows);
}

#endif
