/* The int8-weight linear's column groups (W8A16) on AVX512-BF16: a tile row's 32 int8 weights
 * are widened to bfloat16 in registers (exact: every int8 is a bfloat16) and multiplied as the
 * bfloat16 path does, a row's pair broadcast against it by VDPBF16PS; each column's float32 sum
 * is multiplied by its scale once, before the bias and the one rounding (linear.c dispatches;
 * docs/kernels.md). Decode reads every weight once a step, so half the bytes of bfloat16 is
 * what pays; the widening is shared by every row of a block. */
#include "linear.h"

#if defined(KVTIER_AVX512BF16)
#include <immintrin.h>

/* a tile row: 16 columns' pair of int8 → 32 bfloat16 in VDPBF16PS's pair order */
static inline __m512bh widen(const int8_t *p) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

static inline __attribute__((always_inline)) void i8_block(const Job *a, const int8_t *w,
                                                            int64_t m0, int64_t nb0, const char *pf,
                                                            int64_t pf_lines, const int R,
                                                            const int T) {
    const int64_t kbs = (a->k + 31) / 32, full = a->k / 32;
    __m512 acc[8][4];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[i][t] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < kbs; kb++) {
        for (int64_t l = kb * pf_lines / kbs; l < (kb + 1) * pf_lines / kbs; l++)
            _mm_prefetch(pf + l * 64, _MM_HINT_T1);
        const uint16_t *xs[8];
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) xs[i] = x_block(a, m0 + i, kb, full);
        const int8_t *b = w + kb * 512;
#pragma GCC unroll 1
        for (int r = 0; r < 16; r++) {
            __m512bh wt[4];
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) wt[t] = widen(b + t * kbs * 512 + r * 32);
#pragma GCC unroll 8
            for (int i = 0; i < R; i++) {
                int32_t pair;
                memcpy(&pair, xs[i] + 2 * r, sizeof pair);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], xb, wt[t]);
            }
        }
    }
    float out[4][8 * 16] __attribute__((aligned(64)));
    for (int t = 0; t < T; t++) {
        const int64_t n0 = (nb0 + t) * 16;
        const int cols = a->n - n0 < 16 ? (int)(a->n - n0) : 16;
        const __m512 s = _mm512_maskz_loadu_ps((__mmask16)((1u << cols) - 1u), a->scales + n0);
        for (int i = 0; i < R; i++) _mm512_store_ps(out[t] + i * 16, _mm512_mul_ps(acc[i][t], s));
        linear_store(a, out[t], m0, R, n0);
    }
}

#define I8_PREFETCH_MAX (256 << 10) /* a next group's bytes prefetched into L2, at most */
#define I8_CASE(R, T)                                     \
    case (R) * 8 + (T):                                   \
        i8_block(a, w, m0, nb0, pf, pf_lines, (R), (T));  \
        break;
#define I8_CASES3(R) I8_CASE(R, 1) I8_CASE(R, 2) I8_CASE(R, 3)
#define I8_CASES(R) I8_CASES3(R) I8_CASE(R, 4)

/* items [i0, i1) as the bfloat16 path runs them (linear_avx512bf16.c), on int8 tiles */
void linear_i8_avx512bf16_groups(const void *ctx, int64_t i0, int64_t i1) {
    const Job *a = (const Job *)ctx;
    const int64_t nbs = (a->n + 15) / 16, kbs = (a->k + 31) / 32;
    const int64_t T = a->tiles, R = a->rows;
    for (int64_t item = i0; item < i1; item++) {
        int64_t g, r0, r1;
        item_span(a, item, &g, &r0, &r1);
        const int64_t nb0 = g * T, blocks = (r1 - r0 + R - 1) / R;
        const int tiles = nbs - nb0 < T ? (int)(nbs - nb0) : (int)T;
        const int8_t *w = a->packed8 + nb0 * kbs * 512;
        const int64_t next_tiles =
            item + 1 < i1 && g + 1 < a->groups ? (nbs - nb0 - T < T ? nbs - nb0 - T : T) : 0;
        const int64_t next_bytes = next_tiles * kbs * 512;
        const int prefetch = blocks > 1 && next_bytes > 0 && next_bytes <= I8_PREFETCH_MAX;
        const int64_t share = prefetch ? (next_bytes / 64 + blocks - 1) / blocks : 0;
        for (int64_t m0 = r0; m0 < r1; m0 += R) {
            const int rows = r1 - m0 < R ? (int)(r1 - m0) : (int)R;
            const int64_t j = (m0 - r0) / R, first = j * share;
            const char *pf = (const char *)(w + tiles * kbs * 512) + first * 64;
            int64_t pf_lines = 0;
            if (prefetch && first < next_bytes / 64)
                pf_lines = first + share <= next_bytes / 64 ? share : next_bytes / 64 - first;
            switch (rows * 8 + tiles) {
                I8_CASES(1) I8_CASES(2) I8_CASES(3) I8_CASES(4) I8_CASES(5) I8_CASES(6)
                I8_CASES3(7) I8_CASES3(8)
            }
        }
    }
}
#endif
