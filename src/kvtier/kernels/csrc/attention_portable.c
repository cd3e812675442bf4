/* The float path's two steps (attention.h) in plain C, for every ISA without AVX-512F or AVX2
 * (docs/architecture.md §Kernels). */
#include "attention.h"

#if !defined(KVTIER_AVX512) && !defined(KVTIER_AVX2)
#include <math.h>

void attention_keys_t(const void *cache, int64_t kbase, int64_t vbase, int64_t stride, int64_t n,
                      int64_t D, int dtype, float *kt, float *vf) {
    float row[512];
    for (int64_t j = 0; j < CHUNK; j++) {
        if (j >= n) {
            for (int64_t d = 0; d < D; d++) kt[d * CHUNK + j] = 0.0f;
            continue;
        }
        load_row(cache, kbase + j * stride, D, dtype, row);
        for (int64_t d = 0; d < D; d++) kt[d * CHUNK + j] = row[d];
        load_row(cache, vbase + j * stride, D, dtype, vf + j * D);
    }
}

static inline float exp_nonpositive(float x) { /* about 2 ulp; 0 below -87 */
    if (x < -87.0f) return 0.0f;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return ldexpf(p * r * r + r + 1.0f, (int)n);
}

static void softmax_row(const float *qr, const float *kt, const float *vf, int64_t D, int64_t lo,
                        int64_t hi, float softcap, float *m, float *l, float *acc) {
    float sc[CHUNK] = {0};
    for (int64_t d = 0; d < D; d++)
        for (int j = 0; j < CHUNK; j++) sc[j] += qr[d] * kt[d * CHUNK + j];
    float mx = *m;
    for (int64_t j = lo; j < hi; j++) {
        if (softcap > 0.0f) sc[j] = softcap * tanhf(sc[j] / softcap);
        mx = sc[j] > mx ? sc[j] : mx;
    }
    if (mx > *m) {
        const float c = *m == -INFINITY ? 0.0f : expf(*m - mx);
        *l *= c;
        for (int64_t d = 0; d < D; d++) acc[d] *= c;
        *m = mx;
    }
    for (int64_t j = lo; j < hi; j++) {
        const float p = exp_nonpositive(sc[j] - mx);
        *l += p;
        for (int64_t d = 0; d < D; d++) acc[d] += p * vf[j * D + d];
    }
}

void attention_softmax(int64_t rows, const float *qr, const float *kt, const float *vf,
                       int64_t D, int64_t lo, int64_t hi, float softcap, float *m, float *l,
                       float *acc) {
    for (int64_t g = 0; g < rows; g++)
        softmax_row(qr + g * D, kt, vf, D, lo, hi, softcap, m + g, l + g, acc + g * D);
}
#endif
