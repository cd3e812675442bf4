/* What the AVX-512 paths share (fused_avx512.c, attention_avx512*.c, attention_amx.c): the
 * exponential, the 16 × 16 transpose, the online softmax's rescale and the bfloat16 rounding
 * rule of internal.h on 16 lanes (docs/architecture.md §Kernels). Included only by files
 * compiled for AVX-512F (KVTIER_AVX512). */
#ifndef KVTIER_VEC512_H
#define KVTIER_VEC512_H

#include <math.h>

#include "internal.h"

#if defined(KVTIER_AVX512)
#include <immintrin.h>

/* e^x on 16 float32 lanes, about 2 ulp: Cody-Waite reduction by ln 2, Cephes' expf polynomial
 * with FMA, 2^n by vscalefps. The caller clamps x to the range it needs (and so decides what NaN
 * and ±inf give). */
static inline __m512 exp_clamped(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 exp_nonpositive(__m512 x) { /* about 2 ulp; e^-87 below -87 */
    return exp_clamped(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)));
}

/* r[0..15] (row j: 16 floats) → r[0..15] (row d: lane j), in registers */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    /* u[4k + m] holds, per 128-bit lane l, element m of rows 4l'..: combine lanes across rows */
    for (int m = 0; m < 4; m++) {
        const __m512 a = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x88);
        const __m512 b = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xdd);
        const __m512 c = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x88);
        const __m512 d = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xdd);
        r[m] = _mm512_shuffle_f32x4(a, c, 0x88);
        r[m + 8] = _mm512_shuffle_f32x4(a, c, 0xdd);
        r[m + 4] = _mm512_shuffle_f32x4(b, d, 0x88);
        r[m + 12] = _mm512_shuffle_f32x4(b, d, 0xdd);
    }
}

/* A row's running max m becomes max(m, new_max); its sum l and accumulator acc [D] are rescaled
 * to it. Returns the max. */
static inline float raise_max(float new_max, int64_t D, float *m, float *l, float *acc) {
    if (!(new_max > *m)) return *m; /* NaN included: as before, no rescale */
    const float c = *m == -INFINITY ? 0.0f : expf(*m - new_max);
    *l *= c;
    for (int64_t d = 0; d < D; d += 16)
        _mm512_store_ps(acc + d, _mm512_mul_ps(_mm512_load_ps(acc + d), _mm512_set1_ps(c)));
    *m = new_max;
    return new_max;
}

#if defined(__AVX512BW__)
/* 32 fp8 codes (widened to 16-bit lanes) as bfloat16, exactly, in integer lanes (internal.h fp8_to_f32's values): the
 * sign moves to bit 15, exponent and mantissa shift into bfloat16's and the exponent is rebiased;
 * subnormal codes come from a table; e4m3's 0x7f and e5m2's top exponent become NaN (and ±inf).
 * As cheap as an int8 code times a scale (docs/kernels.md, "8-bit KV"). */
static inline __m512i fp8_lanes_bf16(__m512i x, int kv_dtype) {
    static const uint16_t sub_e4m3[32] = {0, 0x3b00, 0x3b80, 0x3bc0, 0x3c00, 0x3c20, 0x3c40, 0x3c60};
    static const uint16_t sub_e5m2[32] = {0, 0x3780, 0x3800, 0x3840};
    const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi16(0x7f));
    const int e4m3 = kv_dtype == KV_E4M3;
    __m512i b = _mm512_add_epi16(_mm512_slli_epi16(mag, e4m3 ? 4 : 5),
                                 _mm512_set1_epi16(e4m3 ? (120 << 7) : (112 << 7)));
    const __mmask32 sub = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(e4m3 ? 8 : 4));
    b = _mm512_mask_permutexvar_epi16(b, sub, mag, _mm512_loadu_si512(e4m3 ? sub_e4m3 : sub_e5m2));
    if (e4m3) {
        b = _mm512_mask_mov_epi16(b, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f)),
                                  _mm512_set1_epi16(0x7fc0));
    } else {
        b = _mm512_mask_mov_epi16(b, _mm512_cmpge_epu16_mask(mag, _mm512_set1_epi16(0x7c)),
                                  _mm512_set1_epi16(0x7fc0));
        b = _mm512_mask_mov_epi16(b, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7c)),
                                  _mm512_set1_epi16(0x7f80));
    }
    return _mm512_or_si512(b, _mm512_slli_epi16(_mm512_andnot_si512(_mm512_set1_epi16(0x7f), x), 8));
}

static inline __m512i fp8x32_bf16(const uint8_t *src, int kv_dtype) {
    return fp8_lanes_bf16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)src)), kv_dtype);
}

/* 16 fp8 codes as float32 (their bfloat16 values widened) */
static inline __m512 fp8x16_ps(const uint8_t *src, int kv_dtype) {
    const __m256i c = _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)src));
    const __m256i h = _mm512_castsi512_si256(fp8_lanes_bf16(_mm512_cvtepu8_epi16(c), kv_dtype));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#else
static inline __m512 fp8x16_ps(const uint8_t *src, int kv_dtype) {
    float f[16];
    for (int j = 0; j < 16; j++) f[j] = fp8_to_f32(src[j], kv_dtype);
    return _mm512_loadu_ps(f);
}
#endif

static inline __m256i bf16_round_16(__m512 f) { /* internal.h f32_to_bf16 on 16 lanes */
    const __m512i u = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r =
        _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, quiet));
}
#endif

#endif
