/* The bfloat16 norms, rotary embedding and activations in one pass of 16-lane vectors a row, on
 * AVX-512 with its BF16 conversions (fused.h dispatches; docs/architecture.md §Kernels): the
 * same bfloat16 results as fused.c's loops through float32 buffers but for a rare last bit. */
#include <math.h>

#include "fused.h"

#if defined(KVTIER_AVX512BF16)
#include "vec512.h"

/* 16 bfloat16 (the first `k` lanes) as float32 */
static inline __m512 bf16_load(const void *p, __mmask16 k) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}

static inline void bf16_store(void *p, __mmask16 k, __m512 v) {
    _mm256_mask_storeu_epi16(p, k, (__m256i)_mm512_cvtneps_pbh(v));
}

static inline __m512 bf16_round16(__m512 v) { /* to bfloat16 and back, round to nearest even */
    const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}

static inline __mmask16 lanes(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}

/* e^x on 16 lanes (vec512.h): 0 far below, +inf far above, NaN stays NaN */
static inline __m512 exp16(__m512 x) {
    return exp_clamped(_mm512_min_ps(_mm512_set1_ps(88.8f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x)));
}

/* bfloat16 rows in 16-lane vectors: each row read once (with the residual add), normed from a
 * float32 copy; no per-row division for the row's address. `w`: the weight as float32. */
int fused_norm_rows_bf16(const NormArgs *a, float *w, int64_t begin, int64_t end) {
    const int64_t dim = a->dim;
    float h[8192] __attribute__((aligned(64)));
    if (a->gemma)
        for (int64_t d = 0; d < dim; d++) w[d] = 1.0f + w[d];
    int64_t outer = begin / a->inner, inner = begin % a->inner;
    for (int64_t r = begin; r < end; r++) {
        const uint16_t *x = (const uint16_t *)a->x + outer * a->outer_stride + inner * a->inner_stride;
        if (++inner == a->inner) {
            inner = 0;
            outer++;
        }
        uint16_t *res = a->residual ? (uint16_t *)a->residual + r * dim : NULL;
        __m512 sq = _mm512_setzero_ps();
        for (int64_t c = 0; c < dim; c += 16) {
            const __mmask16 k = lanes(dim - c);
            __m512 v = bf16_load(x + c, k);
            if (res) { /* residual stream += x, rounded as torch's add: the norm's input */
                v = bf16_round16(_mm512_add_ps(bf16_load(res + c, k), v));
                bf16_store(res + c, k, v);
            }
            _mm512_mask_storeu_ps(h + c, k, v);
            sq = _mm512_add_ps(sq, _mm512_mul_ps(v, v));
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sq) / (float)dim + a->eps));
        uint16_t *out = (uint16_t *)a->out + r * dim;
        for (int64_t c = 0; c < dim; c += 16) {
            const __mmask16 k = lanes(dim - c);
            const __m512 v = _mm512_maskz_loadu_ps(k, h + c), wv = _mm512_maskz_loadu_ps(k, w + c);
            if (a->gemma) /* Gemma: norm(x) * (1 + w), in float32 */
                bf16_store(out + c, k, _mm512_mul_ps(_mm512_mul_ps(v, inv), wv));
            else /* Llama: w * norm(x), the norm rounded to the input dtype first */
                bf16_store(out + c, k, _mm512_mul_ps(wv, bf16_round16(_mm512_mul_ps(v, inv))));
        }
    }
    return 1;
}

/* bfloat16 with half the head a whole number of vectors: each product rounded as torch's ops */
int fused_rope_rows_bf16(const RopeArgs *a, int64_t begin, int64_t end) {
    const int64_t D = a->dim, half = D / 2;
    if (half % 16) return 0;
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    for (int64_t r = begin; r < end; r++) {
        const int64_t t = r / a->heads, h = r % a->heads;
        uint16_t *x = (uint16_t *)a->x + t * a->token_stride + h * D;
        const uint16_t *c = (const uint16_t *)a->cos + t * D, *s = (const uint16_t *)a->sin + t * D;
        for (int64_t d = 0; d < half; d += 16) {
            const __m512 lo = bf16_load(x + d, 0xffff), hi = bf16_load(x + d + half, 0xffff);
            const __m512 neg_hi = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(hi), sign));
            const __m512 o_lo = _mm512_add_ps(bf16_round16(_mm512_mul_ps(lo, bf16_load(c + d, 0xffff))),
                                              bf16_round16(_mm512_mul_ps(neg_hi, bf16_load(s + d, 0xffff))));
            const __m512 o_hi = _mm512_add_ps(bf16_round16(_mm512_mul_ps(hi, bf16_load(c + d + half, 0xffff))),
                                              bf16_round16(_mm512_mul_ps(lo, bf16_load(s + d + half, 0xffff))));
            bf16_store(x + d, 0xffff, o_lo);
            bf16_store(x + d + half, 0xffff, o_hi);
        }
    }
    return 1;
}

/* bfloat16 silu and gelu (tanh): one pass of 16-lane vectors over a row */
int fused_act_rows_bf16(const ActArgs *a, int64_t begin, int64_t end) {
    const int64_t n = a->inter;
    if (a->act == 2) return 0; /* gelu (erf): the portable loops */
    const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f), half = _mm512_set1_ps(0.5f);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    for (int64_t r = begin; r < end; r++) {
        const uint16_t *gate = (const uint16_t *)a->gate_up + r * 2 * n, *up = gate + n;
        uint16_t *out = (uint16_t *)a->out + r * n;
        for (int64_t c = 0; c < n; c += 16) {
            const __mmask16 k = lanes(n - c);
            const __m512 x = bf16_load(gate + c, k);
            __m512 act;
            if (a->act == 0) {
                act = _mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
            } else { /* torch's order: 0.5x (1 + tanh(y)), y = b (x + k x^3); tanh(y) as
                      * ±(1 - 2 / (exp(2|y|) + 1)) throughout: near 0 it loses relative bits,
                      * but 1 + tanh(y) needs only absolute ones there */
                const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
                const __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                    _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(0.044715f), cube)));
                const __m512 z = _mm512_abs_ps(y);
                const __m512 e = exp16(_mm512_add_ps(z, z));
                __m512 t = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(e, one)));
                t = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t),
                    _mm512_and_si512(_mm512_castps_si512(y), sign))); /* t ≥ 0: y's sign */
                act = _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, t));
            }
            /* torch rounds the activation before the product */
            bf16_store(out + c, k, _mm512_mul_ps(bf16_round16(act), bf16_load(up + c, k)));
        }
    }
    return 1;
}
#endif
