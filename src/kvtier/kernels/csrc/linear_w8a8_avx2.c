/* The W8A8 linear on AVX2 with FMA where AVX512-VNNI is not built (x86-64-v3, and AVX-512 CPUs
 * without VNNI such as Skylake-SP: KVTIER_W8A8_AVX2): linear_w8a8_avx512.c's bits without
 * VPDPBUSD.
 * Each row of x is quantized to int8 by the same rule (its largest magnitude over 127; x times
 * the scale's inverse taken in double, rounded to nearest even and clamped), kept as int16; the
 * weights are the W8A16 int8 tiles (kvtier_linear_i8_pack's: a tile row holds 16 columns' k
 * pair), sign-extended to int16 as they are loaded; VPMADDWD + VPADDD sum each column's
 * products exactly in int32 (a pair is at most 2 × 128 × 128, and k < 2^16 keeps a sum below
 * 2^31), then (sum × column scale) × row scale, the bias, one bfloat16 rounding. An int16 pair
 * product is two multiply-adds an instruction, as in the W8A16 AVX2 path (linear_i8_avx2.c),
 * whose register blocks and column groups this shares; where that path scales each k block's
 * sums into float32, this adds them into int32 totals (linear.c dispatches; docs/kernels.md). */
#include <math.h>

#include "linear.h"

#if defined(KVTIER_W8A8_AVX2)
#include "linear_int8_avx2.h"

/* k block kb of a row of x (32 bf16), zero past k */
static inline const uint16_t *row_block(const uint16_t *x, int64_t k, int64_t kb, uint16_t *part) {
    const int64_t left = k - kb * 32;
    if (left >= 32) return x + kb * 32;
    memset(part, 0, 64);
    memcpy(part, x + kb * 32, (size_t)left * 2);
    return part;
}

/* rows [r0, r1) of a job's x quantized into its xq (int16, [m][k blocks × 32], zero past k) and
 * xs (a scale a row: 0 for a row of zeros, NaN for a row with a NaN or an infinity, whose
 * values are then zeros) */
void linear_w8a8_avx2_quantize_rows(const void *ctx, int64_t r0, int64_t r1) {
    const Job *a = ctx;
    const int64_t kbs = (a->k + 31) / 32;
    int16_t *xq = (int16_t *)a->xq; /* the call's scratch, each row written by one thread */
    float *xs = (float *)a->xs;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    uint16_t part[32];
    for (int64_t row = r0; row < r1; row++) {
        const uint16_t *x = a->x + row * a->x_stride;
        int16_t *q = xq + row * kbs * 32;
        __m256 vmax = _mm256_setzero_ps();
        int nan = 0;
        for (int64_t kb = 0; kb < kbs; kb++) {
            const uint16_t *src = row_block(x, a->k, kb, part);
            for (int h = 0; h < 4; h++) {
                const __m256 v = widen_bf16(_mm_loadu_si128((const __m128i *)(src + h * 8)));
                nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)); /* max drops NaN */
                vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));
            }
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, vmax);
        float amax = 0.0f;
        for (int i = 0; i < 8; i++) amax = lanes[i] > amax ? lanes[i] : amax;
        if (nan || !isfinite(amax) || amax == 0.0f) {
            memset(q, 0, (size_t)(kbs * 32) * sizeof(int16_t));
            xs[row] = nan || !isfinite(amax) ? NAN : 0.0f;
            continue;
        }
        const float scale = amax / 127.0f;
        const __m256 s = _mm256_set1_ps((float)(1.0 / scale)); /* vLLM's inverse, in double */
        const __m256i lo = _mm256_set1_epi32(-128), hi = _mm256_set1_epi32(127);
        for (int64_t kb = 0; kb < kbs; kb++) {
            const uint16_t *src = row_block(x, a->k, kb, part);
            for (int h = 0; h < 4; h += 2) {
                /* x × (1 / scale) rounded to nearest even (the conversion's mode), clamped */
                __m256i c[2];
                for (int j = 0; j < 2; j++) {
                    const __m256 v =
                        widen_bf16(_mm_loadu_si128((const __m128i *)(src + (h + j) * 8)));
                    c[j] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v, s)),
                                                             hi), lo);
                }
                /* packs interleaves 128-bit halves: put them back in order */
                const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xd8);
                _mm256_storeu_si256((__m256i *)(q + kb * 32 + h * 8), packed);
            }
        }
        xs[row] = scale;
    }
}

INT8_AVX2_ROWS(w8a8_rows, 1)

/* Items [i0, i1): column groups by row blocks (item_row_blocks) */
void linear_w8a8_avx2_groups(const void *job, int64_t i0, int64_t i1) {
    item_row_blocks(job, i0, i1, w8a8_rows);
}

#endif
