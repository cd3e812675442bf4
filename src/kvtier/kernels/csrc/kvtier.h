/* Every function the kernel library exports and both structs it reads (docs/architecture.md
 * §Kernels). The one place these are declared: each .c file includes it, so the compiler checks
 * every definition against it, and the build turns a non-static function missing here into an
 * error (-Werror=missing-prototypes) and hides every symbol not marked KVTIER_API. The Python
 * side (kvtier/kernels/abi.py) mirrors these declarations with ctypes; tests/kernels/test_abi.py
 * parses this file and compares, and the library's kvtier_abi_* exports give each struct's size
 * and field offsets as this compiler laid them out. Change a declaration here and abi.py with it.
 *
 * Conventions: dtype 0 float32, 1 bfloat16 (uint16 bits); threads: how many threads a call may
 * use (the caller and up to threads - 1 helpers of the one pool, pool.c); tensors are passed as
 * pointers with their strides in elements. An int result is 0, or -1 when a call could not
 * allocate its scratch (its output is then incomplete), or -2 when the kernel is not built for
 * this ISA (call its *_available first). */
#ifndef KVTIER_H
#define KVTIER_H

#include <stdint.h>

#define KVTIER_API __attribute__((visibility("default")))

/* ---- one decoder layer in one call (layer.c) ------------------------------------------------ */

typedef struct { /* one layer: its weights (linears packed by kvtier_linear_pack) and shape */
    const void *input_norm, *post_attn_norm;
    const void *pre_ff_norm, *post_ff_norm; /* sandwich norms (Gemma 2/3), else NULL */
    const void *q_norm, *k_norm;            /* per-head norms before rope (Gemma3), else NULL */
    const void *qkv, *o, *gate_up, *down;   /* bfloat16 tiles, or int8 ones where scaled */
    const uint16_t *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    /* int8 weights' column scales (kvtier_linear_i8_pack's tiles), or NULL: bfloat16 tiles */
    const float *qkv_scale, *o_scale, *gate_up_scale, *down_scale;
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps, scale, softcap; /* softcap 0: none */
    float k_scale, v_scale;    /* an fp8 cache's per-tensor scales (1 for a bfloat16 one) */
    int gemma, qk_gemma, act;  /* norm flavours; act as kvtier_act_mul's */
    int kv_dtype;              /* the cache's elements: 1 bfloat16, 2 fp8 e4m3, 3 fp8 e5m2 */
    int w8a8; /* 1: the int8 linears take int8 activations (kvtier_linear_w8a8_pack's tiles) */
} Layer;

typedef struct { /* one forward's attention inputs for one KV group (model/paged.py NativePlan) */
    const int64_t *tables;
    int64_t table_stride;
    const int64_t *seq_token, *seq_qlen, *seq_row, *lo, *hi;
    int64_t num_seqs;
    const int64_t *write_rows;   /* [num_written] cache row of each written token's key */
    const int64_t *write_tokens; /* [num_written] its token, or NULL: token i is row i */
    int64_t num_written, block_size;
} Step;

/* Bytes of `work` a kvtier_layers call needs per token of a layer. */
KVTIER_API int64_t kvtier_layer_work(const Layer *layer);

/* Every layer of a forward: layer i on layers[i] with steps[i], cos[i], sin[i], caches[i],
 * writing out0 or out1 by turns; x [rows, hidden] the first layer's input and residual. */
KVTIER_API int kvtier_layers(int64_t n, const Layer *const *layers, const Step *const *steps,
                             const void *const *cos, const void *const *sin, void *const *caches,
                             const void *x, void *residual, void *out0, void *out1, void *work,
                             int64_t rows, int threads);

/* ---- attention straight from the paged cache (attention*.c) --------------------------------- */

/* cache [num_blocks, 2, block_size, kv_heads, head_dim]; q [tokens, heads, head_dim] rows
 * q_stride apart; out [tokens, heads, head_dim]; query row r of a sequence reads keys
 * [lo[r], hi[r]). head_dim a multiple of 16, at most 512. kv_dtype: the cache's elements, 0
 * float32, 1 bfloat16 (q's dtype), 2 fp8 e4m3, 3 fp8 e5m2 (codes of k / k_scale, v / v_scale). */
KVTIER_API int kvtier_paged_attention(const void *q, int64_t q_stride, const void *cache,
                                      void *out, const int64_t *tables, int64_t table_stride,
                                      const int64_t *seq_token, const int64_t *seq_qlen,
                                      const int64_t *seq_row, const int64_t *lo, const int64_t *hi,
                                      int64_t num_seqs, int64_t num_heads, int64_t kv_heads,
                                      int64_t head_dim, int64_t block_size, float scale,
                                      float softcap, int dtype, int kv_dtype, float k_scale,
                                      float v_scale, int threads);

/* want 1: bfloat16 decode items on AMX tiles where the OS grants them; 0: never; -1: ask only.
 * Returns whether the tiles are in use (0 where the library has no AMX path). */
KVTIER_API int kvtier_attention_amx(int want);

/* ---- elementwise (fused.c) ---------------------------------------------------------------- */

/* row r of x at x + (r / inner) * outer_stride + (r % inner) * inner_stride; dim ≤ 8192 */
KVTIER_API void kvtier_rms_norm(const void *x, int64_t outer_stride, int64_t inner,
                                int64_t inner_stride, void *residual, const void *weight,
                                void *out, int64_t rows, int64_t dim, float eps, int gemma,
                                int dtype, int threads);
/* x [tokens, heads, dim] (heads dim apart) rotated in place; dim ≤ 4096 */
KVTIER_API void kvtier_rope(void *x, int64_t token_stride, int64_t heads, int64_t dim,
                            const void *cos, const void *sin, int64_t tokens, int dtype,
                            int threads);
/* act: 0 silu, 1 gelu (tanh), 2 gelu (erf) */
KVTIER_API void kvtier_act_mul(const void *gate_up, void *out, int64_t rows, int64_t inter,
                               int act, int dtype, int threads);
KVTIER_API void kvtier_argmax(const void *x, int64_t rows, int64_t n, int64_t stride,
                              int64_t *out, int dtype, int threads);
KVTIER_API int kvtier_top_k_top_p(float *x, int64_t rows, int64_t n, int64_t stride,
                                  const int64_t *top_k, const float *top_p, int threads);
/* each float32 row's token for its uniform u in (0, 1]: the inverse CDF of its softmax */
KVTIER_API void kvtier_draw(const float *x, int64_t rows, int64_t n, int64_t stride,
                            const float *u, int64_t *out, int threads);

/* ---- the thread pool (pool.c) ------------------------------------------------------------- */

/* While on (calls nest), the pool's idle helpers sleep instead of spinning between jobs, leaving
 * their cores to host work beside the kernels (the grammar masks' fill). */
KVTIER_API void kvtier_pool_yield(int on);

/* out[3]: calls run with helpers, calls run alone because helpers did not pay lately, and the
 * spells alone begun (pool.c) */
KVTIER_API void kvtier_pool_stats(int64_t *out);

/* ---- the structured outputs' token mask (mask.c) ------------------------------------------- */

/* logits [*, vocab] (rows stride elements apart, dtype 0 float32 or 1 bfloat16), in place: in
 * each row rows[i] (num_rows of them), a token whose bit in mask row rows[i] (words int32 a row,
 * bit j of word w: token 32 w + j) is 0 becomes -inf, as does a token past 32 * words */
KVTIER_API void kvtier_apply_bitmask(void *logits, int64_t stride, int64_t vocab,
                                     const int32_t *mask, int64_t words, const int64_t *rows,
                                     int64_t num_rows, int dtype, int threads);

/* ---- linear layers (linear*.c) ------------------------------------------------------------ */

/* 1: bfloat16 tiles on AMX (granted by the OS), 2: on AVX512-BF16, 3: widened to float32 on
 * AVX2 with FMA (no AVX-512), 4: widened to float32 on AVX-512 without BF16, 0: none */
KVTIER_API int kvtier_linear_available(void);
KVTIER_API void kvtier_linear_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed);
KVTIER_API int kvtier_linear(const uint16_t *x, int64_t x_stride, int64_t m,
                             const uint16_t *packed, int64_t n, int64_t k, const uint16_t *bias,
                             uint16_t *out, int threads);
/* int8 weights, bfloat16 activations (W8A16): which blocks are built (1: AVX-512, with BW;
 * 2: AVX2; 0: none); the weight packed into kvtier_linear_pack's tiles a byte an element,
 * scales [n] per column */
KVTIER_API int kvtier_linear_i8_available(void);
KVTIER_API void kvtier_linear_i8_pack(const int8_t *w, int64_t n, int64_t k, int8_t *packed);
KVTIER_API int kvtier_linear_i8(const uint16_t *x, int64_t x_stride, int64_t m,
                                const int8_t *packed, const float *scales, int64_t n, int64_t k,
                                const uint16_t *bias, uint16_t *out, int threads);
/* int8 weights and activations (W8A8): which path is built (1: AVX512-VNNI, 2: AVX2, 0: none) */
KVTIER_API int kvtier_linear_w8a8_available(void);
KVTIER_API void kvtier_linear_w8a8_pack(const int8_t *w, int64_t n, int64_t k, uint8_t *packed);
KVTIER_API int kvtier_linear_w8a8(const uint16_t *x, int64_t x_stride, int64_t m,
                                  const uint8_t *packed, const float *scales, int64_t n, int64_t k,
                                  const uint16_t *bias, uint16_t *out, int threads);
/* 1: the batch-invariant float32 linear is built (AVX-512F), 0: not */
KVTIER_API int kvtier_linear_f32_available(void);
KVTIER_API void kvtier_linear_f32_pack(const float *w, int64_t n, int64_t k, float *packed);
KVTIER_API int kvtier_linear_f32(const float *x, int64_t x_stride, int64_t m, const float *packed,
                                 int64_t n, int64_t k, const float *bias, float *out,
                                 int threads);

/* ---- the structs as this compiler laid them out (abi.c) ----------------------------------- */

/* sizeof of struct `name` ("Layer", "Step"), or -1 for another name */
KVTIER_API int64_t kvtier_abi_sizeof(const char *name);
/* offsetof of field `field` of struct `name`, or -1 where there is no such field */
KVTIER_API int64_t kvtier_abi_offsetof(const char *name, const char *field);
/* how many fields struct `name` has (each listed once in abi.c), or -1 */
KVTIER_API int64_t kvtier_abi_fields(const char *name);

#endif
