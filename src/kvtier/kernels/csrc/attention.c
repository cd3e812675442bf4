/* Paged attention straight from the KV cache for decodes, draft verification and a prompt's chunk
 * (in a step the one-call layers run): no gather copy; work items of (sequence, KV head, block of
 * up to QBLOCK queries), each reading its keys once, up to its last query; float32
 * accumulation with an online softmax (per chunk of keys; per segment of up to SEG chunks in the
 * bfloat16 paths). This file holds the call, its work items and the one dispatch of each item to
 * a path (attention.h; docs/architecture.md §Kernels): the AMX tiles, the bfloat16 pairs, or the
 * float path whose inner steps are AVX-512F, AVX2 or portable loops.
 *
 * Cache layout [num_blocks, 2, block_size, kv_heads, head_dim] (K then V per block), contiguous.
 * q is [tokens, heads, head_dim] with a token stride (a view of the fused qkv output); out is
 * contiguous [tokens, heads, head_dim]. Query head h reads KV head h / group. Each query row r of
 * a sequence attends to key positions [lo[r], hi[r]) (causal, window and chunk masks are all
 * one range per query). Element type: 0 float32, 1 bfloat16 (round to nearest even on output);
 * the cache's may be an fp8 code instead (kv_dtype, internal.h), read as bfloat16 or float32 in
 * registers, its per-tensor k scale folded into the score scale and v's into the output.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "attention.h"

typedef enum { PATH_FLOAT, PATH_PAIRS, PATH_AMX, PATHS } Path;

static _Atomic int amx_on = -1; /* -1: not asked yet; 0: off; 1: on (the OS granted the tiles) */

int kvtier_attention_amx(int want) {
    static _Atomic int granted = -1;
    if (granted < 0) granted = attention_amx_granted();
    if (want >= 0) amx_on = want && granted;
    else if (amx_on < 0) amx_on = granted;
    return amx_on;
}

/* The one dispatch: the path an item of `rows` query rows takes in this call. */
static Path path_of(const Args *a, int64_t rows) {
    if (a->dtype != KV_BF16 || a->kv_dtype == KV_F32 || a->head_dim % 32) return PATH_FLOAT;
    if (ATTENTION_AMX && a->amx && rows <= 16 && a->head_dim <= AMX_MAX_D) return PATH_AMX;
    return ATTENTION_PAIRS ? PATH_PAIRS : PATH_FLOAT;
}

/* Lays the float path's buffers for items of up to `rows` rows out from p (NULL: only
 * counting): qf, acc [rows, D]; kt [D, CHUNK]; vf [CHUNK, D]; m, l [rows]. Returns the bytes. */
static size_t float_layout(char *p, int64_t D, int64_t rows, float **buf) {
    size_t at = 0;
    const int64_t sizes[6] = {rows * D, rows * D, CHUNK * D, CHUNK * D, rows, rows};
    for (int i = 0; i < 6; i++) buf[i] = take(p, &at, sizeof(float) * (size_t)sizes[i]);
    return at;
}

static void prefetch_chunk(const char *k, int64_t bytes, int64_t value) {
    for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(k + b);
        __builtin_prefetch(k + value + b);
    }
}

/* The float path: float32 or bfloat16 through float32 buffers, a chunk at a time with an online
 * softmax (attention.h's two steps). */
static void attend_float(const Args *a, const Item *it, char *scratch) {
    const int64_t D = a->head_dim, bs = a->block_size, G = it->G, rows = it->nq * G;
    const int64_t size = kv_bytes(a->kv_dtype), row_size = a->kv_heads * D; /* a key, all heads */
    float *buf[6];
    float_layout(scratch, D, rows, buf);
    float *qf = buf[0], *acc = buf[1], *kt = buf[2], *vf = buf[3], *m = buf[4], *l = buf[5];
    for (int64_t j = 0; j < it->nq; j++)
        for (int64_t g = 0; g < G; g++) {
            float *qr = qf + (j * G + g) * D;
            load_row(a->q, (it->tok0 + j) * a->q_stride + (it->h * G + g) * D, D, a->dtype, qr);
            for (int64_t d = 0; d < D; d++) qr[d] *= a->scale;
        }
    memset(acc, 0, sizeof(float) * (size_t)(rows * D));
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    const int64_t h = it->h, kmax = it->kmax, *table = it->table;
    for (int64_t c0 = it->kmin; c0 < kmax;) { /* chunks of keys within one block */
        const int64_t cn = chunk_len(c0, kmax, bs);
        const int64_t kbase = key_row(a, table, c0);
        if (c0 + cn < kmax) { /* the next chunk's lines, while this one computes */
            const int64_t n1 = c0 + cn, cn1 = chunk_len(n1, kmax, bs);
            const int64_t k1 = key_row(a, table, n1);
            prefetch_chunk((const char *)a->cache + k1 * size, cn1 * row_size * size,
                           bs * row_size * size);
        }
        attention_keys_t(a->cache, kbase + h * D, kbase + bs * row_size + h * D, row_size, cn, D,
                         a->kv_dtype, kt, vf);
        for (int64_t qi = 0; qi < it->nq; qi++) {
            const int64_t lo = a->lo[it->row0 + qi] > c0 ? a->lo[it->row0 + qi] - c0 : 0;
            const int64_t hi = a->hi[it->row0 + qi] < c0 + cn ? a->hi[it->row0 + qi] - c0 : cn;
            if (lo >= hi) continue;
            const int64_t r = qi * G; /* the query's G rows */
            attention_softmax(G, qf + r * D, kt, vf, D, lo, hi, a->softcap, m + r, l + r,
                              acc + r * D);
        }
        c0 += cn;
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inv = (l[r] > 0.0f ? 1.0f / l[r] : 0.0f) * a->v_scale;
        const int64_t o = ((it->tok0 + r / G) * a->num_heads + h * G + r % G) * D;
        if (a->dtype == 1) {
            uint16_t *dst = (uint16_t *)a->out + o;
            for (int64_t d = 0; d < D; d++) dst[d] = f32_to_bf16(acc[r * D + d] * inv);
        } else {
            float *dst = (float *)a->out + o;
            for (int64_t d = 0; d < D; d++) dst[d] = acc[r * D + d] * inv;
        }
    }
}

typedef struct {
    Args args;
    const int64_t *items; /* [n][3]: sequence, KV head, first query of a block of ≤ QBLOCK */
    _Atomic int status;   /* 0, or -1: out of memory (those items' rows of out are not written) */
} Job;

static Item item_at(const Job *job, int64_t w) {
    const Args *a = &job->args;
    const int64_t *item = job->items + 3 * w;
    const int64_t seq = item[0], q0 = item[2], left = a->seq_qlen[seq] - q0;
    Item it = {.h = item[1], .nq = left < QBLOCK ? left : QBLOCK, .G = a->num_heads / a->kv_heads};
    it.tok0 = a->seq_token[seq] + q0, it.row0 = a->seq_row[seq] + q0;
    it.kmin = INT64_MAX, it.kmax = 0;
    for (int64_t j = 0; j < it.nq; j++) {
        if (a->lo[it.row0 + j] < it.kmin) it.kmin = a->lo[it.row0 + j];
        if (a->hi[it.row0 + j] > it.kmax) it.kmax = a->hi[it.row0 + j];
    }
    it.table = a->tables + seq * a->table_stride;
    return it;
}

/* Bytes of scratch `path` needs for items of up to max_rows rows. */
static size_t scratch_bytes(Path path, int64_t D, int64_t max_rows) {
    float *buf[6];
    switch (path) {
    case PATH_AMX: return attention_amx_scratch(D);
    case PATH_PAIRS: return attention_pairs_scratch(D, max_rows);
    default: return float_layout(NULL, D, max_rows, buf);
    }
}

static void attend(Path path, const Args *a, const Item *it, char *scratch) {
    switch (path) {
    case PATH_AMX: attention_amx(a, it, scratch); return;
    case PATH_PAIRS: attention_pairs(a, it, scratch); return;
    default: attend_float(a, it, scratch); return;
    }
}

/* Items [begin, end) on this thread, each path's scratch allocated at its first item. */
static void run_chunk(const void *ctx, int64_t begin, int64_t end) {
    Job *job = (Job *)ctx;
    const Args *a = &job->args;
    int64_t max_rows = 0;
    for (int64_t w = begin; w < end; w++) {
        const Item it = item_at(job, w);
        if (it.nq * it.G > max_rows) max_rows = it.nq * it.G;
    }
    char *scratch[PATHS] = {NULL};
    for (int64_t w = begin; w < end && max_rows > 0; w++) {
        const Item it = item_at(job, w);
        const Path path = path_of(a, it.nq * it.G);
        if (!scratch[path]) {
            if (posix_memalign((void **)&scratch[path], 64,
                               scratch_bytes(path, a->head_dim, max_rows))) {
                scratch[path] = NULL;
                atomic_store(&job->status, -1);
                break;
            }
            if (path == PATH_AMX) attention_amx_begin();
        }
        attend(path, a, &it, scratch[path]);
    }
    if (scratch[PATH_AMX]) attention_amx_end();
    for (int p = 0; p < PATHS; p++) free(scratch[p]);
}

/* Returns 0, or -1 when scratch memory could not be allocated (out is then incomplete). */
int kvtier_paged_attention(const void *q, int64_t q_stride, const void *cache, void *out,
                           const int64_t *tables, int64_t table_stride, const int64_t *seq_token,
                           const int64_t *seq_qlen, const int64_t *seq_row, const int64_t *lo,
                           const int64_t *hi, int64_t num_seqs, int64_t num_heads,
                           int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                           float softcap, int dtype, int kv_dtype, float k_scale, float v_scale,
                           int num_threads) {
    int64_t items = 0, keys = 0; /* work items; the work: keys read, summed over sequences */
    for (int64_t i = 0; i < num_seqs; i++)
        if (seq_qlen[i] > 0) {
            items += kv_heads * ((seq_qlen[i] + QBLOCK - 1) / QBLOCK);
            keys += hi[seq_row[i] + seq_qlen[i] - 1] - lo[seq_row[i]];
        }
    if (items == 0) return 0;
    int64_t *table = malloc(sizeof(int64_t) * 3 * (size_t)items);
    if (!table) return -1;
    int64_t w = 0;
    for (int64_t i = 0; i < num_seqs; i++) /* sequence-major: a thread's items share its keys */
        for (int64_t h = 0; h < kv_heads; h++)
            for (int64_t q0 = 0; q0 < seq_qlen[i]; q0 += QBLOCK) {
                table[3 * w] = i;
                table[3 * w + 1] = h;
                table[3 * w + 2] = q0;
                w++;
            }
    if (keys * kv_heads * head_dim < (1 << 17)) num_threads = 1; /* waking a helper costs more */
    if (num_threads < 1) num_threads = 1;
    if (num_threads > items) num_threads = (int)items;
    Job job = {.args = {q, q_stride, cache, out, tables, table_stride, seq_token, seq_qlen,
                        seq_row, lo, hi, num_heads, kv_heads, head_dim, block_size,
                        scale * k_scale, softcap, v_scale, dtype, kv_dtype,
                        kvtier_attention_amx(-1)},
               .items = table};
    /* chunks of a quarter of a thread's share: sequences differ in length */
    pool_run(run_chunk, &job, items, items / (4 * num_threads), num_threads);
    free(table);
    return atomic_load(&job.status);
}