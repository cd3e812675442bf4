/* The int8-weight linear's column tiles on AMX (W8A16, linear.c dispatches above a few rows):
 * per k block, one 16-column tile of int8 weights is widened to bfloat16 (exact) into a buffer
 * on the stack and multiplied by TDPBF16PS into the accumulators of up to four row blocks of 16
 * (an item's rows), so the widening is shared by up to 64 rows; each column's float32 sum is
 * scaled once, before the bias and the one rounding. AMX-INT8 would need int8 activations
 * (W8A8), which changes the model's numbers (docs/kernels.md). */
#include "linear.h"

#if defined(KVTIER_AMX) && defined(KVTIER_AVX512VNNI)
#include "amx.h"

/* tiles 0–3: the row blocks' accumulators (16 rows × 16 float32, the last block's `last`
 * rows); 4: 16 rows of x; 5: the weights; 6: the last block's rows of x */
static void configure(int blocks, int last) {
    uint8_t tiles[8] = {16, 16, 16, 16, 16, 16, (uint8_t)last, 0};
    tiles[blocks - 1] = (uint8_t)last;
    amx_configure(tiles);
}

/* items [i0, i1): a column tile by a chunk of at most 64 rows (Job.chunk_rows) */
void linear_i8_amx_groups(const void *ctx, int64_t i0, int64_t i1) {
    const Job *a = (const Job *)ctx;
    const int64_t kbs = (a->k + 31) / 32, full = a->k / 32;
    uint16_t wide[512] __attribute__((aligned(64)));
    float acc[256] __attribute__((aligned(64)));
    int configured = 0;
    for (int64_t item = i0; item < i1; item++) {
        int64_t nb, r0, r1;
        item_span(a, item, &nb, &r0, &r1);
        const int blocks = (int)((r1 - r0 + 15) / 16), last = (int)(r1 - r0 - (blocks - 1) * 16);
        if (blocks * 32 + last != configured) { /* the items of a call share one shape but
                                                      * the last chunk's */
            configure(blocks, last);
            configured = blocks * 32 + last;
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const int8_t *w = a->packed8 + nb * kbs * 512;
        for (int64_t kb = 0; kb < kbs; kb++) {
            for (int i = 0; i < 512; i += 32) {
                const __m512 lo = _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + kb * 512 + i))));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)(w + kb * 512 + i + 16))));
                _mm512_store_si512(wide + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            }
            _tile_loadd(5, wide, 64);
            const int64_t stride = x_block_stride(a, kb, full);
            /* tile numbers are immediates: a block apiece; the last block's x goes to tile 6,
             * configured for its rows */
#define I8_AMX_BLOCK(B)                                                                       \
    if (blocks == (B) + 1) {                                                                  \
        _tile_loadd(6, x_block(a, r0 + (B) * 16, kb, full), stride);                          \
        _tile_dpbf16ps(B, 6, 5);                                                              \
    } else if (blocks > (B) + 1) {                                                            \
        _tile_loadd(4, x_block(a, r0 + (B) * 16, kb, full), stride);                          \
        _tile_dpbf16ps(B, 4, 5);                                                              \
    }
            I8_AMX_BLOCK(0)
            I8_AMX_BLOCK(1)
            I8_AMX_BLOCK(2)
            I8_AMX_BLOCK(3)
#undef I8_AMX_BLOCK
        }
        const int64_t n0 = nb * 16;
        const int cols = a->n - n0 < 16 ? (int)(a->n - n0) : 16;
        const __m512 s = _mm512_maskz_loadu_ps((__mmask16)((1u << cols) - 1u), a->scales + n0);
        for (int b = 0; b < blocks; b++) {
            const int rows = b == blocks - 1 ? last : 16;
            switch (b) {
            case 0: _tile_stored(0, acc, 64); break;
            case 1: _tile_stored(1, acc, 64); break;
            case 2: _tile_stored(2, acc, 64); break;
            default: _tile_stored(3, acc, 64); break;
            }
            for (int i = 0; i < rows; i++)
                _mm512_store_ps(acc + i * 16, _mm512_mul_ps(_mm512_load_ps(acc + i * 16), s));
            linear_store(a, acc, r0 + b * 16, rows, n0);
        }
    }
    if (configured) _tile_release();
}

#endif
