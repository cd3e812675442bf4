/* The elementwise kernels' vector prefixes on AVX-512F (fused.h dispatches; docs/architecture.md
 * §Kernels): argmax's scan and search, and the top-k / top-p filter's first pass and gather, each
 * over a row's whole 16-element vectors; fused.c's loops finish the row. */
#include <math.h>

#include "fused.h"

#if defined(KVTIER_AVX512)
#include "vec512.h"

static inline __m512 argmax_vec(const void *x, int64_t i, int dtype) {
    if (dtype != 1) return _mm512_loadu_ps((const float *)x + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

int64_t fused_argmax_scan(const void *x, int64_t n, int dtype, float *m, int *nan) {
    __m512 vm = _mm512_set1_ps(-INFINITY);
    __mmask16 vnan = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = argmax_vec(x, i, dtype);
        vnan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vm = _mm512_max_ps(vm, v);
    }
    *m = _mm512_reduce_max_ps(vm);
    *nan = vnan != 0;
    return i;
}

int64_t fused_argmax_find(const void *x, int64_t n, int dtype, float m, int nan, int64_t *at) {
    const __m512 target = _mm512_set1_ps(m);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = argmax_vec(x, i, dtype);
        const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                  : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
        if (hit) {
            *at = i + __builtin_ctz((unsigned)hit);
            return -1;
        }
    }
    return i;
}

int64_t fused_gather(const float *x, const float *e, int64_t n, float floor, FilterScratch *s,
                     int64_t *count) {
    const __m512 f = _mm512_set1_ps(floor);
    const __m512i lanes16 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    int64_t c = *count, i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __mmask16 hit = _mm512_cmp_ps_mask(v, f, _CMP_GE_OQ);
        if (!hit) continue;
        const __m512i u = _mm512_castps_si512(v);
        const __mmask16 neg = _mm512_test_epi32_mask(u, sign);
        const __m512i key = _mm512_mask_xor_epi32(_mm512_or_si512(u, sign), neg, u,
                                                  _mm512_set1_epi32(-1));
        _mm512_mask_compressstoreu_epi32(s->key + c, hit, key);
        _mm512_mask_compressstoreu_epi32(s->idx + c, hit,
                                         _mm512_add_epi32(lanes16, _mm512_set1_epi32((int)i)));
        _mm512_mask_compressstoreu_ps(s->w + c, hit,
                                      e ? _mm512_loadu_ps(e + i) : _mm512_set1_ps(1.0f));
        c += __builtin_popcount((unsigned)hit);
    }
    *count = c;
    return i;
}

int64_t fused_reaches(const float *x, int64_t n, float m, int use_p, const float *reach,
                      float *count, float *mass, float *e, float *z) {
    __m512 vz = _mm512_setzero_ps(), vmass[REACHES];
    int64_t vcount[REACHES] = {0}, i = 0;
    const __m512 vm = _mm512_set1_ps(m), lowest = _mm512_set1_ps(-87.3f);
    for (int j = 0; j < REACHES; j++) vmass[j] = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        __m512 ev = _mm512_setzero_ps();
        if (use_p) {
            const __m512 d = _mm512_sub_ps(v, vm);
            ev = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, lowest, _CMP_GE_OQ),
                                     exp_clamped(_mm512_max_ps(d, lowest)));
            _mm512_storeu_ps(e + i, ev);
            vz = _mm512_add_ps(vz, ev);
        }
        for (int j = 0; j < REACHES; j++) {
            const __mmask16 in = _mm512_cmp_ps_mask(v, _mm512_set1_ps(reach[j]), _CMP_GE_OQ);
            vcount[j] += __builtin_popcount((unsigned)in);
            vmass[j] = _mm512_mask_add_ps(vmass[j], in, vmass[j], ev);
        }
    }
    *z = _mm512_reduce_add_ps(vz);
    for (int j = 0; j < REACHES; j++) {
        count[j] = (float)vcount[j];
        mass[j] = _mm512_reduce_add_ps(vmass[j]);
    }
    return i;
}
#endif
