/* Fused elementwise kernels of the decoder, each one pass over its rows instead of the 5–10 torch
 * ops (and their dispatch) it replaces: RMSNorm with the residual add before it, rotary embedding
 * of q and k in place, and the gated MLP's act(gate) * up. They round where torch's unfused ops
 * round (bfloat16 after each op, float32 without FMA contraction: built with -ffp-contract=off),
 * so results match those ops up to the last bit of a transcendental. This file holds every
 * kernel's entry and its portable loops through float32 buffers (float32, and CPUs without the
 * vector paths); the AVX-512 paths sit in fused_avx512*.c behind fused.h, which dispatches
 * (docs/architecture.md §Kernels). dtype: 0 float32, 1 bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fused.h"

/* Rows move through float32 buffers of at most BUF elements: loops the compiler vectorizes. */
#define BUF 2048

static void load(const void *src, int64_t n, int dtype, float *dst) {
    if (dtype == 1) {
        const uint16_t *h = (const uint16_t *)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(h[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
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
        for (int64_t i = 0; i < n; i++) h[i] = f32_to_bf16(src[i]);
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
static void parallel_rows(ChunkFn fn, const void *args, int64_t rows, int64_t work,
                          int64_t min_work, int threads) {
    if (work < min_work) threads = 1; /* waking a helper would cost more than it saves */
    pool_run(fn, args, rows, rows / (4 * (threads > 0 ? threads : 1)), threads);
}

/* ---- RMSNorm ------------------------------------------------------------------------------ */



static void norm_rows(const void *p, int64_t begin, int64_t end) {
    const NormArgs *a = (const NormArgs *)p;
    const int64_t dim = a->dim, size = a->dtype == 1 ? 2 : 4;
    const int dt = a->dtype;
    float h[8192], w[8192], t[BUF];
    load(a->weight, dim, dt, w);
    if (dt == 1 && fused_norm_rows_bf16(a, w, begin, end)) return;
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
    parallel_rows(norm_rows, &a, rows, rows * dim, 1 << 19, threads);
}

/* ---- rotary embedding, in place ----------------------------------------------------------- */



static void rope_rows(const void *p, int64_t begin, int64_t end) {
    const RopeArgs *a = (const RopeArgs *)p;
    const int64_t D = a->dim, half = D / 2, size = a->dtype == 1 ? 2 : 4;
    const int dt = a->dtype;
    if (dt == 1 && fused_rope_rows_bf16(a, begin, end)) return;
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
    parallel_rows(rope_rows, &a, tokens * heads, tokens * heads * dim, 1 << 19, threads);
}

/* ---- act(gate) * up ----------------------------------------------------------------------- */



static void act_rows(const void *p, int64_t begin, int64_t end) {
    const ActArgs *a = (const ActArgs *)p;
    const int64_t n = a->inter, size = a->dtype == 1 ? 2 : 4;
    const int dt = a->dtype;
    if (dt == 1 && fused_act_rows_bf16(a, begin, end)) return;
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
    parallel_rows(act_rows, &a, rows, rows * inter, 1 << 16, threads);
}

/* ---- argmax of float32 or bfloat16 rows (greedy sampling) -------------------------------- */

typedef struct {
    const void *x;
    int64_t n, stride; /* stride in elements */
    int64_t *out;
    int dtype;
} ArgmaxArgs;

/* element i of a row, widened to float32 (exact for bfloat16, so the order is the row's own) */
static inline float argmax_elem(const void *x, int64_t i, int dtype) {
    return dtype == 1 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* torch.argmax's answer for a row of maximum m (`nan`: holding a NaN): the first NaN, else the
 * first element equal to m */
static int64_t argmax_find(const void *x, int64_t n, int dtype, float m, int nan) {
    int64_t at = 0;
    int64_t i = fused_argmax_find(x, n, dtype, m, nan, &at);
    if (i < 0) return at;
    for (; i < n; i++) {
        const float v = argmax_elem(x, i, dtype);
        if (nan ? v != v : v == m) return i;
    }
    return 0;
}

static void argmax_rows(const void *p, int64_t begin, int64_t end) {
    const ArgmaxArgs *a = (const ArgmaxArgs *)p;
    const int64_t n = a->n, size = a->dtype == 1 ? 2 : 4;
    for (int64_t r = begin; r < end; r++) {
        const void *x = (const char *)a->x + r * a->stride * size;
        float m = -INFINITY;
        int nan = 0;
        int64_t i = fused_argmax_scan(x, n, a->dtype, &m, &nan);
        for (; i < n; i++) {
            const float v = argmax_elem(x, i, a->dtype);
            nan |= v != v;
            m = v > m ? v : m;
        }
        a->out[r] = argmax_find(x, n, a->dtype, m, nan);
    }
}

void kvtier_argmax(const void *x, int64_t rows, int64_t n, int64_t stride, int64_t *out,
                   int dtype, int threads) {
    ArgmaxArgs a = {x, n, stride, out, dtype};
    parallel_rows(argmax_rows, &a, rows, rows * n, 1 << 19, threads);
}

/* ---- top-k and top-p filter (sampling) -------------------------------------------------------
 * Each float32 row keeps its best tokens in the order value descending, index ascending: the first
 * top_k of them, and of those the shortest prefix whose probability mass — softmax over the top-k
 * set — reaches top_p (a token is dropped when the mass of the tokens before it is ≥ top_p; never
 * the first). The others become -inf in place. The same kept sets as sorting each row
 * (sampler.py's `_cut`), except that ties are broken by index and the mass is summed in another
 * order (a cut within float32 rounding of top_p may fall one token apart). Without the sort: one
 * pass takes the exponentials and the count and mass of the tokens within 1, 2, 4 … 32 of the
 * row's maximum, which bounds where the cut can fall; the tokens above that bound (usually a
 * few hundred) are gathered in index order, and a radix select over their values'
 * order-preserving bits (11 + 11 + 10 bits a level) counts or sums them by digit, highest first,
 * keeping only the digit where the target is crossed, so the last level holds equal values in
 * index order and is walked as it lies. Rows holding a NaN, or only -inf, are left as they are. */

typedef struct {
    float *x;
    int64_t n, stride;    /* elements per row, elements between rows */
    const int64_t *top_k; /* [rows] or NULL; a value < 1 or ≥ n keeps every token */
    const float *top_p;   /* [rows] or NULL; a value ≥ 1 keeps every token */
    int status;           /* 0, or -1: out of memory (rows not filtered) */
} FilterArgs;


static inline uint32_t order_key(float f) { /* larger float, larger key */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

typedef struct { /* the last kept token: kept(i) ⇔ key > b.key, or key == b.key and i ≤ b.idx */
    uint32_t key, idx;
} Bound;

static inline int within(uint32_t key, uint32_t i, Bound b) {
    return key > b.key || (key == b.key && i <= b.idx);
}


/* The first of the c candidates (in index order, all above every other token), in the order of
 * the row and among those within `cap` (NULL: all), at which the running sum of the weights
 * (`count`: one a token, else w) reaches `target`; 0, or 1 if none reaches it. Reorders the
 * candidates' arrays. */
static int select_bound(FilterScratch *s, int64_t c, const Bound *cap, int count, double target,
                        Bound *out) {
    static const int shift[3] = {21, 10, 0}, mask[3] = {DIGITS - 1, DIGITS - 1, 1023};
    double hist[DIGITS], base = 0.0;
    if (cap) { /* keep the candidates within the cap, in order */
        int64_t kept = 0;
        for (int64_t j = 0; j < c; j++)
            if (within(s->key[j], s->idx[j], *cap)) {
                s->key[kept] = s->key[j];
                s->idx[kept] = s->idx[j];
                s->w[kept++] = s->w[j];
            }
        c = kept;
    }
    for (int level = 0; level < 3; level++) {
        memset(hist, 0, sizeof hist);
        if (c > 256) { /* four histograms: neighbours often share a digit, and one chain of
                        * read-add-write through the same slot would wait on each store */
            double (*h4)[DIGITS] = s->hist4;
            memset(h4, 0, 4 * sizeof *h4);
            for (int64_t j = 0; j < c; j++)
                h4[j & 3][(s->key[j] >> shift[level]) & (uint32_t)mask[level]] +=
                    count ? 1.0 : (double)s->w[j];
            for (int q = 0; q < 4; q++)
                for (int d = 0; d < DIGITS; d++) hist[d] += h4[q][d];
        } else {
            for (int64_t j = 0; j < c; j++)
                hist[(s->key[j] >> shift[level]) & (uint32_t)mask[level]] +=
                    count ? 1.0 : (double)s->w[j];
        }
        int digit = mask[level];
        double cum = base;
        for (; digit >= 0; digit--) { /* the first digit holding tokens that reaches it */
            if (hist[digit] > 0.0 && cum + hist[digit] >= target) break;
            cum += hist[digit];
        }
        if (digit < 0) return 1;
        base = cum;
        int64_t kept = 0; /* the digit's candidates, in index order */
        for (int64_t j = 0; j < c; j++)
            if (((s->key[j] >> shift[level]) & (uint32_t)mask[level]) == (uint32_t)digit) {
                s->key[kept] = s->key[j];
                s->idx[kept] = s->idx[j];
                s->w[kept++] = s->w[j];
            }
        c = kept;
    }
    double cum = base; /* one value left, its tokens in index order */
    for (int64_t j = 0; j < c; j++) {
        cum += count ? 1.0 : (double)s->w[j];
        if (cum >= target) {
            out->key = s->key[j];
            out->idx = s->idx[j];
            return 0;
        }
    }
    return 1;
}

/* The tokens ≥ floor into the scratch, in index order, with their exponentials (e: NULL, ones);
 * returns how many. */
static int64_t gather(const float *x, const float *e, int64_t n, float floor, FilterScratch *s) {
    int64_t c = 0, i = fused_gather(x, e, n, floor, s, &c);
    for (; i < n; i++)
        if (x[i] >= floor) {
            s->key[c] = order_key(x[i]);
            s->idx[c] = (uint32_t)i;
            s->w[c++] = e ? e[i] : 1.0f;
        }
    return c;
}

/* a float32 row's maximum, and in *nan whether it holds a NaN (the filter and the draw leave
 * such a row to its argmax) */
static float row_max(const float *x, int64_t n, int *nan) {
    float m = -INFINITY;
    int any = 0;
#pragma omp simd reduction(max : m) reduction(| : any)
    for (int64_t i = 0; i < n; i++) {
        any |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    *nan = any;
    return m;
}

static void filter_row(float *x, int64_t n, int64_t k, float p, FilterScratch *s) {
    int nan;
    const float m = row_max(x, n, &nan);
    if (nan || m == -INFINITY) return;
    const int use_k = k >= 1 && k < n, use_p = p < 1.0f && m != INFINITY;
    if (!use_k && !use_p) return;
    /* count and mass within 2^j of the maximum; the exponentials for top-p (0 below -87.3) */
    float reach[REACHES], count[REACHES] = {0}, vmass[REACHES] = {0}, vz = 0.0f;
    for (int j = 0; j < REACHES; j++) reach[j] = m - (float)(1 << j);
    float *e = s->e;
    int64_t i = fused_reaches(x, n, m, use_p, reach, count, vmass, e, &vz);
    /* the rest of the row (all of it without a vector path) summed in double: one float32 sum
     * over a 32,000-token row drifts by ~1e-4 of its total, which moves a cut at top_p 0.999 by
     * a hundred tokens (the vector path's 16 partial sums stay within float32 rounding) */
    double z = vz, mass[REACHES];
    for (int j = 0; j < REACHES; j++) mass[j] = vmass[j];
    for (; i < n; i++) {
        const float ei = use_p ? exp_approx(x[i] - m) : 0.0f;
        if (use_p) e[i] = ei;
        z += ei;
        for (int j = 0; j < REACHES; j++)
            if (x[i] >= reach[j]) {
                count[j] += 1.0f;
                mass[j] += ei;
            }
    }
    /* the candidates: within the nearest reach that holds the top-k set (else, for top-p only,
     * the mass top_p needs: float sums, so with a margin), or every token */
    float floor = -INFINITY;
    for (int j = 0; j < REACHES; j++)
        if (use_k ? count[j] >= (float)k : mass[j] >= 1.001 * p * z) {
            floor = reach[j];
            break;
        }
    Bound bk, bp;
    const Bound *bound = NULL;
    if (use_k && select_bound(s, gather(x, NULL, n, floor, s), NULL, 1, (double)k, &bk) == 0)
        bound = &bk;
    if (use_p) {
        /* the softmax's sum: over the top-k set (among the candidates), else the row */
        int64_t c = gather(x, e, n, floor, s);
        double zk = bound ? 0.0 : z;
        if (bound)
            for (int64_t j = 0; j < c; j++)
                if (within(s->key[j], s->idx[j], *bound)) zk += s->w[j];
        /* the float sums that placed the floor may fall short of the select's: then all */
        int missed = select_bound(s, c, bound, 0, (double)p * zk, &bp);
        if (missed && floor > -INFINITY) {
            c = gather(x, e, n, -INFINITY, s);
            missed = select_bound(s, c, bound, 0, (double)p * zk, &bp);
        }
        if (!missed) bound = &bp;
    }
    if (!bound) return;
    /* drop the rest: up to the bound's index a smaller key, past it a key not larger */
    const uint32_t bkey = bound->key;
    const int64_t split = (int64_t)bound->idx + 1;
#pragma omp simd
    for (int64_t i = 0; i < split; i++)
        if (order_key(x[i]) < bkey) x[i] = -INFINITY;
#pragma omp simd
    for (int64_t i = split; i < n; i++)
        if (order_key(x[i]) <= bkey) x[i] = -INFINITY;
}

/* A thread's scratch, kept between calls (fresh pages for every call cost more than the
 * select) and grown when a row is longer; never freed: the threads that sample (the kernel
 * pool's helpers, the engine's worker) live as long as the process, and a thread that exits
 * leaves its last scratch behind (a vocabulary's worth, ~0.6 MB at 32,000 tokens). */
static __thread char *filter_mem;
static __thread size_t filter_mem_size;

static void filter_rows(const void *p, int64_t begin, int64_t end) {
    FilterArgs *a = (FilterArgs *)p;
    const int64_t n = a->n;
    const size_t need = 4 * DIGITS * sizeof(double) + (size_t)n * 4 * sizeof(uint32_t);
    if (filter_mem_size < need) {
        free(filter_mem);
        filter_mem = malloc(need);
        filter_mem_size = filter_mem ? need : 0;
        if (!filter_mem) {
            a->status = -1;
            return;
        }
    }
    FilterScratch s;
    s.hist4 = (double (*)[DIGITS])filter_mem;
    s.key = (uint32_t *)(filter_mem + 4 * DIGITS * sizeof(double));
    s.idx = s.key + n;
    s.w = (float *)(s.idx + n);
    s.e = s.w + n;
    for (int64_t r = begin; r < end; r++)
        filter_row(a->x + r * a->stride, n, a->top_k ? a->top_k[r] : 0,
                   a->top_p ? a->top_p[r] : 1.0f, &s);
}

/* x [rows, n] float32, rows `stride` elements apart, filtered in place. Returns 0, or -1 when a
 * thread's scratch could not be allocated (then some rows may be left unfiltered). */
int kvtier_top_k_top_p(float *x, int64_t rows, int64_t n, int64_t stride, const int64_t *top_k,
                       const float *top_p, int threads) {
    FilterArgs a = {x, n, stride, top_k, top_p, 0};
    parallel_rows(filter_rows, &a, rows, rows * n, 1 << 16, threads);
    return a.status;
}

/* ---- the random draw (sampling) --------------------------------------------------------------
 * Each float32 row of processed logits (temperature applied, filtered tokens -inf) draws, for its
 * uniform u in (0, 1], the first token at which the running sum of exp(x - max) reaches u times
 * the row's sum: sampler.py's inverse CDF over the softmax, without writing the softmax, its
 * cumulative sum or a search over it (three passes over the row, one of them sequential). Here
 * one pass takes the maximum, one the sums of blocks of tokens (each block's a vector sum, the
 * blocks added in double), and the walk adds block sums up to the block where the target falls,
 * then that block's tokens one by one (a walk that ends past the block — its sum token by token
 * rounds below its vector sum — goes on, and at the row's end takes its last token with any
 * weight). A row holding a NaN or +inf, or only -inf, has no distribution: it draws its argmax,
 * torch's answer (the first NaN, else the first maximum). A row's draw depends on its values
 * and u alone, never on its batch or the threads. */

#define DRAW_BLOCKS 1024 /* block sums a row keeps; blocks grow past 512 tokens to fit */

typedef struct {
    const float *x;
    int64_t n, stride;
    const float *u;
    int64_t *out;
} DrawArgs;

static float draw_block_sum(const float *x, int64_t len, float m) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < len; i++) s += exp_approx(x[i] - m);
    return s;
}

static int64_t draw_row(const float *x, int64_t n, float u) {
    int nan;
    const float m = row_max(x, n, &nan);
    if (nan || m == INFINITY || m == -INFINITY) /* no distribution */
        return argmax_find(x, n, 0, m, nan);
    int64_t block = (n + DRAW_BLOCKS - 1) / DRAW_BLOCKS;
    block = block < 512 ? 512 : (block + 15) / 16 * 16;
    const int64_t blocks = (n + block - 1) / block;
    float sums[DRAW_BLOCKS];
    double z = 0.0;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t begin = b * block, len = begin + block < n ? block : n - begin;
        sums[b] = draw_block_sum(x + begin, len, m);
        z += sums[b];
    }
    const double target = (double)u * z; /* > 0: the maximum weighs 1 */
    double cum = 0.0;
    int64_t b = 0;
    while (b < blocks - 1 && cum + sums[b] < target) cum += sums[b++];
    int64_t last = -1;
    for (int64_t i = b * block; i < n; i++) {
        const float e = exp_approx(x[i] - m);
        if (e > 0.0f) last = i;
        cum += e;
        if (cum >= target && e > 0.0f) return i;
    }
    return last;
}

static void draw_rows(const void *p, int64_t begin, int64_t end) {
    const DrawArgs *a = (const DrawArgs *)p;
    for (int64_t r = begin; r < end; r++) a->out[r] = draw_row(a->x + r * a->stride, a->n, a->u[r]);
}

void kvtier_draw(const float *x, int64_t rows, int64_t n, int64_t stride, const float *u,
                 int64_t *out, int threads) {
    DrawArgs a = {x, n, stride, u, out};
    parallel_rows(draw_rows, &a, rows, rows * n, 1 << 16, threads);
}
