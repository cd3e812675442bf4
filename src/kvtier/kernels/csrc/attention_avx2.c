/* The float path's two steps (attention.h) on AVX2 with FMA and no AVX-512 (x86-64-v3): a
 * chunk's 16 scores in two 8-lane registers, keys transposed 8 × 8 in registers, up to four
 * query rows scored and weighed together, the exponential of vec512.h on 8 lanes. Here the
 * float path serves every bfloat16 item (the pairs and tiles need AVX512-BF16), and the portable
 * loops' scalar transpose and exponential cost more than the dot products (docs/kernels.md). */
#include "attention.h"

#if defined(KVTIER_AVX2)
#include <immintrin.h>

/* 8 fp8 codes as float32, exactly (internal.h fp8_to_f32's values), in integer lanes: a normal
 * code's exponent and mantissa shift into float32's and the exponent is rebiased, a subnormal
 * one is its mantissa times the format's smallest step, e4m3's 0x7f is NaN and e5m2's top
 * exponent ±inf or NaN. The scalar decode per element made an fp8 cache's attention 6–10×
 * slower than a bfloat16 cache's here; this costs what the bfloat16 widening does. */
static inline __m256 fp8x8_ps(const uint8_t *src, int kv_dtype) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)src));
    const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7f));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
    const int e4m3 = kv_dtype == KV_E4M3;
    const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, e4m3 ? 20 : 21),
                                            _mm256_set1_epi32(e4m3 ? 120 << 23 : 112 << 23));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag),
                                     _mm256_set1_ps(e4m3 ? 0x1p-9f : 0x1p-16f));
    const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(e4m3 ? 8 : 4), mag);
    __m256i bits = _mm256_blendv_epi8(normal, _mm256_castps_si256(sub), is_sub);
    if (e4m3) {
        const __m256i nan = _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f));
        bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7fc00000), nan);
    } else {
        const __m256i top = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7b)); /* exponent 31 */
        const __m256i special = _mm256_or_si256(
            _mm256_set1_epi32(0x7f800000),
            _mm256_slli_epi32(_mm256_and_si256(mag, _mm256_set1_epi32(3)), 21));
        bits = _mm256_blendv_epi8(bits, special, top);
    }
    return _mm256_castsi256_ps(_mm256_or_si256(bits, sign));
}

/* 8 elements of a row at base + offset as float32 */
static inline __m256 load8(const void *base, int64_t offset, int dtype) {
    if (dtype == KV_BF16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + offset));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (dtype == KV_F32) return _mm256_loadu_ps((const float *)base + offset);
    return fp8x8_ps((const uint8_t *)base + offset, dtype);
}

/* r[0..7] (row j: 8 floats) → r[0..7] (row d: lane j), in registers */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

void attention_keys_t(const void *cache, int64_t kbase, int64_t vbase, int64_t stride, int64_t n,
                      int64_t D, int dtype, float *kt, float *vf) {
    for (int64_t j0 = 0; j0 < CHUNK; j0 += 8)
        for (int64_t d0 = 0; d0 < D; d0 += 8) {
            __m256 r[8];
            for (int64_t j = 0; j < 8; j++)
                r[j] = j0 + j < n ? load8(cache, kbase + (j0 + j) * stride + d0, dtype)
                                  : _mm256_setzero_ps();
            transpose8(r);
            for (int64_t d = 0; d < 8; d++) _mm256_store_ps(kt + (d0 + d) * CHUNK + j0, r[d]);
        }
    for (int64_t j = 0; j < n; j++)
        for (int64_t d = 0; d < D; d += 8)
            _mm256_store_ps(vf + j * D + d, load8(cache, vbase + j * stride + d, dtype));
}

/* e^x on 8 lanes for x ≤ 0 (e^-87 below -87): vec512.h's exp_clamped, 2^n built in the
 * exponent field (n ≥ -126 here, so 2^n is a normal float) */
static inline __m256 exp_nonpositive8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* the online softmax's rescale when a row's max rises (vec512.h's raise_max) */
static inline float raise_max8(float new_max, int64_t D, float *m, float *l, float *acc) {
    if (!(new_max > *m)) return *m; /* NaN included: as before, no rescale */
    const float c = *m == -INFINITY ? 0.0f : expf(*m - new_max);
    *l *= c;
    for (int64_t d = 0; d < D; d += 8)
        _mm256_store_ps(acc + d, _mm256_mul_ps(_mm256_load_ps(acc + d), _mm256_set1_ps(c)));
    *m = new_max;
    return new_max;
}

/* R query rows at once (R a constant after inlining: 4, 2 or 1), so each key and value vector
 * loaded serves R rows. Row g is qr + g * D, its state m[g], l[g], acc + g * D. */
static inline __attribute__((always_inline)) void softmax_rows(
    const int R, const float *qr, const float *kt, const float *vf, int64_t D, int64_t lo,
    int64_t hi, float softcap, float *m, float *l, float *acc) {
    __m256 sc[4][2];
    for (int g = 0; g < R; g++) sc[g][0] = sc[g][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m256 k0 = _mm256_load_ps(kt + d * CHUNK), k1 = _mm256_load_ps(kt + d * CHUNK + 8);
        for (int g = 0; g < R; g++) {
            const __m256 q = _mm256_broadcast_ss(qr + g * D + d);
            sc[g][0] = _mm256_fmadd_ps(q, k0, sc[g][0]);
            sc[g][1] = _mm256_fmadd_ps(q, k1, sc[g][1]);
        }
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 valid[2];
    for (int h = 0; h < 2; h++) {
        const __m256i j = _mm256_add_epi32(lane, _mm256_set1_epi32(h * 8));
        valid[h] = _mm256_castsi256_ps(_mm256_and_si256(
            _mm256_cmpgt_epi32(j, _mm256_set1_epi32((int)lo - 1)),
            _mm256_cmpgt_epi32(_mm256_set1_epi32((int)hi), j)));
    }
    float pj[4][CHUNK] __attribute__((aligned(32)));
    for (int g = 0; g < R; g++) {
        float s[CHUNK] __attribute__((aligned(32)));
        _mm256_store_ps(s, sc[g][0]);
        _mm256_store_ps(s + 8, sc[g][1]);
        float mx = -INFINITY;
        for (int64_t j = lo; j < hi; j++) {
            if (softcap > 0.0f) s[j] = softcap * tanhf(s[j] / softcap);
            mx = s[j] > mx ? s[j] : mx;
        }
        mx = raise_max8(mx, D, m + g, l + g, acc + g * D);
        __m256 sum = _mm256_setzero_ps();
        for (int h = 0; h < 2; h++) {
            const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_load_ps(s + h * 8),
                                                            _mm256_set1_ps(mx)));
            const __m256 p = _mm256_and_ps(e, valid[h]);
            _mm256_store_ps(pj[g] + h * 8, p);
            sum = _mm256_add_ps(sum, p);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, sum);
        for (int i = 0; i < 8; i++) l[g] += lanes[i];
    }
    for (int64_t d = 0; d < D; d += 8) {
        __m256 t[4];
        for (int g = 0; g < R; g++) t[g] = _mm256_load_ps(acc + g * D + d);
        for (int64_t j = lo; j < hi; j++) {
            const __m256 v = _mm256_load_ps(vf + j * D + d);
            for (int g = 0; g < R; g++) t[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(pj[g] + j), v, t[g]);
        }
        for (int g = 0; g < R; g++) _mm256_store_ps(acc + g * D + d, t[g]);
    }
}

void attention_softmax(int64_t rows, const float *qr, const float *kt, const float *vf,
                       int64_t D, int64_t lo, int64_t hi, float softcap, float *m, float *l,
                       float *acc) {
    int64_t g = 0;
    for (; g + 4 <= rows; g += 4)
        softmax_rows(4, qr + g * D, kt, vf, D, lo, hi, softcap, m + g, l + g, acc + g * D);
    if (g + 2 <= rows) {
        softmax_rows(2, qr + g * D, kt, vf, D, lo, hi, softcap, m + g, l + g, acc + g * D);
        g += 2;
    }
    if (g < rows) softmax_rows(1, qr + g * D, kt, vf, D, lo, hi, softcap, m + g, l + g, acc + g * D);
}
#endif
