/* The int8-weight linear's column groups (W8A16) for a few rows with AVX512-BF16, and at every
 * row count on AVX-512 CPUs without it (Skylake-SP, Cascade Lake, Ice Lake; KVTIER_AVX512_INT8):
 * each row of x is turned into int16 fixed point a k block of 32 at a time (the block's largest
 * magnitude sets its power-of-two scale, 2^14 ≤ that value's image < 2^15: every bfloat16 within
 * 2^7 of the block's largest is exact, the others off by at most 2^-15 of it), a tile row's int8
 * weights are sign-extended to int16, and VPDPWSSD (without AVX512-VNNI, VPMADDWD + VPADDD: the
 * same sums) sums each k block exactly in int32; the block's sum is
 * scaled into a float32 accumulator, a column's scale applied once at the end, then the bias
 * and the one bfloat16 rounding (linear_store). Decode reads every weight once a step: widening
 * int8 to bfloat16 for VDPBF16PS took five instructions a tile row and bound the call by
 * arithmetic; this takes one (linear.c dispatches; docs/kernels.md). */
#include <math.h>
#include <stdlib.h>

#include "linear.h"

#if defined(KVTIER_AVX512_INT8)
#include "linear_blocks.h"

void linear_i8_quantize_x(const Job *a, int16_t *xq, float *xs) {
    const int64_t kbs = (a->k + 31) / 32;
    for (int64_t row = 0; row < a->m; row++)
        for (int64_t kb = 0; kb < kbs; kb++) {
            const int64_t left = a->k - kb * 32;
            const __mmask32 mask = left >= 32 ? 0xffffffffu : (__mmask32)((1u << left) - 1u);
            const __m512i h = _mm512_maskz_loadu_epi16(mask, a->x + row * a->x_stride + kb * 32);
            const __m512 lo = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
            const __m512 hi = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            int16_t *out = xq + (row * kbs + kb) * 32;
            float *scale = xs + row * kbs + kb;
            const int nan = _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) |
                            _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q); /* max_ps drops NaN */
            if (nan || !(amax > 0.0f) || !isfinite(amax)) { /* NaN / inf, kept as NaN; or zeros */
                memset(out, 0, 64);
                *scale = !nan && amax == 0.0f ? 0.0f : NAN;
                continue;
            }
            const int e = ilogbf(amax);
            const __m512 up = _mm512_set1_ps((float)(14 - e));
            _mm256_storeu_si256((__m256i *)out,
                                _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_scalef_ps(lo, up))));
            _mm256_storeu_si256((__m256i *)(out + 16),
                                _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_scalef_ps(hi, up))));
            *scale = ldexpf(1.0f, e - 14);
        }
}

/* acc + each lane's two int16 products of x and w: VPDPWSSD, or VPMADDWD + VPADDD without
 * AVX512-VNNI (Skylake-SP), the same int32 bits (a pair is at most 2 × 2^15 × 128: neither
 * instruction saturates or overflows) */
static inline __m512i dot_pairs(__m512i acc, __m512i x, __m512i w) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, x, w);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(x, w));
#endif
}

/* b's rows by T column tiles (R = b->rows): per k block, R × T int32 sums; W8A16 (`w8a8` 0)
 * scales each into a float32 accumulator by its row's k-block scale, W8A8 (x quantized per row,
 * linear_w8a8_avx2_quantize_rows) adds them into int32 totals, scaled once at the end. Summing
 * all of k into the block's sums instead ran one row at half the speed. */
static inline __attribute__((always_inline)) void int16_block(const Job *a, const Block *b,
                                                               const int R, const int T,
                                                               const int w8a8) {
    const int64_t kbs = (a->k + 31) / 32, m0 = b->m0;
    const int8_t *w = (const int8_t *)b->w;
    __m512 acc[4][4];
    __m512i tot[4][4];
#pragma GCC unroll 4
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            acc[i][t] = _mm512_setzero_ps();
            tot[i][t] = _mm512_setzero_si512();
        }
    for (int64_t kb = 0; kb < kbs; kb++) {
        block_prefetch(b, kb, kbs);
        const int8_t *wk = w + kb * 512;
        __m512i sum[4][4];
#pragma GCC unroll 4
        for (int i = 0; i < R; i++)
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) sum[i][t] = _mm512_setzero_si512();
        const int32_t *xp[4];
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) xp[i] = (const int32_t *)(a->xq + ((m0 + i) * kbs + kb) * 32);
#pragma GCC unroll 4
        for (int r = 0; r < 16; r++) {
            __m512i wt[4];
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
                wt[t] = _mm512_cvtepi8_epi16(
                    _mm256_loadu_si256((const __m256i *)(wk + t * kbs * 512 + r * 32)));
#pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                const __m512i xb = _mm512_set1_epi32(xp[i][r]);
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) sum[i][t] = dot_pairs(sum[i][t], xb, wt[t]);
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            if (w8a8) {
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) tot[i][t] = _mm512_add_epi32(tot[i][t], sum[i][t]);
                continue;
            }
            const __m512 s = _mm512_set1_ps(a->xs[(m0 + i) * kbs + kb]);
#pragma GCC unroll 4
            for (int t = 0; t < T; t++)
                acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i][t]), s, acc[i][t]);
        }
    }
    float out[4][4 * 16] __attribute__((aligned(64)));
    for (int t = 0; t < T; t++) {
        const int64_t n0 = (b->nb0 + t) * 16;
        const int cols = a->n - n0 < 16 ? (int)(a->n - n0) : 16;
        const __m512 s = _mm512_maskz_loadu_ps((__mmask16)((1u << cols) - 1u), a->scales + n0);
        for (int i = 0; i < R; i++) {
            /* W8A8: (sum × column scale) × row scale, as linear_w8a8_avx2.c and the reference */
            const __m512 v = w8a8 ? _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(tot[i][t]), s),
                                                  _mm512_set1_ps(a->xs[m0 + i]))
                                  : _mm512_mul_ps(acc[i][t], s);
            _mm512_store_ps(out[t] + i * 16, v);
        }
        block_store(a, out[t], m0, R, n0);
    }
}

static inline __attribute__((always_inline)) void i8_block(const Job *a, const Block *b,
                                                            const int R, const int T) {
    int16_block(a, b, R, T, 0);
}

/* the int16 blocks' shapes (linear.c): up to 2 rows by 4 tiles, 3-4 rows by 2 (the int32 sums
 * and the accumulators both in registers) */
#define INT16_T2(body, R) BLOCK_CASE(body, R, 1) BLOCK_CASE(body, R, 2)
#define INT16_T4(body, R) INT16_T2(body, R) BLOCK_CASE(body, R, 3) BLOCK_CASE(body, R, 4)
#define INT16_SHAPES(body) INT16_T4(body, 1) INT16_T4(body, 2) INT16_T2(body, 3) INT16_T2(body, 4)

static void i8_run(const Job *a, const Block *b) {
    switch (BLOCK_KEY(b->rows, b->tiles)) { INT16_SHAPES(i8_block) }
}

/* items [i0, i1) as the bfloat16 path runs them (linear_blocks), on int8 tiles: blocks of
 * a->rows rows (up to 2 rows by 4 tiles, or up to 4 by 2: int32 sums and float32 accumulators
 * both in registers) */
void linear_i8_avx512_groups(const void *ctx, int64_t i0, int64_t i1) {
    const Job *a = (const Job *)ctx;
    linear_blocks(a, i0, i1, a->packed8, 1, i8_run, NULL);
}

#if defined(KVTIER_W8A8_AVX2) /* AVX-512 without VNNI (Skylake-SP): W8A8 on these blocks */
static inline __attribute__((always_inline)) void w8a8_block(const Job *a, const Block *b,
                                                              const int R, const int T) {
    int16_block(a, b, R, T, 1);
}

static void w8a8_run(const Job *a, const Block *b) {
    switch (BLOCK_KEY(b->rows, b->tiles)) { INT16_SHAPES(w8a8_block) }
}

/* W8A8's items on the W8A16 int8 tiles, x's rows quantized per row into int16
 * (linear_w8a8_avx2_quantize_rows): the bits of linear_w8a8_avx2.c and the reference */
void linear_w8a8_i16_groups(const void *ctx, int64_t i0, int64_t i1) {
    const Job *a = (const Job *)ctx;
    linear_blocks(a, i0, i1, a->packed8, 1, w8a8_run, NULL);
}
#endif

#if defined(KVTIER_AVX512VNNI) /* with AVX512-BF16 */
/* A thread's widened column group, kept between calls and grown for a larger k; never freed
 * (the pool's helpers and the engine's worker live as long as the process; fused.c's filter
 * scratch is kept the same way) */
static __thread uint16_t *wide_mem;
static __thread size_t wide_size;

/* items [i0, i1) above a few rows: each column group's int8 tiles widened into bfloat16 once,
 * then the bfloat16 path's register blocks (linear_blocks) on them */
void linear_i8_wide_groups(const void *ctx, int64_t i0, int64_t i1) {
    Job *a = (Job *)ctx;
    const size_t need = (size_t)a->tiles * (size_t)((a->k + 31) / 32) * 512 * sizeof(uint16_t);
    if (wide_size < need) {
        free(wide_mem);
        wide_mem = aligned_alloc(64, need);
        wide_size = wide_mem ? need : 0;
        if (!wide_mem) {
            __atomic_store_n(&a->status, -1, __ATOMIC_RELAXED);
            return;
        }
    }
    linear_blocks(a, i0, i1, a->packed8, 1, linear_avx512bf16_block, wide_mem);
}
#endif
#endif
