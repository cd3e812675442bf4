/* What the paged attention's paths share (docs/architecture.md §Kernels): a call's arguments,
 * its work items, the key addressing of the paged cache, and each path's entry. attention.c
 * chooses a path per work item; the paths live one ISA a file: the float path's two inner steps
 * (attention_avx512.c, attention_avx2.c or attention_portable.c), the bfloat16 pairs path (attention_avx512bf16.c)
 * and the AMX tiles (attention_amx.c). Internal to the library. */
#ifndef KVTIER_ATTENTION_H
#define KVTIER_ATTENTION_H

#include <stddef.h>

#include "internal.h"

typedef struct {
    const void *q;
    int64_t q_stride;
    const void *cache;
    void *out;
    const int64_t *tables; /* [num_seqs, table_stride] block ids */
    int64_t table_stride;
    const int64_t *seq_token; /* [num_seqs] batch index of each sequence's first query */
    const int64_t *seq_qlen;  /* [num_seqs] queries of each sequence */
    const int64_t *seq_row;   /* [num_seqs] index of its first query in lo / hi */
    const int64_t *lo, *hi;   /* [rows] key range of each query */
    int64_t num_heads, kv_heads, head_dim, block_size;
    float scale, softcap; /* scale: k's scale folded in */
    float v_scale;        /* the output's factor: v's scale (1 for a float cache) */
    int dtype;            /* q and out: 0 float32, 1 bfloat16 */
    int kv_dtype;         /* the cache: KV_F32, KV_BF16 or fp8 codes (internal.h) */
    int amx; /* items of ≤ 16 query rows on AMX tiles (attention_amx.c) */
} Args;

/* Queries of one sequence and KV head attended together (one work item): decodes and drafts are
 * one block; a prompt's chunk is split so both threads share it and a block reads only the keys
 * up to its own last query. */
#define QBLOCK 32

typedef struct { /* one work item, resolved (attention.c) */
    int64_t h;          /* its KV head */
    int64_t nq, G;      /* its queries; query heads a KV head: rows = nq × G, ordered (query, g) */
    int64_t tok0, row0; /* its first query's token (q, out) and row (lo, hi) */
    int64_t kmin, kmax; /* the keys any of its queries reads */
    const int64_t *table; /* its sequence's block table */
} Item;

/* n elements of a row at base + offset (in elements of `dtype`, a KV_* type) as float32 (fp8
 * codes in the kernels' unit) */
static inline void load_row(const void *base, int64_t offset, int64_t n, int dtype, float *dst) {
    if (dtype == KV_BF16) {
        const uint16_t *src = (const uint16_t *)base + offset;
#pragma omp simd
        for (int64_t d = 0; d < n; d++) dst[d] = bf16_to_f32(src[d]);
    } else if (dtype != KV_F32) {
        const uint8_t *src = (const uint8_t *)base + offset;
        for (int64_t d = 0; d < n; d++) dst[d] = fp8_to_f32(src[d], dtype);
    } else {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
    }
}

#define CHUNK 16 /* keys scored together: one AVX-512 register of float32 scores */

/* Keys c0.. of the chunk starting at c0 (at most CHUNK, within one block) */
static inline int64_t chunk_len(int64_t c0, int64_t kmax, int64_t bs) {
    const int64_t off = c0 % bs;
    int64_t cn = bs - off < kmax - c0 ? bs - off : kmax - c0;
    return cn < CHUNK ? cn : CHUNK;
}

/* Where key c's row (every KV head) starts in the cache, in elements: its block's K half; the
 * value row is bs rows further */
static inline int64_t key_row(const Args *a, const int64_t *table, int64_t c) {
    const int64_t bs = a->block_size;
    return ((table[c / bs] * 2 * bs) + c % bs) * a->kv_heads * a->head_dim;
}

/* Chunks of keys whose lines the bfloat16 paths request ahead of use. A chunk is usually a block
 * of its own (block size 16) somewhere in the pool, so the hardware's stride prefetchers meet
 * each one cold; two ahead measured best (docs/architecture.md §Kernels). */
#define AHEAD 2

/* Where prefetch_pairs asks for the lines: every cache level (the AMX path, where the hint
 * measured no difference), or L2 and below (the pairs path: on a Zen 4 a decode's requests
 * for L1, 64 lines a chunk, stalled the core when its miss buffers filled; into L2 the tiny
 * Llama's 64-row decode layers took two thirds of the time, docs/kernels.md). */
enum { TO_L1 = 0, TO_L2 = 1 };

/* Request the lines of head h's keys and values (bfloat16 or fp8) in the chunk starting at key c
 * (of < kmax) into `level` (a constant: each path inlines its own); returns the next chunk's
 * first key. */
static inline __attribute__((always_inline)) int64_t prefetch_pairs(
    const Args *a, const int64_t *table, int64_t h, int64_t c, int64_t kmax, const int level) {
    const int64_t D = a->head_dim, bs = a->block_size, row_size = a->kv_heads * D;
    const int64_t cn = chunk_len(c, kmax, bs), es = kv_bytes(a->kv_dtype);
    const char *k = (const char *)a->cache + key_row(a, table, c) * es;
    for (int64_t j = 0; j < cn; j++)
        for (int64_t kv = 0; kv < 2; kv++) { /* key j, then value j */
            const char *row = k + ((kv * bs + j) * row_size + h * D) * es;
            for (uintptr_t line = (uintptr_t)row & ~(uintptr_t)63; line < (uintptr_t)(row + es * D);
                 line += 64) {
                if (level == TO_L2) __builtin_prefetch((const void *)line, 0, 2);
                else __builtin_prefetch((const void *)line);
            }
        }
    return c + cn;
}

/* The item's rows' query pointers, q[r] for r < rows (bfloat16 paths read q where it is) */
static inline void item_queries(const Args *a, const Item *it, const uint16_t **q) {
    for (int64_t j = 0; j < it->nq; j++)
        for (int64_t g = 0; g < it->G; g++)
            q[j * it->G + g] = (const uint16_t *)a->q + (it->tok0 + j) * a->q_stride +
                               (it->h * it->G + g) * a->head_dim;
}

/* Buffers of `bytes` laid out from p at 64-byte boundaries: returns the buffer (NULL while
 * p is NULL: only counting) and advances *at */
static inline void *take(char *p, size_t *at, size_t bytes) {
    void *out = p ? (void *)(p + *at) : NULL;
    *at += (bytes + 63) / 64 * 64;
    return out;
}

/* ---- the float path's two steps on a chunk of up to CHUNK keys of one block and KV head ----
 *   keys_t:  keys (of a KV_* type) transposed to kt [D, CHUNK] float32 (key j in lane j) and
 *            values to vf [CHUNK, D] float32;
 *   softmax: scores of `rows` query rows (qr [rows, D]) against them, then the online-softmax
 *            update of each row's running max m, sum l and accumulator acc [D] with keys
 *            [lo, hi) of the chunk.
 * attention_avx512.c defines them where the ISA has AVX-512F, attention_avx2.c where it has
 * AVX2 and no AVX-512, attention_portable.c elsewhere. */
void attention_keys_t(const void *cache, int64_t kbase, int64_t vbase, int64_t stride, int64_t n,
                      int64_t D, int dtype, float *kt, float *vf);
void attention_softmax(int64_t rows, const float *qr, const float *kt, const float *vf,
                       int64_t D, int64_t lo, int64_t hi, float softcap, float *m, float *l,
                       float *acc);

/* ---- the bfloat16 paths: each runs a whole item, output included, in its own scratch ------
 * Which are built is said here once (ATTENTION_PAIRS, ATTENTION_AMX); where one is not, its
 * entries are inline stubs the dispatch never reaches (attention.c has no #if). */

#if defined(KVTIER_AVX512BF16)
#define ATTENTION_PAIRS 1
/* Bytes of scratch the pairs path needs for items of up to max_rows rows */
size_t attention_pairs_scratch(int64_t D, int64_t max_rows);
void attention_pairs(const Args *a, const Item *it, char *scratch);
#else
#define ATTENTION_PAIRS 0
static inline size_t attention_pairs_scratch(int64_t D, int64_t max_rows) {
    (void)D, (void)max_rows;
    return 0;
}
static inline void attention_pairs(const Args *a, const Item *it, char *scratch) {
    (void)a, (void)it, (void)scratch;
}
#endif

#define AMX_MAX_D 128 /* the AMX path: Q^T in four tile registers at most; ≤ 16 rows an item */
#if defined(KVTIER_AMX)
#define ATTENTION_AMX 1
int attention_amx_granted(void); /* asks Linux for the tile state (once a process) */
size_t attention_amx_scratch(int64_t D);
void attention_amx_begin(void); /* this thread's tiles configured for the path */
void attention_amx_end(void);   /* and released */
void attention_amx(const Args *a, const Item *it, char *scratch);
#else
#define ATTENTION_AMX 0
static inline int attention_amx_granted(void) { return 0; }
static inline size_t attention_amx_scratch(int64_t D) {
    (void)D;
    return 0;
}
static inline void attention_amx_begin(void) {}
static inline void attention_amx_end(void) {}
static inline void attention_amx(const Args *a, const Item *it, char *scratch) {
    (void)a, (void)it, (void)scratch;
}
#endif

#endif
