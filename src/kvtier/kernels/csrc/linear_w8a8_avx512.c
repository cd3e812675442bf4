/* The int8 linear with int8 activations (W8A8, compressed-tensors' dynamic per-token scheme),
 * with AVX512-VNNI, BF16 or not (KVTIER_AVX512_W8A8): each row of x is quantized on the fly to
 * int8 with one scale (its largest magnitude over 127; x times the scale's inverse, rounded to
 * nearest even and clamped: vLLM's dynamic per-token int8, step for step), and
 * VPDPBUSD multiplies four k at a time, 64 products an instruction against VPDPWSSD's 32 and
 * VDPBF16PS's 32: above a few rows, where the W8A16 paths are bound by their multiply-adds, this
 * does twice the products a cycle. The instruction takes one unsigned operand: the weights are
 * packed as w + 128 (kvtier_linear_w8a8_pack), and a row's sum loses 128 × its quantized values'
 * sum. Each column's int32 sum is exact (|k| < 2^16), then scaled once: (sum × column scale) ×
 * row scale, the bias, one bfloat16 rounding (linear_store). Weights are laid out as the int8
 * tiles (16 columns by 32 k, [Nb][Kb]), inside a tile as 8 quads of k by 16 columns, a 64-byte
 * vector each (linear.c dispatches; docs/kernels.md). */
#include <math.h>
#include <stdlib.h>

#include "linear.h"

#if defined(KVTIER_AVX512_W8A8)
#include "linear_blocks.h"

void linear_w8a8_quantize_rows(const void *ctx, int64_t r0, int64_t r1) {
    const Job *a = ctx;
    const int64_t kpad = (a->k + 31) / 32 * 32;
    int8_t *xq = (int8_t *)a->xq8; /* the call's scratch, each row written by one thread */
    float *xs = (float *)a->xs;
    int32_t *xsum = (int32_t *)a->xsum;
    for (int64_t row = r0; row < r1; row++) {
        const uint16_t *x = a->x + row * a->x_stride;
        int8_t *q = xq + row * kpad;
        __m512 vmax = _mm512_setzero_ps();
        int nan = 0;
        for (int64_t i = 0; i < a->k; i += 16) {
            const int left = a->k - i < 16 ? (int)(a->k - i) : 16;
            const __mmask16 mask = (__mmask16)((1u << left) - 1u);
            const __m512 v = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, x + i)), 16));
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; /* max_ps drops NaN */
            vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
        }
        const float amax = _mm512_reduce_max_ps(vmax);
        memset(q, 0, (size_t)kpad);
        if (nan || !isfinite(amax) || amax == 0.0f) { /* zeros: 0; NaN / inf: NaN outputs */
            xs[row] = nan || !isfinite(amax) ? NAN : 0.0f;
            xsum[row] = 0;
            continue;
        }
        const float scale = amax / 127.0f;
        const __m512 s = _mm512_set1_ps((float)(1.0 / scale)); /* vLLM's inverse, in double */
        __m512i sum = _mm512_setzero_si512();
        for (int64_t i = 0; i < a->k; i += 16) {
            const int left = a->k - i < 16 ? (int)(a->k - i) : 16;
            const __mmask16 mask = (__mmask16)((1u << left) - 1u);
            const __m512 v = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, x + i)), 16));
            /* x × (1 / scale) rounded to nearest even (the conversion's mode), then clamped */
            const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(v, s));
            const __m512i c = _mm512_max_epi32(_mm512_min_epi32(r, _mm512_set1_epi32(127)),
                                               _mm512_set1_epi32(-128));
            sum = _mm512_add_epi32(sum, _mm512_maskz_mov_epi32(mask, c));
            _mm_mask_storeu_epi8(q + i, mask, _mm512_cvtepi32_epi8(c));
        }
        xs[row] = scale;
        xsum[row] = _mm512_reduce_add_epi32(sum);
    }
}

/* acc += the products of w's unsigned bytes and x's signed ones, four a lane. In asm: with the
 * intrinsic GCC (12) copies accumulators between registers around each instruction and spills
 * the blocks of 6-8 rows to the stack, which ran the kernel at a third of VPDPBUSD's rate. */
#define DPBUSD(acc, w, x) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x))

/* b's rows by T column tiles (R = b->rows): R × T int32 sums over all of k in registers; per k
 * quad, each tile's quad (16 columns' 4 bytes) is loaded once and multiplied by every row's 4
 * bytes broadcast */
static inline __attribute__((always_inline)) void w8a8_block(const Job *a, const Block *b,
                                                              const int R, const int T) {
    const int64_t kbs = (a->k + 31) / 32, kpad = kbs * 32, m0 = b->m0;
    const int8_t *w = (const int8_t *)b->w;
    __m512i acc[8][4];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[i][t] = _mm512_setzero_si512();
    const int8_t *xq[8];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) xq[i] = a->xq8 + (m0 + i) * kpad;
    for (int64_t kb = 0; kb < kbs; kb++) {
        block_prefetch(b, kb, kbs);
        const int8_t *wk = w + kb * 512;
#pragma GCC unroll 1
        for (int r = 0; r < 8; r++) {
            __m512i wt[4];
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) wt[t] = _mm512_loadu_si512(wk + t * kbs * 512 + r * 64);
#pragma GCC unroll 8
            for (int i = 0; i < R; i++) {
                int32_t quad;
                memcpy(&quad, xq[i] + kb * 32 + r * 4, sizeof quad);
                const __m512i xb = _mm512_set1_epi32(quad);
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) DPBUSD(acc[i][t], wt[t], xb);
            }
        }
    }
    float out[8 * 16] __attribute__((aligned(64)));
#pragma GCC unroll 4 /* constant indices: the accumulators stay in registers */
    for (int t = 0; t < T; t++) {
        const int64_t n0 = (b->nb0 + t) * 16;
        const int cols = a->n - n0 < 16 ? (int)(a->n - n0) : 16;
        const __m512 ws = _mm512_maskz_loadu_ps((__mmask16)((1u << cols) - 1u), a->scales + n0);
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) {
            const __m512i exact =
                _mm512_sub_epi32(acc[i][t], _mm512_set1_epi32(128 * a->xsum[m0 + i]));
            const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(exact), ws),
                                           _mm512_set1_ps(a->xs[m0 + i]));
            _mm512_store_ps(out + i * 16, v);
        }
        block_store(a, out, m0, R, n0);
    }
}

static void w8a8_run(const Job *a, const Block *b) {
    switch (BLOCK_KEY(b->rows, b->tiles)) { BLOCK_CASES_8X4(w8a8_block) }
}

/* items [i0, i1) as the bfloat16 path runs them (linear_blocks), on the W8A8 tiles */
void linear_w8a8_groups(const void *ctx, int64_t i0, int64_t i1) {
    const Job *a = (const Job *)ctx;
    linear_blocks(a, i0, i1, a->packed8, 1, w8a8_run, NULL);
}
#endif
