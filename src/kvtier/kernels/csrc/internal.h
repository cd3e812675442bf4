/* What the library's files share and do not export (docs/architecture.md §Kernels): the thread
 * pool's entry (pool.c), the one bfloat16 rounding rule, and the ISA each path is compiled for.
 * Every symbol declared here is hidden (the build's -fvisibility=hidden); only kvtier.h's
 * KVTIER_API functions leave the library. */
#ifndef KVTIER_INTERNAL_H
#define KVTIER_INTERNAL_H

#include <math.h>
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
#define KVTIER_AVX512VNNI 1 /* and VNNI (every such CPU): W8A16's widened and AMX paths */
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define KVTIER_AVX2 1 /* x86-64-v3 without AVX-512: the bfloat16 linear widened to float32 FMAs */
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
/* AVX-512 with BW, VNNI or not (Skylake-SP has none; Cascade Lake and Ice Lake have it without
 * BF16): W8A16's int16 blocks (linear_i8_avx512.c), by VPDPWSSD or by VPMADDWD + VPADDD */
#define KVTIER_AVX512_INT8 1
#endif
#if defined(KVTIER_AVX512_INT8) && !defined(KVTIER_AVX512BF16)
/* AVX-512 without BF16 (Skylake-SP, Cascade Lake, Ice Lake): the bfloat16 linear widened to
 * float32 FMAs on 512-bit registers (linear_wide_avx512.c) */
#define KVTIER_AVX512_WIDE 1
#endif
#if defined(KVTIER_AVX512_INT8) && defined(__AVX512VNNI__)
#define KVTIER_AVX512_W8A8 1 /* and VNNI, BF16 or not: W8A8 by VPDPBUSD (linear_w8a8_avx512.c) */
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(KVTIER_AVX512_INT8)
/* AVX2 without AVX-512 (x86-64-v3): W8A16 in int16 pair products on 256-bit registers
 * (linear_i8_avx2.c) */
#define KVTIER_INT8_AVX2 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(KVTIER_AVX512_W8A8)
/* AVX2 without AVX512-VNNI (x86-64-v3, and Skylake-SP): W8A8 in int16 pair products
 * (linear_w8a8_avx2.c; VPMADDUBSW, the only byte product without VNNI, saturates) */
#define KVTIER_W8A8_AVX2 1
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

/* ---- 8-bit KV: fp8 codes (docs/kernels.md, "8-bit KV") -------------------------------------- */

enum { KV_F32 = 0, KV_BF16 = 1, KV_E4M3 = 2, KV_E5M2 = 3 }; /* a cache's element types */

static inline int64_t kv_bytes(int kv_dtype) { return kv_dtype == KV_F32 ? 4 : kv_dtype == KV_BF16 ? 2 : 1; }

/* An fp8 code's value (exact in float32 and in bfloat16); the NaN codes (e4m3: 0x7f, 0xff;
 * e5m2: exponent all ones with a mantissa) stay NaN, so NaN poison reaches the checks. */
static inline float fp8_to_f32(uint8_t c, int kv_dtype) {
    const int mbits = kv_dtype == KV_E4M3 ? 3 : 2, bias = kv_dtype == KV_E4M3 ? 7 : 15;
    const int e = (c & 0x7f) >> mbits, m = c & ((1 << mbits) - 1);
    float mag;
    if (kv_dtype == KV_E4M3 && (c & 0x7f) == 0x7f) mag = NAN;
    else if (kv_dtype == KV_E5M2 && e == 31) mag = m ? NAN : INFINITY;
    else if (e == 0) mag = ldexpf((float)m, 1 - bias - mbits); /* subnormal */
    else mag = ldexpf((float)((1 << mbits) + m), e - bias - mbits);
    return c & 0x80 ? -mag : mag;
}

/* f (already divided by its scale) as an fp8 code: saturated to the largest finite value and
 * rounded to nearest even, the bits of torch's float32 → float8 cast of the clamped value
 * (model/paged.py `stored`; tests/model/test_kv_fp8.py compares the stored bytes). */
static inline uint8_t f32_to_fp8(float f, int kv_dtype) {
    const int mbits = kv_dtype == KV_E4M3 ? 3 : 2, bias = kv_dtype == KV_E4M3 ? 7 : 15;
    const float top = kv_dtype == KV_E4M3 ? 448.0f : 57344.0f;
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    if ((u & 0x7fffffffu) > 0x7f800000u) return sign | 0x7f;
    float a = fabsf(f);
    if (a > top) a = top;
    if (a < ldexpf(1.0f, 1 - bias)) /* subnormal: multiples of 2^(1 - bias - mbits) */
        return sign | (uint8_t)nearbyintf(ldexpf(a, bias - 1 + mbits));
    memcpy(&u, &a, 4);
    const int keep = 23 - mbits;
    u += (1u << (keep - 1)) - 1u + ((u >> keep) & 1u);
    return sign | (uint8_t)((u >> keep) - ((uint32_t)(127 - bias) << mbits));
}

#endif
