/* What the library's files share and do not export (docs/architecture.md §Kernels): the thread
 * pool's entry (pool.c), the one bfloat16 rounding rule, and the ISA each path is compiled for.
 * Every symbol declared here is hidden (the build's -fvisibility=hidden); only kvtier.h's
 * KVTIER_API functions leave the library. */
#ifndef KVTIER_INTERNAL_H
#define KVTIER_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "kvtier.h"

/* ---- the ISA paths: one decision, read by each path's file and by the dispatch beside it --- */

#if defined(__AVX512F__)
#define KVTIER_AVX512 1 /* AVX-512F: the float32 vector paths */
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define KVTIER_AVX512BF16 1 /* and its BF16 dot products and conversions: the bfloat16 paths */
#endif
#if defined(KVTIER_AVX512BF16) && defined(__AVX512VNNI__)
#define KVTIER_AVX512VNNI 1 /* and int16 dot products: the int8-weight linear (every such CPU) */
#endif
#if defined(KVTIER_AVX512BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__linux__)
#define KVTIER_AMX 1 /* AMX tiles (granted per process by Linux): the tile paths */
#endif

/* ---- the thread pool (pool.c) ------------------------------------------------------------- */

/* A call's items [begin, end); an item's result must not depend on the thread computing it. */
typedef void (*ChunkFn)(const void *ctx, int64_t begin, int64_t end);

/* Items [0, items) in chunks of `chunk`, on the caller and up to `threads - 1` helpers. */
void pool_run(ChunkFn fn, const void *ctx, int64_t items, int64_t chunk, int threads);

/* ---- bfloat16 ----------------------------------------------------------------------------- */

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* f rounded to bfloat16, round to nearest even; a NaN stays a (quiet) NaN. The one scalar form
 * of the rule: vec512.h's bf16_round_16 is its 16-lane twin (same bits, denormals included,
 * which the hardware's VCVTNEPS2BF16 flushes). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u; /* no branch: loops vectorize */
    u = nan ? (u | 0x400000u) : u + 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* f rounded to bfloat16 and widened back */
static inline float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#endif
