/* The int8-weight linear's column groups on AMX (W8A16, linear.c dispatches above a few rows):
 * an item widens its column group's int8 tiles to bfloat16 once (exact), into a buffer of its
 * thread, and every row block of 16 multiplies them by TDPBF16PS; each column's float32 sum is
 * scaled once, before the bias and the one rounding. AMX-INT8 would need int8 activations
 * (W8A8), which changes the model's numbers; widening keeps bfloat16 activations, and the
 * widening is shared by every row of the item (docs/kernels.md). */
#include <stdlib.h>

#include "linear.h"

#if defined(KVTIER_AMX) && defined(KVTIER_AVX512BF16)
#include "amx.h"

/* a thread's widened column group: grown to the largest group it has run and kept, as the pool's
 * threads are (4 tiles × k / 32 blocks × 1 KiB: 1 MiB at k = 8192) */
static __thread uint16_t *wide;
static __thread int64_t wide_bytes;

static int reserve(int64_t bytes) {
    if (bytes <= wide_bytes) return 1;
    free(wide);
    wide = aligned_alloc(64, (size_t)bytes);
    wide_bytes = wide ? bytes : 0;
    return wide != NULL;
}

/* n int8 → bfloat16 (n a multiple of 32) */
static void widen_all(const int8_t *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i += 32) {
        const __m512 lo =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + i))));
        const __m512 hi = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + i + 16))));
        _mm512_store_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

static void configure(int rows) {
    const uint8_t r = (uint8_t)rows, tiles[8] = {r, r, r, r, r, 16, 16, 0};
    amx_configure(tiles);
}

void linear_i8_amx_groups(const void *ctx, int64_t i0, int64_t i1) {
    const Job *a = (const Job *)ctx;
    const int64_t nbs = (a->n + 15) / 16, kbs = (a->k + 31) / 32, full = a->k / 32;
    float acc[4][256] __attribute__((aligned(64)));
    int configured = 0;
    for (int64_t item = i0; item < i1; item++) {
        int64_t g, r0, r1;
        item_span(a, item, &g, &r0, &r1);
        const int64_t nb0 = g * 4;
        const int tiles = nbs - nb0 < 4 ? (int)(nbs - nb0) : 4;
        if (!reserve(tiles * kbs * 1024)) { /* no memory: the AVX512-BF16 path needs none */
            linear_i8_avx512bf16_groups(ctx, item, item + 1);
            continue;
        }
        widen_all(a->packed8 + nb0 * kbs * 512, wide, tiles * kbs * 512);
        for (int64_t m0 = r0; m0 < r1; m0 += 16) {
            const int rows = r1 - m0 < 16 ? (int)(r1 - m0) : 16;
            if (rows != configured) {
                configure(rows);
                configured = rows;
            }
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < kbs; kb++) {
                if (kb < full)
                    _tile_loadd(4, a->x + m0 * a->x_stride + kb * 32, a->x_stride * 2);
                else
                    _tile_loadd(4, a->tail + m0 * 32, 64);
                const uint16_t *b = wide + kb * 512;
                _tile_loadd(5, b, 64);
                _tile_dpbf16ps(0, 4, 5);
                if (tiles > 1) {
                    _tile_loadd(6, b + kbs * 512, 64);
                    _tile_dpbf16ps(1, 4, 6);
                }
                if (tiles > 2) {
                    _tile_loadd(5, b + 2 * kbs * 512, 64);
                    _tile_dpbf16ps(2, 4, 5);
                }
                if (tiles > 3) {
                    _tile_loadd(6, b + 3 * kbs * 512, 64);
                    _tile_dpbf16ps(3, 4, 6);
                }
            }
            _tile_stored(0, acc[0], 64);
            if (tiles > 1) _tile_stored(1, acc[1], 64);
            if (tiles > 2) _tile_stored(2, acc[2], 64);
            if (tiles > 3) _tile_stored(3, acc[3], 64);
            for (int t = 0; t < tiles; t++) {
                const int64_t n0 = (nb0 + t) * 16;
                const int cols = a->n - n0 < 16 ? (int)(a->n - n0) : 16;
                const __m512 s =
                    _mm512_maskz_loadu_ps((__mmask16)((1u << cols) - 1u), a->scales + n0);
                for (int i = 0; i < rows; i++)
                    _mm512_store_ps(acc[t] + i * 16, _mm512_mul_ps(_mm512_load_ps(acc[t] + i * 16), s));
                linear_store(a, acc[t], m0, rows, n0);
            }
        }
    }
    if (configured) _tile_release();
}

#endif
