/* What the bfloat16 linear's paths share (linear.c dispatches; linear_amx.c, linear_avx512bf16.c
 * and linear_avx2.c run the column groups, the AVX-512 ones over linear_blocks.h; the int8
 * weights' paths are linear_i8_*.c, with int8 activations linear_w8a8_*.c;
 * docs/architecture.md §Kernels): a call's job and its items, and the float32 linear's job
 * (linear_f32_avx512.c, linear_f32_avx2.c). Internal to the library. */
#ifndef KVTIER_LINEAR_H
#define KVTIER_LINEAR_H

#include "internal.h"

typedef struct {
    const uint16_t *x, *packed, *bias, *tail; /* tail: x's last k block, zero padded [m][32] */
    const int8_t *packed8; /* int8 tiles (W8A16) instead of `packed`, with their column scales */
    const float *scales;
    const int16_t *xq; /* W8A16: x in int16 [m][k blocks][32] and each block's scale; W8A8 on
                        * AVX2: x's int8 rows in int16, [m][k blocks × 32], and a row's scale */
    const float *xs;
    const float *xf; /* the widened paths: x as float32, [m][k blocks × 32], zero past k */
    const int8_t *xq8; /* W8A8: x's rows in int8 [m][k blocks × 32], zero past k; xs: a scale
                        * a row; xsum: each row's sum of its int8 values */
    const int32_t *xsum;
    uint16_t *out;
    int64_t m, n, k, x_stride;
    int tiles, rows; /* 16-column tiles per column group, rows per block (avx_groups) */
    int64_t groups, chunk_rows; /* column groups; rows per row chunk (an item: see kvtier_linear) */
    int status; /* -1 where a thread's scratch could not be allocated (linear_i8_wide_groups) */
} Job;

/* item `item` of a call (kvtier_linear): column group *g of the rows [*r0, *r1) */
static inline void item_span(const Job *a, int64_t item, int64_t *g, int64_t *r0, int64_t *r1) {
    *g = item % a->groups;
    *r0 = item / a->groups * a->chunk_rows;
    *r1 = *r0 + a->chunk_rows < a->m ? *r0 + a->chunk_rows : a->m;
}

/* Items [i0, i1) of a call whose register blocks are a few rows by a group's tiles (the AVX2
 * paths): an item is a column group of a->tiles tiles (fewer at the end), its rows in blocks of
 * a->rows, each block given to `rows_fn` (m0, rows, first tile, tiles); the group's weights stay
 * in L2 while every row block of the item reads them */
static inline void item_row_blocks(const Job *a, int64_t i0, int64_t i1,
                                   void (*rows_fn)(const Job *, int64_t, int, int64_t, int)) {
    const int64_t nbs = (a->n + 15) / 16;
    for (int64_t item = i0; item < i1; item++) {
        int64_t g, r0, r1;
        item_span(a, item, &g, &r0, &r1);
        const int64_t nb0 = g * a->tiles;
        const int tiles = nbs - nb0 < a->tiles ? (int)(nbs - nb0) : a->tiles;
        for (int64_t m0 = r0; m0 < r1; m0 += a->rows)
            rows_fn(a, m0, r1 - m0 < a->rows ? (int)(r1 - m0) : a->rows, nb0, tiles);
    }
}

/* Rows [m0, m0 + R) of float32 sums [R][16] (+ bias) rounded into out's columns n0.. (the AVX2
 * paths; the AVX-512 ones have linear_store) */
static inline void linear_store_rows(const Job *a, const float *acc, int64_t m0, int R, int64_t n0) {
    const int cols = a->n - n0 < 16 ? (int)(a->n - n0) : 16;
    for (int r = 0; r < R; r++) {
        uint16_t *o = a->out + (m0 + r) * a->n + n0;
        for (int c = 0; c < cols; c++)
            o[c] = f32_to_bf16(acc[r * 16 + c] + (a->bias ? bf16_to_f32(a->bias[n0 + c]) : 0.0f));
    }
}

/* k block kb of x's row `row`: its 32 bf16, from x or the zero-padded tail */
static inline const uint16_t *x_block(const Job *a, int64_t row, int64_t kb, int64_t full) {
    return kb < full ? a->x + row * a->x_stride + kb * 32 : a->tail + row * 32;
}

/* the bytes from one row of x_block's rows to the next (an AMX tile load's stride) */
static inline int64_t x_block_stride(const Job *a, int64_t kb, int64_t full) {
    return kb < full ? a->x_stride * 2 : 64;
}

/* Rows of float32 accumulators [rows][16] (+ bias) rounded into out's columns n0.. (the two
 * bfloat16 paths) */
void linear_store(const Job *a, const float *acc, int64_t m0, int rows, int64_t n0);

typedef struct {
    const float *x, *packed, *bias;
    float *out;
    int64_t m, n, k, x_stride;
} JobF32;

/* a path's column-group entry where the path is not built (the dispatch never reaches it) */
#define NO_GROUPS(fn)                                                \
    static inline void fn(const void *job, int64_t i0, int64_t i1) { \
        (void)job, (void)i0, (void)i1;                               \
    }

/* ---- the ISA paths: which are built is said here once (LINEAR_AMX, LINEAR_AVX512BF16,
 * LINEAR_F32); where one is not, its entries are stubs the dispatch never reaches (linear.c
 * has no #if). Each runs a job's items [i0, i1): output column groups. */

#if defined(KVTIER_AMX)
#define LINEAR_AMX 1
int linear_amx_granted(void); /* asks Linux for the tile state (once a process) */
void linear_amx_groups(const void *job, int64_t i0, int64_t i1);
#else
#define LINEAR_AMX 0
static inline int linear_amx_granted(void) { return 0; }
NO_GROUPS(linear_amx_groups)
#endif

#if defined(KVTIER_AVX512BF16)
#define LINEAR_AVX512BF16 1
void linear_avx512bf16_groups(const void *job, int64_t i0, int64_t i1);
#else
#define LINEAR_AVX512BF16 0
NO_GROUPS(linear_avx512bf16_groups)
#endif

#if defined(KVTIER_AVX2)
#define LINEAR_AVX2 1
void linear_avx2_groups(const void *job, int64_t i0, int64_t i1);
#else
#define LINEAR_AVX2 0
NO_GROUPS(linear_avx2_groups)
#endif

#if defined(KVTIER_AVX512_WIDE)
#define LINEAR_AVX512_WIDE 1
void linear_wide_avx512_groups(const void *job, int64_t i0, int64_t i1);
#else
#define LINEAR_AVX512_WIDE 0
NO_GROUPS(linear_wide_avx512_groups)
#endif

#if defined(KVTIER_AVX512_INT8) || defined(KVTIER_INT8_AVX2)
#define LINEAR_I8 1
/* x's rows as int16 blocks (Job.xq: m × k blocks × 32, Job.xs: m × k blocks), the same bits on
 * either ISA (linear_i8_avx512.c, linear_i8_avx2.c) */
void linear_i8_quantize_x(const Job *a, int16_t *xq, float *xs);
#else
#define LINEAR_I8 0
static inline void linear_i8_quantize_x(const Job *a, int16_t *xq, float *xs) {
    (void)a, (void)xq, (void)xs;
}
#endif

#if defined(KVTIER_AVX512_INT8)
#define LINEAR_I8_AVX512 1
void linear_i8_avx512_groups(const void *job, int64_t i0, int64_t i1);
#else
#define LINEAR_I8_AVX512 0
NO_GROUPS(linear_i8_avx512_groups)
#endif

#if defined(KVTIER_AVX512VNNI) /* the widened weights run the bfloat16 blocks */
void linear_i8_wide_groups(const void *job, int64_t i0, int64_t i1);
#else
NO_GROUPS(linear_i8_wide_groups)
#endif

#if defined(KVTIER_INT8_AVX2)
#define LINEAR_I8_AVX2 1
void linear_i8_avx2_groups(const void *job, int64_t i0, int64_t i1);
#else
#define LINEAR_I8_AVX2 0
NO_GROUPS(linear_i8_avx2_groups)
#endif

#if defined(KVTIER_AVX512_W8A8)
#define LINEAR_W8A8 1 /* linear_w8a8_avx512.c */
/* rows [r0, r1) of a job's x quantized into its xq8, xs, xsum (a pool's chunk function) */
void linear_w8a8_quantize_rows(const void *job, int64_t r0, int64_t r1);
void linear_w8a8_groups(const void *job, int64_t i0, int64_t i1);
#else
#define LINEAR_W8A8 0
NO_GROUPS(linear_w8a8_quantize_rows)
NO_GROUPS(linear_w8a8_groups)
#endif

#if defined(KVTIER_W8A8_AVX2)
#define LINEAR_W8A8_AVX2 1 /* linear_w8a8_avx2.c */
/* rows [r0, r1) of a job's x quantized into its xq (int16 [m][k blocks × 32]) and xs */
void linear_w8a8_avx2_quantize_rows(const void *job, int64_t r0, int64_t r1);
void linear_w8a8_avx2_groups(const void *job, int64_t i0, int64_t i1);
#else
#define LINEAR_W8A8_AVX2 0
NO_GROUPS(linear_w8a8_avx2_quantize_rows)
NO_GROUPS(linear_w8a8_avx2_groups)
#endif

#if defined(KVTIER_AVX512_INT8) && defined(KVTIER_W8A8_AVX2)
#define LINEAR_W8A8_I16 1 /* AVX-512 without VNNI: W8A8 on W8A16's 512-bit int16 blocks */
void linear_w8a8_i16_groups(const void *job, int64_t i0, int64_t i1);
#else
#define LINEAR_W8A8_I16 0
NO_GROUPS(linear_w8a8_i16_groups)
#endif

#if defined(KVTIER_AMX) && defined(KVTIER_AVX512VNNI)
#define LINEAR_I8_AMX 1
void linear_i8_amx_groups(const void *job, int64_t i0, int64_t i1);
#else
#define LINEAR_I8_AMX 0
NO_GROUPS(linear_i8_amx_groups)
#endif

#if defined(KVTIER_AVX512) || defined(KVTIER_AVX2) /* linear_f32_avx512.c, linear_f32_avx2.c */
#define LINEAR_F32 1
void linear_f32_groups(const void *job, int64_t g0, int64_t g1);
#else
#define LINEAR_F32 0
NO_GROUPS(linear_f32_groups)
#endif

#endif
