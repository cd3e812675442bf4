/* A bfloat16 decoder layer's step in one call, for batches the other kernels serve whole: every
 * linear on the tile kernel (linear.c: AMX or AVX512-BF16) and every query on the paged attention kernel (decodes, short draft
 * queries). Python's layer makes ~11 kernel calls, each paying ~5 µs of ctypes and ~3 µs of
 * torch.empty besides its Python; here one call runs them back to back with the GIL released.
 *
 * It holds no kernel of its own: it calls the other libraries' exported functions through the
 * pointers `Layer` carries (the same code Python calls, on the one thread pool, pool.c), on the
 * same inputs in the same order, so the results are the same bits as the layer's Python path.
 * Built and loaded by kvtier/model/native.py; plain C, no Python or torch headers.
 */
#include <stdint.h>
#include <string.h>

typedef void (*RmsNormFn)(const void *x, int64_t outer_stride, int64_t inner, int64_t inner_stride,
                          void *residual, const void *weight, void *out, int64_t rows,
                          int64_t dim, float eps, int gemma, int dtype, int threads);
typedef void (*RopeFn)(void *x, int64_t token_stride, int64_t heads, int64_t dim, const void *cos,
                       const void *sin, int64_t tokens, int dtype, int threads);
typedef void (*ActMulFn)(const void *gate_up, void *out, int64_t rows, int64_t inter, int act,
                         int dtype, int threads);
typedef int (*LinearFn)(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                        int64_t n, int64_t k, const uint16_t *bias, uint16_t *out, int threads);
typedef int (*AttentionFn)(const void *q, int64_t q_stride, const void *cache, void *out,
                           const int64_t *tables, int64_t table_stride, const int64_t *seq_token,
                           const int64_t *seq_qlen, const int64_t *seq_row, const int64_t *lo,
                           const int64_t *hi, int64_t num_seqs, int64_t num_heads,
                           int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                           float softcap, int dtype, int num_threads);

typedef struct { /* one layer: its kernels, weights (linears packed as tiles) and shape */
    RmsNormFn rms_norm;
    RopeFn rope;
    ActMulFn act_mul;
    LinearFn linear;
    AttentionFn attention;
    const void *input_norm, *post_attn_norm;
    const void *pre_ff_norm, *post_ff_norm; /* sandwich norms (Gemma 2/3), else NULL */
    const void *q_norm, *k_norm;            /* per-head norms before rope (Gemma3), else NULL */
    const uint16_t *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps, scale, softcap; /* softcap 0: none */
    int gemma, qk_gemma, act;  /* norm flavours; act as kvtier_act_mul's */
} Layer;

typedef struct { /* one forward's attention inputs for one KV group (see NativePlan) */
    const int64_t *tables;
    int64_t table_stride;
    const int64_t *seq_token, *seq_qlen, *seq_row, *lo, *hi;
    int64_t num_seqs;
    const int64_t *write_rows;   /* [num_written] cache row of each written token's key */
    const int64_t *write_tokens; /* [num_written] its token, or NULL: token i is row i */
    int64_t num_written, block_size;
} Step;

/* Bytes of `work` a call needs per token. */
int64_t kvtier_layer_work(const Layer *L) {
    const int64_t q = L->heads * L->head_dim, kv = L->kv_heads * L->head_dim;
    int64_t elements = 3 * L->hidden + (q + 2 * kv) + q + kv + q + 3 * L->inter;
    return elements * 2;
}

/* x [rows, hidden] → out [rows, hidden]; residual [rows, hidden] is updated in place (first: it is
 * x, and the first norm adds nothing). cache: the layer's KV tensor. Returns 0, or -1 when a
 * kernel could not allocate its scratch (out is then incomplete). */
static int layer_step(const Layer *L, const Step *S, const void *cos, const void *sin,
                      void *cache, const void *x, void *residual, void *out, void *work,
                      int64_t rows, int first, int threads) {
    const int64_t H = L->heads, KVH = L->kv_heads, D = L->head_dim, hid = L->hidden;
    const int64_t qd = H * D, kvd = KVH * D, width = qd + 2 * kvd;
    uint16_t *h = (uint16_t *)work, *qkv = h + rows * hid, *qn = qkv + rows * width;
    uint16_t *kn = qn + rows * qd, *attn = kn + rows * kvd, *o = attn + rows * qd;
    uint16_t *o2 = o + rows * hid, *gate_up = o2 + rows * hid, *act = gate_up + rows * 2 * L->inter;
    int status = 0;

    L->rms_norm(x, hid, 1, 0, first ? NULL : residual, L->input_norm, h, rows, hid, L->eps,
                L->gemma, 1, threads);
    status |= L->linear(h, hid, rows, L->qkv, width, hid, L->qkv_bias, qkv, threads);
    const uint16_t *q = qkv, *k = qkv + qd, *v = qkv + qd + kvd;
    int64_t q_stride = width, k_stride = width;
    if (L->q_norm) {
        L->rms_norm(qkv, width, H, D, NULL, L->q_norm, qn, rows * H, D, L->eps, L->qk_gemma, 1,
                    threads);
        L->rms_norm(qkv + qd, width, KVH, D, NULL, L->k_norm, kn, rows * KVH, D, L->eps,
                    L->qk_gemma, 1, threads);
        L->rope(qn, qd, H, D, cos, sin, rows, 1, threads);
        L->rope(kn, kvd, KVH, D, cos, sin, rows, 1, threads);
        q = qn, k = kn, q_stride = qd, k_stride = kvd;
    } else { /* q and k rotated together */
        L->rope(qkv, width, H + KVH, D, cos, sin, rows, 1, threads);
    }
    uint16_t *kv = (uint16_t *)cache; /* token rows of kvd elements; a block's V rows follow its K */
    for (int64_t i = 0; i < S->num_written; i++) {
        const int64_t t = S->write_tokens ? S->write_tokens[i] : i, row = S->write_rows[i];
        memcpy(kv + row * kvd, k + t * k_stride, (size_t)kvd * 2);
        memcpy(kv + (row + S->block_size) * kvd, v + t * width, (size_t)kvd * 2);
    }
    status |= L->attention(q, q_stride, cache, attn, S->tables, S->table_stride, S->seq_token,
                           S->seq_qlen, S->seq_row, S->lo, S->hi, S->num_seqs, H, KVH, D,
                           S->block_size, L->scale, L->softcap, 1, threads);
    status |= L->linear(attn, qd, rows, L->o, hid, qd, L->o_bias, o, threads);
    if (L->pre_ff_norm) {
        L->rms_norm(o, hid, 1, 0, NULL, L->post_attn_norm, o2, rows, hid, L->eps, L->gemma, 1,
                    threads);
        L->rms_norm(o2, hid, 1, 0, residual, L->pre_ff_norm, h, rows, hid, L->eps, L->gemma, 1,
                    threads);
    } else {
        L->rms_norm(o, hid, 1, 0, residual, L->post_attn_norm, h, rows, hid, L->eps, L->gemma, 1,
                    threads);
    }
    status |= L->linear(h, hid, rows, L->gate_up, 2 * L->inter, hid, L->gate_up_bias, gate_up,
                        threads);
    L->act_mul(gate_up, act, rows, L->inter, L->act, 1, threads);
    if (L->post_ff_norm) {
        status |= L->linear(act, L->inter, rows, L->down, hid, L->inter, L->down_bias, o, threads);
        L->rms_norm(o, hid, 1, 0, NULL, L->post_ff_norm, out, rows, hid, L->eps, L->gemma, 1,
                    threads);
    } else {
        status |= L->linear(act, L->inter, rows, L->down, hid, L->inter, L->down_bias, out,
                            threads);
    }
    return status ? -1 : 0;
}

/* Every layer of a forward in one call: layer i on `layers[i]` with its KV group's step, rope
 * tables and cache, writing outs[i % 2] (out0, out1), which layer i + 1 reads; x, residual as
 * for layer_step, the first layer's. Returns 0, or -1 at the first layer a kernel found no
 * scratch for. One call releases the GIL once for the whole stack: a call per layer retook it
 * after every layer, and waited there whenever the host thread (scheduling the next step) held
 * it — long enough that the pool's helper stopped spinning and slept (pool.c). */
int kvtier_layers(int64_t n, const Layer *const *layers, const Step *const *steps,
                  const void *const *cos, const void *const *sin, void *const *caches,
                  const void *x, void *residual, void *out0, void *out1, void *work, int64_t rows,
                  int threads) {
    const void *h = x;
    for (int64_t i = 0; i < n; i++) {
        void *out = i % 2 ? out1 : out0;
        if (layer_step(layers[i], steps[i], cos[i], sin[i], caches[i], h, residual, out, work,
                       rows, i == 0, threads))
            return -1;
        h = out;
    }
    return 0;
}
