/* The structured outputs' token mask (model/grammar.py apply_mask): llguidance's bitmask, bit j
 * of word w allowing token 32 w + j, applied to logits in place (docs/kernels.md). Unpacking the
 * bits with torch ops built a [rows, words, 32] tensor and cost a large share of a decode step
 * at a real vocabulary; here each word is read once, a word of all ones (everything allowed) is
 * skipped and every other one is a 32-lane blend the compiler vectorizes. */

#include "internal.h"

#define BF16_NEG_INF 0xff80u

typedef struct {
    void *logits;
    int64_t stride, vocab; /* elements between rows, elements a row */
    const int32_t *mask;
    int64_t words;       /* mask words a row; its row r masks logits row r */
    const int64_t *rows; /* the rows to mask */
    int dtype;
} MaskArgs;

static void mask_f32(float *x, const uint32_t *m, int64_t words, int64_t vocab) {
    const int64_t full = (words * 32 < vocab ? words * 32 : vocab) / 32;
    for (int64_t w = 0; w < full; w++) {
        const uint32_t bits = m[w];
        if (bits == 0xffffffffu) continue;
        float *y = x + w * 32;
        for (int j = 0; j < 32; j++) y[j] = (bits >> j) & 1u ? y[j] : -INFINITY;
    }
    for (int64_t i = full * 32; i < vocab; i++) /* a last partial word; past the mask: refused */
        if (i >= words * 32 || !((m[i / 32] >> (i % 32)) & 1u)) x[i] = -INFINITY;
}

static void mask_bf16(uint16_t *x, const uint32_t *m, int64_t words, int64_t vocab) {
    const int64_t full = (words * 32 < vocab ? words * 32 : vocab) / 32;
    for (int64_t w = 0; w < full; w++) {
        const uint32_t bits = m[w];
        if (bits == 0xffffffffu) continue;
        uint16_t *y = x + w * 32;
        for (int j = 0; j < 32; j++) y[j] = (bits >> j) & 1u ? y[j] : (uint16_t)BF16_NEG_INF;
    }
    for (int64_t i = full * 32; i < vocab; i++)
        if (i >= words * 32 || !((m[i / 32] >> (i % 32)) & 1u)) x[i] = (uint16_t)BF16_NEG_INF;
}

static void mask_rows(const void *p, int64_t begin, int64_t end) {
    const MaskArgs *a = (const MaskArgs *)p;
    const int64_t size = a->dtype == 1 ? 2 : 4;
    for (int64_t i = begin; i < end; i++) {
        const int64_t r = a->rows[i];
        void *x = (char *)a->logits + r * a->stride * size;
        const uint32_t *m = (const uint32_t *)(a->mask + r * a->words);
        if (a->dtype == 1)
            mask_bf16((uint16_t *)x, m, a->words, a->vocab);
        else
            mask_f32((float *)x, m, a->words, a->vocab);
    }
}

void kvtier_apply_bitmask(void *logits, int64_t stride, int64_t vocab, const int32_t *mask,
                          int64_t words, const int64_t *rows, int64_t num_rows, int dtype,
                          int threads) {
    MaskArgs a = {logits, stride, vocab, mask, words, rows, dtype};
    /* a row is a few microseconds at a large vocabulary: helpers only for many of them */
    if (num_rows * vocab < (1 << 20)) threads = 1;
    const int t = threads > 0 ? threads : 1;
    pool_run(mask_rows, &a, num_rows, num_rows / (4 * t), threads);
}
