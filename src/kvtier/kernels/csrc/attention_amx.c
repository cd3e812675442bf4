/* The paged attention's decode and short drafts on AMX tiles (attention.c dispatches;
 * docs/architecture.md §Kernels): a work item's query rows (≤ 16, its queries × the group)
 * are the 16 columns of every tile product, so the keys go into tiles as they lie in the cache —
 * no transpose of the keys, which with its multiply-adds was the pairs path's cost.
 *   scores^T [16 keys, 16 rows] = K [16 keys, 32 dims] · Q^T, the keys tile-loaded from the
 *            cache where they lie (a row stride of every KV head), Q^T built once per item;
 *   softmax  per row = per lane: the max and the sum are lane-wise over key vectors, no
 *            reduction across lanes; the probabilities are transposed back per chunk and rounded
 *            to bfloat16 (as the pairs path and transformers' eager attention do);
 *   out [16 rows, D] += P [16 rows, 32 keys] · V, the values re-laid as pairs of keys per
 *            dimension (the B operand's layout), accumulated in tiles over a segment.
 * Two passes per segment of up to AMX_SEG chunks, like attend_pairs. */
#include "attention.h"

#if defined(KVTIER_AMX)
#include "amx.h"
#include "vec512.h"

#define AMX_SEG 16

typedef struct { /* attend_amx's buffers, one per work item's thread */
    uint32_t *bq;     /* [D / 32][16 pairs][16 rows] the queries as B tiles */
    float *scores;    /* [AMX_SEG][16][16]: a chunk's scores tile, then its rows' scores */
    __mmask16 *valid; /* [16 rows][AMX_SEG] keys each row reads in each chunk */
    uint16_t *pt;     /* [AMX_SEG / 2][16 rows][32 keys] probabilities as A tiles */
    uint16_t *vt;     /* [AMX_SEG / 2][D / 16][16 key pairs][16 dims × 2] values as B tiles */
    uint16_t *kb;     /* [16][D] a chunk's keys, where a tile load would read past its block */
    float *acc;       /* [16 rows][D] */
} AmxScratch;

/* Lays attend_amx's buffers out from p (64-byte aligned; NULL: lays nothing out) and returns
 * the bytes they take. */
static size_t amx_scratch(char *p, int64_t D, AmxScratch *s) {
    size_t at = 0;
#define TAKE(field, bytes) \
    (p ? (void)(s->field = (void *)(p + at)) : (void)0, at += (((size_t)(bytes)) + 63) / 64 * 64)
    TAKE(bq, sizeof(uint32_t) * (size_t)(D / 32) * 256);
    TAKE(scores, sizeof(float) * AMX_SEG * 256);
    TAKE(valid, sizeof(__mmask16) * AMX_SEG * 16);
    TAKE(pt, 2 * (size_t)(AMX_SEG / 2) * 512);
    TAKE(vt, 2 * (size_t)(AMX_SEG / 2) * (D / 16) * 512);
    TAKE(kb, 2 * 16 * (size_t)D);
    TAKE(acc, sizeof(float) * 16 * (size_t)D);
#undef TAKE
    return at;
}

/* 32 elements of the cache (bfloat16, or fp8 codes converted) at element `at` as bfloat16 */
static inline __m512i amx_load32(const void *cache, int64_t at, int kv_dtype) {
    if (kv_dtype == KV_BF16) return _mm512_loadu_si512((const uint16_t *)cache + at);
    return fp8x32_bf16((const uint8_t *)cache + at, kv_dtype);
}

/* A chunk's values as rows of its P · V block's B tiles: the rows of key pairs (2jp, 2jp + 1),
 * jp < 8, of each 16 dimensions' tile (vt: the chunk's first row in the first tile; tiles 512
 * words apart), dimension by dimension the two keys' values; keys from cn on are zeros (a chunk
 * past the keys, cn 0, reads nothing). */
static inline void amx_values(const void *cache, int64_t vh, int kv_dtype, int64_t row_size,
                              int64_t cn, int64_t KB, uint16_t *vt) {
    const __m512i lo = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003,
                                         0x00240004, 0x00250005, 0x00260006, 0x00270007,
                                         0x00280008, 0x00290009, 0x002a000a, 0x002b000b,
                                         0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16)); /* dims 16-31 */
    for (int64_t jp = 0; jp < 8; jp++) {
        const int64_t j = 2 * jp;
        for (int64_t b = 0; b < KB; b++) { /* 32 dimensions: two tiles' rows */
            const __m512i x = j < cn ? amx_load32(cache, vh + j * row_size + 32 * b, kv_dtype)
                                     : _mm512_setzero_si512();
            const __m512i y = j + 1 < cn
                                  ? amx_load32(cache, vh + (j + 1) * row_size + 32 * b, kv_dtype)
                                  : _mm512_setzero_si512();
            _mm512_store_si512(vt + (2 * b) * 512 + jp * 32, _mm512_permutex2var_epi16(x, lo, y));
            _mm512_store_si512(vt + (2 * b + 1) * 512 + jp * 32,
                               _mm512_permutex2var_epi16(x, hi, y));
        }
    }
}

/* Chunk nc's scores tile [16 keys][16 rows] (stored by attend_amx) becomes, in place, its first
 * `rows` rows' scores [rows][16 keys], scaled and soft-capped, with each row's valid keys. */
static inline void amx_rows(const Args *a, AmxScratch *s, int64_t nc, int64_t c0, int64_t cn,
                            int64_t rows, int64_t G, int64_t row0) {
    float *sc = s->scores + nc * 256;
    __m512 t[16];
    for (int64_t j = 0; j < 16; j++) t[j] = _mm512_load_ps(sc + j * 16);
    transpose16(t); /* t[r]: row r's scores of the chunk's keys */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t qi = r / G;
        const int64_t lo = a->lo[row0 + qi] > c0 ? a->lo[row0 + qi] - c0 : 0;
        const int64_t hi = a->hi[row0 + qi] < c0 + cn ? a->hi[row0 + qi] - c0 : cn;
        s->valid[r * AMX_SEG + nc] =
            lo < hi ? (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u)) : 0;
        __m512 x = _mm512_mul_ps(t[r], _mm512_set1_ps(a->scale));
        if (a->softcap > 0.0f) {
            float tmp[16];
            _mm512_storeu_ps(tmp, x);
            for (int j = 0; j < 16; j++) tmp[j] = a->softcap * tanhf(tmp[j] / a->softcap);
            x = _mm512_loadu_ps(tmp);
        }
        _mm512_store_ps(sc + r * 16, x);
    }
}

/* Scores^T of a chunk into tile C (tile registers are named in the instruction, so C is a
 * literal): K from src (rows `stride` bytes apart) in tiles 1 and 2 by turns, against Q^T in
 * tiles 4.., stored to sc. */
#define AMX_SCORES(C)                                                                              \
    do {                                                                                           \
        _tile_zero(C);                                                                             \
        _tile_loadd(1, src, stride);                                                               \
        _tile_dpbf16ps(C, 1, 4);                                                                   \
        if (KB > 1) {                                                                              \
            _tile_loadd(2, src + 32, stride);                                                      \
            _tile_dpbf16ps(C, 2, 5);                                                               \
        }                                                                                          \
        if (KB > 2) {                                                                              \
            _tile_loadd(1, src + 64, stride);                                                      \
            _tile_dpbf16ps(C, 1, 6);                                                               \
        }                                                                                          \
        if (KB > 3) {                                                                              \
            _tile_loadd(2, src + 96, stride);                                                      \
            _tile_dpbf16ps(C, 2, 7);                                                               \
        }                                                                                          \
        _tile_stored(C, sc, 64);                                                                   \
    } while (0)

/* One KV head of one sequence over its keys [kmin, kmax) for rows = nq × G ≤ 16 query rows
 * (ordered (query, g); q[row] points at each): writes the rows' unnormalized outputs to s->acc
 * [16][D] and their softmax sums to l [16]. */
static void attend_amx(const Args *a, const uint16_t *const *q, int64_t nq, int64_t G,
                       int64_t row0, const int64_t *table, int64_t h, int64_t kmin, int64_t kmax,
                       AmxScratch *s, float *l) {
    const int64_t D = a->head_dim, bs = a->block_size, row_size = a->kv_heads * D;
    const int64_t rows = nq * G, KB = D / 32, DB = D / 16;
    /* Columns of Q^T past `rows`, rows of P past `rows` and so those score columns and output
     * rows hold whatever was there: a product's row or column depends on its operands' alone,
     * and none of those is read */
    for (int64_t r = 0; r < rows; r++)
        for (int64_t p = 0; p < D / 2; p++) {
            uint32_t pair;
            memcpy(&pair, q[r] + 2 * p, 4);
            s->bq[(p / 16) * 256 + (p % 16) * 16 + r] = pair;
        }
    float m[16];
    for (int64_t r = 0; r < 16; r++) m[r] = -INFINITY, l[r] = 0.0f;
    memset(s->acc, 0, sizeof(float) * (size_t)(rows * D));
    int64_t ahead = kmin;
    for (int64_t i = 0; i < AHEAD && ahead < kmax; i++)
        ahead = prefetch_pairs(a, table, h, ahead, kmax, TO_L1);
    for (int64_t seg0 = kmin; seg0 < kmax;) {
        /* every chunk of the segment: its scores, transposed to one row per query row; its
         * values as B tiles */
        _tile_loadd(4, s->bq, 64);
        if (KB > 1) _tile_loadd(5, s->bq + 256, 64);
        if (KB > 2) _tile_loadd(6, s->bq + 512, 64);
        if (KB > 3) _tile_loadd(7, s->bq + 768, 64);
        int64_t nc = 0, c0 = seg0, c0s[AMX_SEG], cns[AMX_SEG];
        for (; c0 < kmax && nc < AMX_SEG; nc++) {
            const int64_t cn = chunk_len(c0, kmax, bs);
            const int64_t kbase = key_row(a, table, c0);
            if (ahead < kmax) ahead = prefetch_pairs(a, table, h, ahead, kmax, TO_L1);
            const int64_t kh = kbase + h * D;
            const uint16_t *src = (const uint16_t *)a->cache + kh;
            int64_t stride = row_size * 2;
            if (a->kv_dtype != KV_BF16) { /* fp8 codes: the chunk's keys as bfloat16 first */
                for (int64_t j = 0; j < cn; j++)
                    for (int64_t d = 0; d < D; d += 32)
                        _mm512_storeu_si512(s->kb + j * D + d,
                                            fp8x32_bf16((const uint8_t *)a->cache + kh +
                                                            j * row_size + d, a->kv_dtype));
                src = s->kb, stride = 2 * D;
            } else if (c0 % bs + 16 > bs) { /* the tile's 16 rows would leave the block's keys */
                for (int64_t j = 0; j < cn; j++)
                    memcpy(s->kb + j * D, src + j * row_size, 2 * (size_t)D);
                src = s->kb, stride = 2 * D;
            }
            float *sc = s->scores + nc * 256;
            if (nc % 2 == 0) /* two score tiles in turn: a chunk's product need not wait for
                                the previous chunk's store */
                AMX_SCORES(0);
            else
                AMX_SCORES(3);
            uint16_t *vt = s->vt + (nc / 2) * DB * 512 + (nc % 2) * 8 * 32;
            amx_values(a->cache, kh + bs * row_size, a->kv_dtype, row_size, cn, KB, vt);
            if (nc > 0) /* the previous chunk's scores, its tile stored by now */
                amx_rows(a, s, nc - 1, c0s[nc - 1], cns[nc - 1], rows, G, row0);
            c0s[nc] = c0, cns[nc] = cn;
            c0 += cn;
        }
        amx_rows(a, s, nc - 1, c0s[nc - 1], cns[nc - 1], rows, G, row0);
        if (nc % 2) { /* a P · V block takes two chunks: the last one's partner has no keys */
            amx_values(NULL, 0, KV_BF16, 0, 0, KB, s->vt + (nc / 2) * DB * 512 + 8 * 32);
            for (int64_t r = 0; r < rows; r++) s->valid[r * AMX_SEG + nc] = 0;
        }
        for (int64_t r = 0; r < rows; r++) { /* max, exponentials and sum of the segment */
            const __mmask16 *vr = s->valid + r * AMX_SEG;
            __m512 vmax = _mm512_set1_ps(-INFINITY);
            for (int64_t c = 0; c < nc; c++)
                vmax = _mm512_mask_max_ps(vmax, vr[c], vmax,
                                          _mm512_load_ps(s->scores + c * 256 + r * 16));
            const __m512 mx = _mm512_set1_ps(
                raise_max(_mm512_reduce_max_ps(vmax), D, m + r, l + r, s->acc + r * D));
            __m512 sum = _mm512_setzero_ps();
            for (int64_t c = 0; c < nc + nc % 2; c++) {
                const __m512 e = _mm512_maskz_mov_ps(
                    vr[c], exp_nonpositive(
                               _mm512_sub_ps(_mm512_load_ps(s->scores + c * 256 + r * 16), mx)));
                sum = _mm512_add_ps(sum, e);
                const __m256bh eb = _mm512_cvtneps_pbh(e);
                memcpy(s->pt + (c / 2) * 512 + r * 32 + (c % 2) * 16, &eb, sizeof(eb));
            }
            l[r] += _mm512_reduce_add_ps(sum);
        }
        /* out += P · V, four tiles of 16 dimensions at a time */
        const int64_t nb = (nc + 1) / 2;
        for (int64_t dg = 0; dg < DB; dg += 4) {
            const int64_t tiles = DB - dg < 4 ? DB - dg : 4;
            float *acc = s->acc + dg * 16;
            const int64_t acc_stride = 4 * D;
            _tile_loadd(4, acc, acc_stride);
            if (tiles > 1) _tile_loadd(5, acc + 16, acc_stride);
            if (tiles > 2) _tile_loadd(6, acc + 32, acc_stride);
            if (tiles > 3) _tile_loadd(7, acc + 48, acc_stride);
            for (int64_t b = 0; b < nb; b++) {
                const uint16_t *vt = s->vt + (b * DB + dg) * 512;
                _tile_loadd(0, s->pt + b * 512, 64);
                _tile_loadd(1, vt, 64);
                _tile_dpbf16ps(4, 0, 1);
                if (tiles > 1) {
                    _tile_loadd(2, vt + 512, 64);
                    _tile_dpbf16ps(5, 0, 2);
                }
                if (tiles > 2) {
                    _tile_loadd(3, vt + 1024, 64);
                    _tile_dpbf16ps(6, 0, 3);
                }
                if (tiles > 3) {
                    _tile_loadd(1, vt + 1536, 64);
                    _tile_dpbf16ps(7, 0, 1);
                }
            }
            _tile_stored(4, acc, acc_stride);
            if (tiles > 1) _tile_stored(5, acc + 16, acc_stride);
            if (tiles > 2) _tile_stored(6, acc + 32, acc_stride);
            if (tiles > 3) _tile_stored(7, acc + 48, acc_stride);
        }
        seg0 = c0;
    }
}

/* A row of the output: acc × inv rounded to bfloat16 (f32_to_bf16's bits), natural order */
static void store_row(const float *acc, float inv, int64_t D, uint16_t *dst) {
    for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256((__m256i *)(dst + d),
                            bf16_round_16(_mm512_mul_ps(_mm512_load_ps(acc + d), _mm512_set1_ps(inv))));
}

int attention_amx_granted(void) { return amx_granted(); }

size_t attention_amx_scratch(int64_t D) {
    AmxScratch s;
    return amx_scratch(NULL, D, &s);
}

void attention_amx_begin(void) {
    static const uint8_t tiles[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    amx_configure(tiles);
}

void attention_amx_end(void) { _tile_release(); }

void attention_amx(const Args *a, const Item *it, char *scratch) {
    const int64_t D = a->head_dim, G = it->G, rows = it->nq * G;
    AmxScratch s;
    amx_scratch(scratch, D, &s);
    const uint16_t *q[rows];
    item_queries(a, it, q);
    float sums[16];
    attend_amx(a, q, it->nq, G, it->row0, it->table, it->h, it->kmin, it->kmax, &s, sums);
    for (int64_t r = 0; r < rows; r++) {
        const int64_t o = ((it->tok0 + r / G) * a->num_heads + it->h * G + r % G) * D;
        store_row(s.acc + r * D, (sums[r] > 0.0f ? 1.0f / sums[r] : 0.0f) * a->v_scale, D,
                  (uint16_t *)a->out + o);
    }
}
#endif
