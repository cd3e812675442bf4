/* The bfloat16 linear's column groups on AMX: a packed tile is one TDPBF16PS operand (linear.c
 * dispatches where the OS grants the tiles; docs/architecture.md §Kernels). */
#include "linear.h"

#if defined(KVTIER_AMX)
#include "amx.h"

/* tiles 0–3: accumulators (rows × 16 float32); 4: x rows × 32 bf16; 5, 6: weight tiles */
static void configure(int rows) {
    const uint8_t r = (uint8_t)rows, tiles[8] = {r, r, r, r, r, 16, 16, 0};
    amx_configure(tiles);
}

#define AMX_AHEAD 8 /* k blocks ahead the first row block prefetches its weight tiles into L1 */

/* items [i0, i1) (kvtier_linear): a column group of four 16-column tiles by a chunk of rows, every
 * row block of 16. The first row block streams the group's weights from memory and prefetches
 * each tile AMX_AHEAD k blocks ahead (more misses in flight than the hardware prefetcher keeps);
 * the other row blocks find the tiles in L2, where prefetching them again only cost time. */
int linear_amx_granted(void) { return amx_granted(); }

void linear_amx_groups(const void *ctx, int64_t i0, int64_t i1) {
    const Job *a = (const Job *)ctx;
    const int64_t nbs = (a->n + 15) / 16, kbs = (a->k + 31) / 32, full = a->k / 32;
    float acc[4][256] __attribute__((aligned(64)));
    int configured = 0;
    for (int64_t item = i0; item < i1; item++) {
        int64_t g, r0, r1;
        item_span(a, item, &g, &r0, &r1);
        const int64_t nb0 = g * 4;
        const int tiles = nbs - nb0 < 4 ? (int)(nbs - nb0) : 4;
        const uint16_t *w = a->packed + nb0 * kbs * 512;
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
                _tile_loadd(4, x_block(a, m0, kb, full), x_block_stride(a, kb, full));
                const uint16_t *b = w + kb * 512;
                if (m0 == 0 && kb + AMX_AHEAD < kbs)
                    for (int t = 0; t < tiles; t++)
                        for (int line = 0; line < 16; line++)
                            _mm_prefetch((const char *)(b + (t * kbs + AMX_AHEAD) * 512) + line * 64,
                                         _MM_HINT_T0);
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
            for (int t = 0; t < tiles; t++) linear_store(a, acc[t], m0, rows, (nb0 + t) * 16);
        }
    }
    if (configured) _tile_release();
}

#endif
