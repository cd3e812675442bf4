/* bfloat16 linear layers for few rows: out [M, N] = x [M, K] · W [N, K]ᵀ (+ bias), float32
 * accumulation over k in order, rounded to bfloat16 once (round to nearest even), as oneDNN's
 * bf16 matmul. oneDNN's call sets up a primitive before it multiplies anything, which at the
 * small models' shapes costs more than the product; these kernels set nothing up. At the end of
 * the file, the float32 linear's entries. The column groups run on one ISA path each, chosen
 * here (linear_amx.c, linear_avx512bf16.c, linear_f32_avx512.c).
 *
 * Weights are packed once into 16 × 32 tiles in the pair layout TDPBF16PS reads: tile (nb, kb) is
 * 16 rows of k pairs (2r, 2r + 1) by 16 output columns, [Nb][Kb][16][16][2], zero past N and K.
 * The same layout serves both instruction sets: on AMX a tile is one TDPBF16PS operand; with
 * AVX512-BF16 only (AMD Zen 4/5, Intel Cooper Lake) a tile row is one 512-bit VDPBF16PS operand
 * (16 columns' pair r), multiplied by a row's pair r broadcast. Either way each output sums its
 * k pairs in order into one float32 accumulator.
 * Output columns are split in groups of four tiles among the pool's threads (pool.c): each
 * element is computed by one thread in one order, so results do not depend on the thread count.
 * `kvtier_linear_available` returns 1 (AMX, granted by the OS), 2 (AVX512-BF16), 3 (AVX2 with
 * FMA, no AVX-512: the tiles widened to float32, linear_avx2.c), 4 (AVX-512 without its BF16:
 * the tiles widened to float32 on 512-bit registers, linear_wide_avx512.c) or 0 (none: the
 * caller uses oneDNN).
 */
#include <stdlib.h>

#include <stdatomic.h>

#include "linear.h"

/* the tile layout of either weight type: element (col, kk) of w [n, k] at packed[tile_at] */
#define PACK_TILES(w, n, k, packed)                                                           \
    do {                                                                                      \
        const int64_t nbs = ((n) + 15) / 16, kbs = ((k) + 31) / 32;                           \
        for (int64_t nb = 0; nb < nbs; nb++)                                                  \
            for (int64_t kb = 0; kb < kbs; kb++)                                              \
                for (int r = 0; r < 16; r++)                                                  \
                    for (int c = 0; c < 16; c++)                                              \
                        for (int e = 0; e < 2; e++) {                                         \
                            const int64_t col = nb * 16 + c, kk = kb * 32 + 2 * r + e;        \
                            (packed)[(nb * kbs + kb) * 512 + (r * 16 + c) * 2 + e] =          \
                                col < (n) && kk < (k) ? (w)[col * (k) + kk] : 0;              \
                        }                                                                     \
    } while (0)

void kvtier_linear_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed) {
    PACK_TILES(w, n, k, packed);
}

/* int8 weights in the same tiles, a byte an element (kvtier_linear_i8) */
void kvtier_linear_i8_pack(const int8_t *w, int64_t n, int64_t k, int8_t *packed) {
    PACK_TILES(w, n, k, packed);
}

/* The one dispatch of the bfloat16 linear: 1 AMX where built and granted by the OS (asked
 * once), else 2 AVX512-BF16 where built, else 3 AVX2 with FMA where no AVX-512 is, else 4
 * AVX-512 without BF16, else 0. The widened paths (3, 4) run where oneDNN has no bfloat16
 * instruction either and emulates it. */
static int tile_path(void) {
    static _Atomic int granted = -1;
    if (granted < 0) granted = linear_amx_granted();
    if (LINEAR_AMX && granted) return 1;
    return LINEAR_AVX512BF16 ? 2 : LINEAR_AVX2 ? 3 : LINEAR_AVX512_WIDE ? 4 : 0;
}

static ChunkFn groups_of(int path) {
    return path == 1   ? linear_amx_groups
           : path == 2 ? linear_avx512bf16_groups
           : path == 3 ? linear_avx2_groups
           : path == 4 ? linear_wide_avx512_groups
                       : NULL;
}

int kvtier_linear_available(void) { return tile_path(); }

#define CHUNK_X (256 << 10)    /* bytes of x in a row chunk, at most (kvtier_linear) */
#define CHUNK_WEIGHT (1 << 20) /* bytes of a weight whose rows are chunked, at most */

/* A tile linear's call, either weight type: `job` holds the operands, with `tiles` 16-column
 * tiles a column group and `rows` a register block (the AVX-512 paths), `elem` a weight's
 * bytes, `max_chunk` the most rows an item takes (0: any). Returns 0, or -1 when the scratch for
 * x's last partial k block could not be allocated. */
static int run_tiles(ChunkFn run, Job job, int tiles, int rows, int64_t elem, int64_t max_chunk,
                     int threads) {
    const int64_t m = job.m, n = job.n, k = job.k;
    uint16_t *tail = NULL;
    if (k % 32 && !job.xq && !job.xf) {
        tail = calloc((size_t)(m * 32), sizeof(uint16_t));
        if (!tail) return -1;
        for (int64_t r = 0; r < m; r++)
            memcpy(tail + r * 32, job.x + r * job.x_stride + (k / 32) * 32, (size_t)(k % 32) * 2);
    }
    /* an item: a column group by a chunk of rows. On a weight that stays in L2 (CHUNK_WEIGHT), a
     * chunk's x fits there with it (CHUNK_X), and the chunks run one after another, so each group
     * re-reads the chunk's x from L2 instead of streaming all of x again. A larger weight is read
     * once per chunk from memory, so it keeps all rows in one. */
    const int64_t groups = ((n + 15) / 16 + tiles - 1) / tiles;
    int64_t chunk_rows = m;
    if (n * k * elem <= CHUNK_WEIGHT && m * k * 2 > CHUNK_X) {
        chunk_rows = CHUNK_X / (k * 2) / 16 * 16;
        if (chunk_rows < 16) chunk_rows = 16;
    }
    if (max_chunk && chunk_rows > max_chunk) chunk_rows = max_chunk;
    const int64_t items = groups * ((m + chunk_rows - 1) / chunk_rows);
    job.tail = tail, job.tiles = tiles, job.rows = rows, job.groups = groups;
    job.chunk_rows = chunk_rows;
    /* multiply-adds: below 512K (a 1 MiB weight at one row) a helper saves less than it costs */
    const int64_t work = m * n * k;
    pool_run(run, &job, items, items / (4 * threads), work < (1 << 19) ? 1 : threads);
    free(tail);
    return job.status;
}

/* The AVX512-BF16 path's register block for m rows: `tiles` 16-column tiles by `rows` rows.
 * 6 rows by 4 tiles (24 accumulators), but 7-16 rows in one or two blocks of at most 8 by 3 tiles:
 * 16 rows as 8 + 8 read each weight twice, as 6 + 6 + 4 three times, the first pass from memory
 * and the others from L2 (at 4, 32 and 64 rows 4 tiles were as fast or faster). */
static void avx_block_shape(int64_t m, int *tiles, int *rows) {
    *tiles = 4, *rows = 6;
    if (m > 6 && m <= 16) {
        *tiles = 3;
        *rows = m > 8 ? (int)(m + 1) / 2 : (int)m;
    }
}

/* The AVX2 paths' column group: as many 16-column tiles as keep its weights (k rounded up to
 * a k block, `elem` bytes an element) within 256 KiB, in L2 while each row block reads them;
 * 1 to 4. */
static int l2_tiles(int64_t k, int64_t elem) {
    const int64_t fit = (256 << 10) / (16 * ((k + 31) / 32 * 32) * elem);
    return fit < 1 ? 1 : fit > 4 ? 4 : (int)fit;
}

/* The int16 blocks' shape for m rows (W8A16 and, without VNNI, W8A8): on AVX-512 (INT16_SHAPES,
 * linear_i8_avx512.c) 1-2 rows by 4 tiles or up to 4 by 2, the int32 sums and the accumulators
 * both in registers; on AVX2 blocks of 4 rows in column groups of l2_tiles (6-row blocks ran
 * slower) */
static void int16_shape(int64_t m, int64_t k, int *tiles, int *rows) {
    *tiles = LINEAR_I8_AVX512 ? (m <= 2 ? 4 : 2) : l2_tiles(k, 1);
    *rows = LINEAR_I8_AVX512 && m <= 2 ? (int)m : 4;
}

/* x's rows prepared (widened or quantized) by `fn` on the pool, one thread below 64K elements */
static void prepare_rows(ChunkFn fn, const Job *job, int threads) {
    pool_run(fn, job, job->m, job->m / (4 * threads), job->m * job->k < (1 << 16) ? 1 : threads);
}

/* rows [r0, r1) of a job's x widened into its xf (calloc'd: zero past k) */
static void widen_rows(const void *ctx, int64_t r0, int64_t r1) {
    const Job *a = ctx;
    const int64_t xs = (a->k + 31) / 32 * 32;
    float *xf = (float *)a->xf;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t i = 0; i < a->k; i++) xf[r * xs + i] = bf16_to_f32(a->x[r * a->x_stride + i]);
}

/* The widened paths' call (`run`: their column groups): x widened to float32 once, on the pool
 * (zero past k, so no partial k block remains), then column groups of `tiles` by row blocks of
 * `rows` (AVX2: blocks of 4 rows, groups of l2_tiles; AVX-512: the AVX512-BF16 path's shapes). */
static int wide_linear(ChunkFn run, Job job, int tiles, int rows, int threads) {
    const int64_t m = job.m, k = job.k, xs = (k + 31) / 32 * 32;
    float *xf = calloc((size_t)(m * xs), sizeof(float));
    if (!xf) return -1;
    job.xf = xf;
    prepare_rows(widen_rows, &job, threads);
    const int status = run_tiles(run, job, tiles, rows, 2, 0, threads);
    free(xf);
    return status;
}

/* x [m, k] bf16 rows `x_stride` apart; packed by kvtier_linear_pack; out [m, n] contiguous.
 * Returns 0, -1 when the scratch for x's last partial k block (or the widened x) could not be
 * allocated, or -2 where no tile path is built. */
int kvtier_linear(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                  int64_t n, int64_t k, const uint16_t *bias, uint16_t *out, int threads) {
    const int path = tile_path();
    const ChunkFn run = groups_of(path);
    if (!run) return -2;
    Job job = {.x = x, .packed = packed, .bias = bias, .out = out, .m = m, .n = n, .k = k,
               .x_stride = x_stride};
    if (path == 3) return wide_linear(run, job, l2_tiles(k, 2), 4, threads);
    /* AMX: 16 rows by 4 tiles */
    int tiles = 4, rows = 16;
    if (path != 1) avx_block_shape(m, &tiles, &rows);
    if (path == 4) return wide_linear(run, job, tiles, rows, threads);
    return run_tiles(run, job, tiles, rows, 2, 0, threads);
}

/* int8 weights (W8A16) wherever AVX512-VNNI is built with AVX512-BF16 (every CPU with the
 * latter has the former). Up to I8_FEW_ROWS rows, x in int16 blocks against the int8 weights
 * sign-extended (linear_i8_avx512.c): the bytes read bound the call. Above, the weights are
 * widened to bfloat16 (exact) and x is taken as it is: where the OS grants AMX, a column tile
 * widened once per k block serves up to 64 rows by TDPBF16PS (linear_i8_amx.c). Without AMX the
 * int16 blocks keep up to I8_WIDE_ROWS rows, and above that a column group widened once serves
 * every row block of the bfloat16 path (linear_i8_wide_groups): there the call is bound by its
 * multiply-adds, and the widening, one conversion a weight, costs less than the int16 blocks'
 * conversions and scaled adds per row block and k block; at 16 rows it cost more. The two sides
 * round x differently (int16 blocks, bfloat16), so a row's bits depend on which side of the
 * bound its batch is.
 * On AVX-512 without AVX512-BF16 (Skylake-SP, Cascade Lake, Ice Lake) there is no widened side:
 * the int16 blocks serve every row count, by VPDPWSSD or, without AVX512-VNNI (Skylake-SP),
 * VPMADDWD + VPADDD. With AVX2 and no AVX-512 (linear_i8_avx2.c: x86-64-v3) the int16 blocks
 * serve every row count, with the same bits, in the AVX2 paths' row blocks and column groups. */
#define I8_FEW_ROWS 4
#define I8_WIDE_ROWS 16
/* which int16 blocks are built: 1 the AVX-512 ones, 2 the AVX2 ones, 0 none */
int kvtier_linear_i8_available(void) { return LINEAR_I8_AVX512 ? 1 : LINEAR_I8_AVX2 ? 2 : 0; }

/* x as kvtier_linear's; packed by kvtier_linear_i8_pack; scales [n] float32: column j's weights
 * are packed[.., j] * scales[j]. Returns as kvtier_linear (-2: neither AVX512-VNNI nor AVX2). */
int kvtier_linear_i8(const uint16_t *x, int64_t x_stride, int64_t m, const int8_t *packed,
                     const float *scales, int64_t n, int64_t k, const uint16_t *bias,
                     uint16_t *out, int threads) {
    if (!LINEAR_I8) return -2;
    Job job = {.x = x, .packed8 = packed, .scales = scales, .bias = bias, .out = out, .m = m,
               .n = n, .k = k, .x_stride = x_stride};
    if (LINEAR_I8_AMX && m > I8_FEW_ROWS && tile_path() == 1)
        return run_tiles(linear_i8_amx_groups, job, 1, 16, 1, 64, threads);
    if (m > I8_WIDE_ROWS && tile_path() == 2) {
        int tiles, rows;
        avx_block_shape(m, &tiles, &rows);
        /* the rows are chunked as for a bfloat16 weight: the widened group is what stays in L2 */
        return run_tiles(linear_i8_wide_groups, job, tiles, rows, 2, 0, threads);
    }
    const int64_t kbs = (k + 31) / 32;
    const ChunkFn run = LINEAR_I8_AVX2 ? linear_i8_avx2_groups : linear_i8_avx512_groups;
    int tiles, rows;
    int16_shape(m, k, &tiles, &rows);
    int16_t *xq = malloc((size_t)(m * kbs * 32) * sizeof(int16_t));
    float *xs = malloc((size_t)(m * kbs) * sizeof(float));
    int status = -1;
    if (xq && xs) {
        linear_i8_quantize_x(&job, xq, xs);
        job.xq = xq, job.xs = xs;
        status = run_tiles(run, job, tiles, rows, 1, 0, threads);
    }
    free(xq);
    free(xs);
    return status;
}

/* W8A8 wherever AVX512-VNNI is built (linear_w8a8_avx512.c): int8 weights packed into the int8
 * tiles' places as 8 quads of k by 16 columns a tile, each byte w + 128 (VPDPBUSD's unsigned
 * operand), zero weights (128) past n and k; BF16 or not. With AVX2 and no AVX512-VNNI
 * (linear_w8a8_avx2.c, the same bits): the W8A16 int8 tiles (kvtier_linear_i8_pack), zero past
 * n and k. */
/* which W8A8 path is built: 1 VPDPBUSD, 2 the AVX2 int16 pairs, 3 the AVX-512 int16 blocks
 * (AVX-512 without VNNI: x quantized as on AVX2, the W8A16 path's 512-bit blocks), 0 none */
int kvtier_linear_w8a8_available(void) {
    return LINEAR_W8A8 ? 1 : LINEAR_W8A8_I16 ? 3 : LINEAR_W8A8_AVX2 ? 2 : 0;
}

void kvtier_linear_w8a8_pack(const int8_t *w, int64_t n, int64_t k, uint8_t *packed) {
    if (LINEAR_W8A8_AVX2) {
        kvtier_linear_i8_pack(w, n, k, (int8_t *)packed);
        return;
    }
    const int64_t nbs = (n + 15) / 16, kbs = (k + 31) / 32;
    for (int64_t nb = 0; nb < nbs; nb++)
        for (int64_t kb = 0; kb < kbs; kb++)
            for (int r = 0; r < 8; r++)
                for (int c = 0; c < 16; c++)
                    for (int e = 0; e < 4; e++) {
                        const int64_t col = nb * 16 + c, kk = kb * 32 + 4 * r + e;
                        const int v = col < n && kk < k ? w[col * k + kk] : 0;
                        packed[(nb * kbs + kb) * 512 + (r * 16 + c) * 4 + e] = (uint8_t)(v + 128);
                    }
}

/* The call without VNNI: x's rows quantized into int16 on the pool, then the int16 blocks
 * (int16_shape): on AVX2 linear_w8a8_avx2.c's, on AVX-512 the W8A16 path's 512-bit ones */
static int w8a8_int16(Job job, int threads) {
    const int64_t m = job.m, kpad = (job.k + 31) / 32 * 32;
    int16_t *xq = malloc((size_t)(m * kpad) * sizeof(int16_t));
    float *xs = malloc((size_t)m * sizeof(float));
    int status = -1;
    if (xq && xs) {
        job.xq = xq, job.xs = xs;
        prepare_rows(linear_w8a8_avx2_quantize_rows, &job, threads);
        int tiles, rows;
        int16_shape(m, job.k, &tiles, &rows);
        status = run_tiles(LINEAR_W8A8_I16 ? linear_w8a8_i16_groups : linear_w8a8_avx2_groups, job,
                           tiles, rows, 1, 0, threads);
    }
    free(xq);
    free(xs);
    return status;
}

/* x as kvtier_linear's; packed by kvtier_linear_w8a8_pack; scales [n] float32 (column j's
 * weights are its int8 values × scales[j]). Each row of x is quantized to int8 with its own
 * scale first. k < 65536 (the int32 sums stay exact). Returns as kvtier_linear (-2: neither
 * AVX512-VNNI nor AVX2 built, -3: k too large). */
int kvtier_linear_w8a8(const uint16_t *x, int64_t x_stride, int64_t m, const uint8_t *packed,
                       const float *scales, int64_t n, int64_t k, const uint16_t *bias,
                       uint16_t *out, int threads) {
    if (!LINEAR_W8A8 && !LINEAR_W8A8_AVX2) return -2;
    if (k >= 65536) return -3;
    Job job = {.x = x, .packed8 = (const int8_t *)packed, .scales = scales, .bias = bias,
               .out = out, .m = m, .n = n, .k = k, .x_stride = x_stride};
    if (LINEAR_W8A8_AVX2) return w8a8_int16(job, threads);
    const int64_t kpad = (k + 31) / 32 * 32;
    int8_t *xq = aligned_alloc(64, (size_t)((m * kpad + 63) / 64 * 64));
    float *xs = malloc((size_t)m * sizeof(float));
    int32_t *xsum = malloc((size_t)m * sizeof(int32_t));
    int status = -1;
    if (xq && xs && xsum) {
        job.xq8 = xq, job.xs = xs, job.xsum = xsum;
        prepare_rows(linear_w8a8_quantize_rows, &job, threads);
        int tiles, rows;
        avx_block_shape(m, &tiles, &rows);
        status = run_tiles(linear_w8a8_groups, job, tiles, rows, 1, 0, threads);
    }
    free(xq);
    free(xs);
    free(xsum);
    return status;
}

/* float32 linears at any row count where AVX-512F or AVX2 is built (linear_f32_avx512.c says
 * why; linear_f32_avx2.c has its bits): the weight packed once as [Nb][K][16] (16 output
 * columns a vector, zero past N). */
int kvtier_linear_f32_available(void) { return LINEAR_F32; }


void kvtier_linear_f32_pack(const float *w, int64_t n, int64_t k, float *packed) {
    const int64_t nbs = (n + 15) / 16;
    for (int64_t nb = 0; nb < nbs; nb++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int c = 0; c < 16; c++) {
                const int64_t col = nb * 16 + c;
                packed[(nb * k + kk) * 16 + c] = col < n ? w[col * k + kk] : 0.0f;
            }
}

/* x [m, k] float32 rows `x_stride` apart; packed by kvtier_linear_f32_pack; out [m, n].
 * Returns 0, or -2 where the kernel is not built (neither AVX-512F nor AVX2). */
int kvtier_linear_f32(const float *x, int64_t x_stride, int64_t m, const float *packed, int64_t n,
                      int64_t k, const float *bias, float *out, int threads) {
    if (!LINEAR_F32) return -2;
    const JobF32 job = {x, packed, bias, out, m, n, k, x_stride};
    const int64_t groups = ((n + 15) / 16 + 3) / 4;
    const int64_t work = m * n * k;
    pool_run(linear_f32_groups, &job, groups, groups / (4 * threads),
             work < (1 << 20) ? 1 : threads);
    return 0;
}
