/* The float path's two steps (attention.h) on AVX-512F: keys loaded as whole rows and transposed
 * in registers, up to four query rows scored and weighed together, the exponential of vec512.h
 * (docs/architecture.md §Kernels). */
#include "attention.h"

#if defined(KVTIER_AVX512)
#include "vec512.h"

static inline __m512 load16(const void *base, int64_t offset, int dtype) {
    if (dtype >= KV_E4M3) return fp8x16_ps((const uint8_t *)base + offset, dtype);
    if (dtype == KV_BF16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + offset));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + offset);
}

void attention_keys_t(const void *cache, int64_t kbase, int64_t vbase, int64_t stride, int64_t n,
                      int64_t D, int dtype, float *kt, float *vf) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) { /* keys: rows loaded whole, transposed in registers */
        __m512 r[16];
        for (int64_t j = 0; j < 16; j++)
            r[j] = j < n ? load16(cache, kbase + j * stride + d0, dtype) : _mm512_setzero_ps();
        transpose16(r);
        for (int64_t d = 0; d < 16; d++) _mm512_store_ps(kt + (d0 + d) * CHUNK, r[d]);
    }
    for (int64_t j = 0; j < n; j++)
        for (int64_t d = 0; d < D; d += 16)
            _mm512_store_ps(vf + j * D + d, load16(cache, vbase + j * stride + d, dtype));
}

/* R query rows at once (R a constant after inlining: 4, 2 or 1), so each key and value vector
 * loaded serves R rows. Row g is qr + g * D, its state m[g], l[g], acc + g * D. */
static inline __attribute__((always_inline)) void softmax_rows(
    const int R, const float *qr, const float *kt, const float *vf, int64_t D, int64_t lo,
    int64_t hi, float softcap, float *m, float *l, float *acc) {
    __m512 sc[4], p[4];
    for (int g = 0; g < R; g++) sc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m512 k = _mm512_load_ps(kt + d * CHUNK);
        for (int g = 0; g < R; g++) sc[g] = _mm512_fmadd_ps(_mm512_set1_ps(qr[g * D + d]), k, sc[g]);
    }
    const __mmask16 valid = (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
    for (int g = 0; g < R; g++) {
        if (softcap > 0.0f) {
            float tmp[CHUNK];
            _mm512_storeu_ps(tmp, sc[g]);
            for (int64_t j = lo; j < hi; j++) tmp[j] = softcap * tanhf(tmp[j] / softcap);
            sc[g] = _mm512_loadu_ps(tmp);
        }
        const float mx = raise_max(_mm512_mask_reduce_max_ps(valid, sc[g]), D, m + g, l + g,
                                   acc + g * D);
        p[g] = _mm512_maskz_mov_ps(valid, exp_nonpositive(_mm512_sub_ps(sc[g], _mm512_set1_ps(mx))));
        l[g] += _mm512_reduce_add_ps(p[g]);
    }
    float pj[4][CHUNK];
    for (int g = 0; g < R; g++) _mm512_storeu_ps(pj[g], p[g]);
    for (int64_t d = 0; d < D; d += 16) {
        __m512 t[4];
        for (int g = 0; g < R; g++) t[g] = _mm512_load_ps(acc + g * D + d);
        for (int64_t j = lo; j < hi; j++) {
            const __m512 v = _mm512_load_ps(vf + j * D + d);
            for (int g = 0; g < R; g++) t[g] = _mm512_fmadd_ps(_mm512_set1_ps(pj[g][j]), v, t[g]);
        }
        for (int g = 0; g < R; g++) _mm512_store_ps(acc + g * D + d, t[g]);
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
