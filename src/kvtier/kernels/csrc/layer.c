/* A bfloat16 decoder layer's step in one call, for batches the other kernels serve whole: every
 * linear on the tile kernel (linear.c: any of its paths) and every query on the paged attention
 * kernel (decodes, drafts, a prompt's chunks planned for it). Python's layer makes ~11 kernel
 * calls, each with its ctypes call, output allocation and GIL release; here one call runs them
 * back to back (docs/architecture.md §Kernels).
 *
 * It holds no kernel of its own: it calls the library's exported functions directly (the same
 * code Python calls, on the one thread pool, pool.c), on the same inputs in the same order, so
 * the results are the same bits as the layer's Python path.
 */
#include <string.h>

#include "internal.h"

/* Bytes of `work` a call needs per token. */
int64_t kvtier_layer_work(const Layer *L) {
    const int64_t q = L->heads * L->head_dim, kv = L->kv_heads * L->head_dim;
    int64_t elements = 3 * L->hidden + (q + 2 * kv) + q + kv + q + 3 * L->inter;
    return elements * 2;
}

/* one of the layer's linears: int8 tiles where it has scales (W8A8's where the layer says so),
 * else bfloat16 ones */
static int linear(const Layer *L, const void *w, const float *scale, const uint16_t *x,
                  int64_t rows, int64_t n, int64_t k, const uint16_t *bias, uint16_t *out,
                  int threads) {
    if (scale && L->w8a8)
        return kvtier_linear_w8a8(x, k, rows, (const uint8_t *)w, scale, n, k, bias, out, threads);
    if (scale) return kvtier_linear_i8(x, k, rows, (const int8_t *)w, scale, n, k, bias, out, threads);
    return kvtier_linear(x, k, rows, (const uint16_t *)w, n, k, bias, out, threads);
}

/* x [rows, hidden] → out [rows, hidden]; residual [rows, hidden] is updated in place (first: it
 * is x, and the first norm adds nothing). cache: the layer's KV tensor. Returns 0, or -1 when a
 * kernel could not allocate its scratch (out is then incomplete). */
static int layer_step(const Layer *L, const Step *S, const void *cos, const void *sin,
                      void *cache, const void *x, void *residual, void *out, void *work,
                      int64_t rows, int first, int threads) {
    const int64_t H = L->heads, KVH = L->kv_heads, D = L->head_dim, hid = L->hidden;
    const int64_t qd = H * D, kvd = KVH * D, width = qd + 2 * kvd;
    uint16_t *h = (uint16_t *)work, *qkv = h + rows * hid, *qn = qkv + rows * width;
    uint16_t *kn = qn + rows * qd, *attn = kn + rows * kvd, *o = attn + rows * qd;
    uint16_t *o2 = o + rows * hid, *gate_up = o2 + rows * hid, *act = gate_up + rows * 2 * L->inter;
    const float eps = L->eps;
    const int gemma = L->gemma, bf16 = 1;
    int status = 0;

    kvtier_rms_norm(x, hid, 1, 0, first ? NULL : residual, L->input_norm, h, rows, hid, eps, gemma,
                    bf16, threads);
    status |= linear(L, L->qkv, L->qkv_scale, h, rows, width, hid, L->qkv_bias, qkv, threads);
    const uint16_t *q = qkv, *k = qkv + qd, *v = qkv + qd + kvd;
    int64_t q_stride = width, k_stride = width;
    if (L->q_norm) {
        kvtier_rms_norm(qkv, width, H, D, NULL, L->q_norm, qn, rows * H, D, eps, L->qk_gemma, bf16,
                        threads);
        kvtier_rms_norm(qkv + qd, width, KVH, D, NULL, L->k_norm, kn, rows * KVH, D, eps,
                        L->qk_gemma, bf16, threads);
        kvtier_rope(qn, qd, H, D, cos, sin, rows, bf16, threads);
        kvtier_rope(kn, kvd, KVH, D, cos, sin, rows, bf16, threads);
        q = qn, k = kn, q_stride = qd, k_stride = kvd;
    } else { /* q and k rotated together */
        kvtier_rope(qkv, width, H + KVH, D, cos, sin, rows, bf16, threads);
    }
    /* token rows of kvd elements; a block's V rows follow its K */
    for (int64_t i = 0; i < S->num_written; i++) {
        const int64_t t = S->write_tokens ? S->write_tokens[i] : i, row = S->write_rows[i];
        const int64_t vrow = row + S->block_size;
        if (L->kv_dtype == KV_BF16) {
            memcpy((uint16_t *)cache + row * kvd, k + t * k_stride, (size_t)kvd * 2);
            memcpy((uint16_t *)cache + vrow * kvd, v + t * width, (size_t)kvd * 2);
            continue;
        }
        uint8_t *kc = (uint8_t *)cache + row * kvd, *vc = (uint8_t *)cache + vrow * kvd;
        for (int64_t d = 0; d < kvd; d++) { /* quantize on store, as paged.py `stored` */
            kc[d] = f32_to_fp8(bf16_to_f32(k[t * k_stride + d]) / L->k_scale, L->kv_dtype);
            vc[d] = f32_to_fp8(bf16_to_f32(v[t * width + d]) / L->v_scale, L->kv_dtype);
        }
    }
    status |= kvtier_paged_attention(q, q_stride, cache, attn, S->tables, S->table_stride,
                                     S->seq_token, S->seq_qlen, S->seq_row, S->lo, S->hi,
                                     S->num_seqs, H, KVH, D, S->block_size, L->scale, L->softcap,
                                     bf16, L->kv_dtype, L->k_scale, L->v_scale, threads);
    status |= linear(L, L->o, L->o_scale, attn, rows, hid, qd, L->o_bias, o, threads);
    if (L->pre_ff_norm) {
        kvtier_rms_norm(o, hid, 1, 0, NULL, L->post_attn_norm, o2, rows, hid, eps, gemma, bf16,
                        threads);
        kvtier_rms_norm(o2, hid, 1, 0, residual, L->pre_ff_norm, h, rows, hid, eps, gemma, bf16,
                        threads);
    } else {
        kvtier_rms_norm(o, hid, 1, 0, residual, L->post_attn_norm, h, rows, hid, eps, gemma, bf16,
                        threads);
    }
    const int64_t inter = L->inter;
    status |= linear(L, L->gate_up, L->gate_up_scale, h, rows, 2 * inter, hid, L->gate_up_bias,
                     gate_up, threads);
    kvtier_act_mul(gate_up, act, rows, inter, L->act, bf16, threads);
    if (L->post_ff_norm) {
        status |= linear(L, L->down, L->down_scale, act, rows, hid, inter, L->down_bias, o, threads);
        kvtier_rms_norm(o, hid, 1, 0, NULL, L->post_ff_norm, out, rows, hid, eps, gemma, bf16,
                        threads);
    } else {
        status |= linear(L, L->down, L->down_scale, act, rows, hid, inter, L->down_bias, out, threads);
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
