/* Fused elementwise kernels of the decoder, each one pass over its rows instead of the 5–10 torch
 * ops (and their dispatch) it replaces: RMSNorm with the residual add before it, rotary embedding
 * of q and k in place, and the gated MLP's act(gate) * up. They round where torch's unfused ops
 * round (bfloat16 after each op, float32 without FMA contraction: built with -ffp-contract=off),
 * so results match those ops up to the last bit of a transcendental. Built and loaded by
 * kvtier/model/native.py; plain C, no Python or torch headers. dtype: 0 float32, 1 bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pool.h"

/* Rows move through float32 buffers of at most BUF elements: loops the compiler vectorizes. */
#define BUF 2048

static void load(const void *src, int64_t n, int dtype, float *dst) {
    if (dtype == 1) {
        const uint16_t *h = (const uint16_t *)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            const uint32_t u = (uint32_t)h[i] << 16;
            float f;
            memcpy(&f, &u, 4);
            dst[i] = f;
        }
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* x rounded to bfloat16 and back (round to nearest even; NaN stays NaN) */
static inline float bf16_round(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
    u = nan ? (u | 0x400000u) : u + 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float bf16_round_if(float x, int dtype) { return dtype == 1 ? bf16_round(x) : x; }

static void round_all(float *x, int64_t n, int dtype) {
    if (dtype != 1) return;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] = bf16_round(x[i]);
}

static void store(const float *src, int64_t n, int dtype, void *dst) {
    if (dtype == 1) {
        uint16_t *h = (uint16_t *)dst;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, &src[i], 4);
            const uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
            u = nan ? (u | 0x400000u) : u + 0x7fffu + ((u >> 16) & 1u);
            h[i] = (uint16_t)(u >> 16);
        }
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

/* exp(x), about 2 ulp, in a form the compiler vectorizes (Cody-Waite reduction, Cephes' expf
 * polynomial, 2^n by the exponent bits): 0 below -87.3, +inf above 88.7 */
static inline float exp_approx(float x) {
    const float xc = x < -87.3f ? -87.3f : (x > 88.0f ? 88.0f : x);
    const float t = xc * 1.44269504088896341f;
    const float n = (t + 12582912.0f) - 12582912.0f; /* round to nearest */
    const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t e = (int32_t)n + 127;
    const uint32_t bits = (uint32_t)e << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    const float y = p * scale;
    return x < -87.3f ? 0.0f : (x > 88.7f ? INFINITY : y);
}

/* tanh(x), a few ulp: Cephes' odd polynomial below |x| 0.625, else 1 - 2 / (exp(2|x|) + 1) */
static inline float tanh_approx(float x) {
    const float z = x < 0.0f ? -x : x;
    const float s = x * x;
    float p = -5.70498872745e-3f;
    p = p * s + 2.06390887954e-2f;
    p = p * s - 5.37397155531e-2f;
    p = p * s + 1.33314422036e-1f;
    p = p * s - 3.33332819422e-1f;
    const float small = p * s * x + x;
    const float big = 1.0f - 2.0f / (exp_approx(2.0f * z) + 1.0f);
    return z < 0.625f ? small : (x < 0.0f ? -big : big);
}

/* Rows [begin, end) of a kernel, run on up to `threads` threads (pool.h: chunks of rows claimed
 * as threads come, so a busy core delays nothing). */
static void parallel_rows(ChunkFn fn, const void *args, int64_t rows, int64_t work, int threads) {
    if (work < (1 << 19)) threads = 1; /* waking a helper would cost more than it saves */
    pool_run(fn, args, rows, rows / (4 * (threads > 0 ? threads : 1)), threads);
}

/* ---- RMSNorm ------------------------------------------------------------------------------ */

typedef struct {
    const void *x;
    int64_t outer_stride, inner, inner_stride; /* row r at x + (r / inner) * outer + (r % inner) * inner_stride */
    void *residual;                            /* optional [rows, dim]: x is added to it first */
    const void *weight;
    void *out; /* [rows, dim] */
    int64_t dim;
    float eps;
    int gemma, dtype;
} NormArgs;

static void norm_rows(const void *p, int64_t begin, int64_t end) {
    const NormArgs *a = (const NormArgs *)p;
    const int64_t dim = a->dim, size = a->dtype == 1 ? 2 : 4;
    const int dt = a->dtype;
    float h[8192], w[8192], t[BUF];
    load(a->weight, dim, dt, w);
    for (int64_t r = begin; r < end; r++) {
        const int64_t in = (r / a->inner) * a->outer_stride + (r % a->inner) * a->inner_stride;
        load((const char *)a->x + in * size, dim, dt, h);
        if (a->residual) { /* residual stream += x, rounded as torch's add: the norm's input */
            void *res = (char *)a->residual + r * dim * size;
            for (int64_t c = 0; c < dim; c += BUF) {
                const int64_t n = dim - c < BUF ? dim - c : BUF;
                load((const char *)res + c * size, n, dt, t);
#pragma omp simd
                for (int64_t d = 0; d < n; d++) h[c + d] = t[d] + h[c + d];
                round_all(h + c, n, dt);
                store(h + c, n, dt, (char *)res + c * size);
            }
        }
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int64_t d = 0; d < dim; d++) sq += h[d] * h[d];
        const float inv = 1.0f / sqrtf(sq / (float)dim + a->eps);
        if (a->gemma) { /* Gemma: norm(x) * (1 + w), in float32 */
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) h[d] = (h[d] * inv) * (1.0f + w[d]);
        } else { /* Llama: w * norm(x), the norm rounded to the input dtype first */
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) h[d] = h[d] * inv;
            round_all(h, dim, dt);
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) h[d] = w[d] * h[d];
        }
        store(h, dim, dt, (char *)a->out + r * dim * size);
    }
}

void kvtier_rms_norm(const void *x, int64_t outer_stride, int64_t inner, int64_t inner_stride,
                     void *residual, const void *weight, void *out, int64_t rows, int64_t dim,
                     float eps, int gemma, int dtype, int threads) {
    NormArgs a = {x, outer_stride, inner, inner_stride, residual, weight, out, dim, eps, gemma, dtype};
    parallel_rows(norm_rows, &a, rows, rows * dim, threads);
}

/* ---- rotary embedding, in place ----------------------------------------------------------- */

typedef struct {
    void *x;
    int64_t token_stride, heads, dim;
    const void *cos, *sin; /* [tokens, dim] */
    int dtype;
} RopeArgs;

static void rope_rows(const void *p, int64_t begin, int64_t end) {
    const RopeArgs *a = (const RopeArgs *)p;
    const int64_t D = a->dim, half = D / 2, size = a->dtype == 1 ? 2 : 4;
    const int dt = a->dtype;
    float v[4096], c[4096], s[4096], o[4096];
    int64_t loaded = -1;
    for (int64_t r = begin; r < end; r++) {
        const int64_t t = r / a->heads, h = r % a->heads;
        void *x = (char *)a->x + (t * a->token_stride + h * D) * size;
        if (t != loaded) { /* the tables of this token */
            load((const char *)a->cos + t * D * size, D, dt, c);
            load((const char *)a->sin + t * D * size, D, dt, s);
            loaded = t;
        }
        load(x, D, dt, v);
        /* x * cos + rotate_half(x) * sin, each product rounded to the dtype as torch's ops */
#pragma omp simd
        for (int64_t d = 0; d < half; d++) {
            o[d] = bf16_round_if(v[d] * c[d], dt) + bf16_round_if(-v[d + half] * s[d], dt);
            o[d + half] = bf16_round_if(v[d + half] * c[d + half], dt)
                        + bf16_round_if(v[d] * s[d + half], dt);
        }
        store(o, D, dt, x);
    }
}

void kvtier_rope(void *x, int64_t token_stride, int64_t heads, int64_t dim, const void *cos,
                 const void *sin, int64_t tokens, int dtype, int threads) {
    RopeArgs a = {x, token_stride, heads, dim, cos, sin, dtype};
    parallel_rows(rope_rows, &a, tokens * heads, tokens * heads * dim, threads);
}

/* ---- act(gate) * up ----------------------------------------------------------------------- */

typedef struct {
    const void *gate_up; /* [rows, 2 * inter]: gate, then up */
    void *out;           /* [rows, inter] */
    int64_t inter;
    int act, dtype; /* act: 0 silu, 1 gelu (tanh approximation), 2 gelu (erf) */
} ActArgs;

static void act_rows(const void *p, int64_t begin, int64_t end) {
    const ActArgs *a = (const ActArgs *)p;
    const int64_t n = a->inter, size = a->dtype == 1 ? 2 : 4;
    const int dt = a->dtype;
    float g[BUF], u[BUF];
    for (int64_t r = begin; r < end; r++) {
        const char *row = (const char *)a->gate_up + r * 2 * n * size;
        char *out = (char *)a->out + r * n * size;
        for (int64_t c = 0; c < n; c += BUF) {
            const int64_t m = n - c < BUF ? n - c : BUF;
            load(row + c * size, m, dt, g);
            load(row + (n + c) * size, m, dt, u);
            if (a->act == 0) {
#pragma omp simd
                for (int64_t d = 0; d < m; d++) g[d] = g[d] / (1.0f + exp_approx(-g[d]));
            } else if (a->act == 1) { /* torch's order: 0.5x (1 + tanh(b (x + k x^3))) */
#pragma omp simd
                for (int64_t d = 0; d < m; d++) {
                    const float x = g[d];
                    const float cube = x * x * x;
                    const float y = 0.7978845608028654f * (x + 0.044715f * cube);
                    g[d] = 0.5f * x * (1.0f + tanh_approx(y));
                }
            } else {
                for (int64_t d = 0; d < m; d++)
                    g[d] = 0.5f * g[d] * (1.0f + erff(g[d] * 0.7071067811865476f));
            }
            round_all(g, m, dt); /* torch rounds the activation before the product */
#pragma omp simd
            for (int64_t d = 0; d < m; d++) g[d] = g[d] * u[d];
            store(g, m, dt, out + c * size);
        }
    }
}

void kvtier_act_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int act,
                    int dtype, int threads) {
    ActArgs a = {gate_up, out, inter, act, dtype};
    parallel_rows(act_rows, &a, rows, rows * inter, threads);
}

/* ---- argmax of float32 rows (greedy sampling) -------------------------------------------- */

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef struct {
    const float *x;
    int64_t n, stride;
    int64_t *out;
} ArgmaxArgs;

/* torch.argmax's answer: the first maximal element, or the first NaN if the row has one */
static void argmax_rows(const void *p, int64_t begin, int64_t end) {
    const ArgmaxArgs *a = (const ArgmaxArgs *)p;
    const int64_t n = a->n;
    for (int64_t r = begin; r < end; r++) {
        const float *x = a->x + r * a->stride;
        float m = -INFINITY;
        int nan = 0;
        int64_t i = 0;
#if defined(__AVX512F__)
        __m512 vm = _mm512_set1_ps(-INFINITY);
        __mmask16 vnan = 0;
        for (; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            vnan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            vm = _mm512_max_ps(vm, v);
        }
        m = _mm512_reduce_max_ps(vm);
        nan = vnan != 0;
#endif
        for (; i < n; i++) {
            nan |= x[i] != x[i];
            m = x[i] > m ? x[i] : m;
        }
        int64_t at = 0;
        i = 0;
#if defined(__AVX512F__)
        const __m512 target = _mm512_set1_ps(m);
        for (; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                      : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
            if (hit) {
                at = i + __builtin_ctz((unsigned)hit);
                goto found;
            }
        }
#endif
        for (; i < n; i++)
            if (nan ? x[i] != x[i] : x[i] == m) {
                at = i;
                break;
            }
#if defined(__AVX512F__)
    found:
#endif
        a->out[r] = at;
    }
}

void kvtier_argmax(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out,
                   int threads) {
    ArgmaxArgs a = {x, n, stride, out};
    parallel_rows(argmax_rows, &a, rows, rows * n, threads);
}
