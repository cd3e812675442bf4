/* What the elementwise kernels share (fused.c; their AVX-512 paths in fused_avx512.c;
 * docs/architecture.md §Kernels): each kernel's arguments and the vector paths' entries. On an
 * ISA without them, each entry is a no-op here that leaves every row or element to fused.c's
 * portable loops: the one dispatch point. Internal to the library. */
#ifndef KVTIER_FUSED_H
#define KVTIER_FUSED_H

#include "internal.h"

typedef struct {
    const void *x;
    /* row r at x + (r / inner) * outer_stride + (r % inner) * inner_stride */
    int64_t outer_stride, inner, inner_stride;
    void *residual;                            /* optional [rows, dim]: x is added to it first */
    const void *weight;
    void *out; /* [rows, dim] */
    int64_t dim;
    float eps;
    int gemma, dtype;
} NormArgs;

typedef struct {
    void *x;
    int64_t token_stride, heads, dim;
    const void *cos, *sin; /* [tokens, dim] */
    int dtype;
} RopeArgs;

typedef struct {
    const void *gate_up; /* [rows, 2 * inter]: gate, then up */
    void *out;           /* [rows, inter] */
    int64_t inter;
    int act, dtype; /* act: 0 silu, 1 gelu (tanh approximation), 2 gelu (erf) */
} ActArgs;

#define DIGITS 2048 /* radix of the top-k / top-p select's levels */
#define REACHES 6   /* the distances below the maximum counted in the first pass: 1, 2, 4 … 32 */

/* Scratch of one thread: the gathered candidates (key, index, weight) and the exponentials. */
typedef struct {
    uint32_t *key, *idx;
    float *w, *e;
    double (*hist4)[DIGITS];
} FilterScratch;

#if defined(KVTIER_AVX512BF16)
/* bfloat16 rows [begin, end) in one pass of 16-lane vectors; 1, or 0 where the path does not
 * take them (the portable loops do) */
int fused_norm_rows_bf16(const NormArgs *a, float *w, int64_t begin, int64_t end);
int fused_rope_rows_bf16(const RopeArgs *a, int64_t begin, int64_t end);
int fused_act_rows_bf16(const ActArgs *a, int64_t begin, int64_t end);
#else
static inline int fused_norm_rows_bf16(const NormArgs *a, float *w, int64_t begin, int64_t end) {
    (void)a, (void)w, (void)begin, (void)end;
    return 0;
}
static inline int fused_rope_rows_bf16(const RopeArgs *a, int64_t begin, int64_t end) {
    (void)a, (void)begin, (void)end;
    return 0;
}
static inline int fused_act_rows_bf16(const ActArgs *a, int64_t begin, int64_t end) {
    (void)a, (void)begin, (void)end;
    return 0;
}
#endif

/* Vector prefixes of a row: each takes the row's whole 16-element vectors and returns how many
 * elements it took (0 without AVX-512F); the portable loops run on from there. */
#if defined(KVTIER_AVX512)
/* the row's maximum *m and whether it holds a NaN *nan, so far */
int64_t fused_argmax_scan(const void *x, int64_t n, int dtype, float *m, int *nan);
/* the first NaN (nan) or element equal to m: its index in *at and -1, else the elements taken */
int64_t fused_argmax_find(const void *x, int64_t n, int dtype, float m, int nan, int64_t *at);
/* the tokens ≥ floor appended to s (*c of them so far), as fused.c's gather */
int64_t fused_gather(const float *x, const float *e, int64_t n, float floor, FilterScratch *s,
                     int64_t *c);
/* the first pass of the filter: count and mass within each reach, the exponentials into e (use_p)
 * and their sum *z */
int64_t fused_reaches(const float *x, int64_t n, float m, int use_p, const float *reach,
                      float *count, float *mass, float *e, float *z);
#else
static inline int64_t fused_argmax_scan(const void *x, int64_t n, int dtype, float *m, int *nan) {
    (void)x, (void)n, (void)dtype, (void)m, (void)nan;
    return 0;
}
static inline int64_t fused_argmax_find(const void *x, int64_t n, int dtype, float m, int nan,
                                        int64_t *at) {
    (void)x, (void)n, (void)dtype, (void)m, (void)nan, (void)at;
    return 0;
}
static inline int64_t fused_gather(const float *x, const float *e, int64_t n, float floor,
                                   FilterScratch *s, int64_t *c) {
    (void)x, (void)e, (void)n, (void)floor, (void)s, (void)c;
    return 0;
}
static inline int64_t fused_reaches(const float *x, int64_t n, float m, int use_p,
                                    const float *reach, float *count, float *mass, float *e,
                                    float *z) {
    (void)x, (void)n, (void)m, (void)use_p, (void)reach, (void)count, (void)mass, (void)e, (void)z;
    return 0;
}
#endif

#endif
