/*
 * Paged attention on the CPU, reading K/V straight out of the paged cache through each row's
 * block table (no gather copy). A row attends to positions 0 .. length-1 of its sequence: a
 * decode row is one sequence's newest position; the rows of a prefill chunk are several rows
 * sharing one table (`row_tables` maps a row to its table) with lengths start+1, start+2, ...
 * so causality is just each row's length. With a sliding window W (> 0) a row attends only to
 * positions length-W .. length-1: blocks wholly before them are never read. With a soft cap C
 * (> 0) each score s becomes C tanh(s / C) before the softmax (Gemma 2).
 *
 * Cache layout of one layer: [2][kv_heads][num_blocks][block_size][head_dim] (K then V), so the
 * positions of one head inside a block are contiguous. The `group` query heads that share a KV
 * head are handled together. Work is split over (tile, KV head) pairs with OpenMP, where a tile
 * is a run of up to TILE_ROWS consecutive rows of one prefill chunk and a decode row is a tile
 * of one: each K/V block is read once for all of a tile's rows, while it is in cache.
 *
 * Compiled at first use with the system C compiler (-O3 -march=native -fopenmp). libgomp is
 * resolved by soname, so the process's already-loaded OpenMP runtime (torch's) is the one used.
 */
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "attention.h"

#define MAX_GROUP 16
#define TILE_ROWS 16
#define NOINLINE __attribute__((noinline))

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1

/* The sums of 16 vectors' lanes, x[i] the vector of key (i % 4) * 4 + i / 4: lane j of the
 * result is key j's. Each key's 16 lanes are added in _mm512_reduce_add_ps's order (lanes 8
 * apart, then 4, 2, 1: ((x0 + x8) + (x4 + x12)) ... as GCC's reduction), the keys transposed
 * into the lanes on the way: 45 instructions for 16 keys instead of a reduction each. */
static inline __attribute__((always_inline)) __m512 sums_of_16(const __m512 x[16]) {
    __m512 t[8], u[4], v[2];
    for (int j = 0; j < 8; j++) /* lanes i + 8: x[2j] in the low 256 bits, x[2j+1] the high */
        t[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * j], x[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(x[2 * j], x[2 * j + 1], 0xEE));
    for (int m = 0; m < 4; m++) /* lanes i + 4: one vector's 4 in each 128-bit lane */
        u[m] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * m], t[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * m], t[2 * m + 1], 0xDD));
    for (int n = 0; n < 2; n++) { /* lanes i + 2: two vectors' 2 in each 128-bit lane */
        const __m512d lo = _mm512_castps_pd(u[2 * n]), hi = _mm512_castps_pd(u[2 * n + 1]);
        v[n] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
    }
    /* lanes i + 1 */
    return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
}

/* The scores of one query row q against keys k[0..m) (m <= 16), stored at out[0..m). */
static inline __attribute__((always_inline)) void bf16_scores_16(const uint16_t *q,
                                                                 const uint16_t *k, int m, int hd,
                                                                 __m512 scales, float *out) {
    __m512 x[16];
    _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++) {
        const int key = (i % 4) * 4 + i / 4;
        x[i] = _mm512_setzero_ps();
        if (key < m)
            _Pragma("GCC unroll 4") for (int d = 0; d < hd; d += 32) x[i] = _mm512_dpbf16_ps(
                x[i], (__m512bh)_mm512_loadu_si512(k + key * hd + d),
                (__m512bh)_mm512_loadu_si512(q + d));
    }
    const __m512 s = _mm512_mul_ps(sums_of_16(x), scales);
    if (m == 16)
        _mm512_storeu_ps(out, s);
    else
        _mm512_mask_storeu_ps(out, (__mmask16)((1u << m) - 1), s);
}

/* Scores of `group` bf16 query rows against `n` bf16 key rows of one block, with the CPU's
 * bf16 dot-product instruction: products are exact in float32 and summed in float32, as the
 * generic path does after converting, but without the conversion. Keys go 16 at a time, their
 * sums transposed into one vector (sums_of_16): the same floats as one reduction a key, in
 * about half the time (decode rows of the 1.5B's shape, 12 heads on 2 KV heads of 128, see
 * docs/benchmarks.md). HD is 64 or 128. */
static inline void bf16_block_scores(const void *q_rows, int64_t group, const void *keys,
                                     int64_t n, int hd, float scale, float *scores,
                                     int64_t stride) {
    const uint16_t *q = (const uint16_t *)q_rows, *k = (const uint16_t *)keys;
    const __m512 scales = _mm512_set1_ps(scale);
    int64_t o = 0;
    for (; o + 16 <= n; o += 16) /* whole groups: m a constant, the sums in registers */
        for (int64_t g = 0; g < group; g++)
            bf16_scores_16(q + g * hd, k + o * hd, 16, hd, scales, scores + g * stride + o);
    if (o < n)
        for (int64_t g = 0; g < group; g++)
            bf16_scores_16(q + g * hd, k + o * hd, (int)(n - o), hd, scales,
                           scores + g * stride + o);
}

/* acc[g][0:hd] += sum_o p[g][o] * v[o][0:hd] for G query heads, C vectors of 16 dimensions a
 * pass (G * C accumulators held in registers for the whole block); each value row's part is
 * converted to float once a pass. */
static inline __attribute__((always_inline)) void bf16_values_fixed(
    const float *probs, const int G, const int C, const uint16_t *v, int64_t n, int hd,
    float *acc, int64_t stride) {
    for (int base = 0; base < hd; base += 16 * C) {
        __m512 a[8][4];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < C; c++) a[g][c] = _mm512_loadu_ps(acc + g * hd + base + c * 16);
        for (int64_t o = 0; o < n; o++) {
            __m512 row[4];
            for (int c = 0; c < C; c++)
                row[c] = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(
                    (const __m256i *)(v + o * hd + base + c * 16)));
            for (int g = 0; g < G; g++) {
                const __m512 p = _mm512_set1_ps(probs[g * stride + o]);
                for (int c = 0; c < C; c++) a[g][c] = _mm512_fmadd_ps(p, row[c], a[g][c]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < C; c++) _mm512_storeu_ps(acc + g * hd + base + c * 16, a[g][c]);
    }
}

/* The group is a constant in each case, so the accumulators stay in registers: up to 6 heads
 * 64 dimensions a pass (24 accumulators), 7 or 8 heads 32. Returns 0 when the shape is not one
 * it handles (the caller then takes the generic loop). */
static inline int bf16_block_values(const float *probs, int64_t group, const void *values,
                                    int64_t n, int hd, float *acc, int64_t stride) {
    const uint16_t *v = (const uint16_t *)values;
    switch (group) {
    case 1: bf16_values_fixed(probs, 1, 4, v, n, hd, acc, stride); return 1;
    case 2: bf16_values_fixed(probs, 2, 4, v, n, hd, acc, stride); return 1;
    case 3: bf16_values_fixed(probs, 3, 4, v, n, hd, acc, stride); return 1;
    case 4: bf16_values_fixed(probs, 4, 4, v, n, hd, acc, stride); return 1;
    case 5: bf16_values_fixed(probs, 5, 4, v, n, hd, acc, stride); return 1;
    case 6: bf16_values_fixed(probs, 6, 4, v, n, hd, acc, stride); return 1;
    case 7: bf16_values_fixed(probs, 7, 2, v, n, hd, acc, stride); return 1;
    case 8: bf16_values_fixed(probs, 8, 2, v, n, hd, acc, stride); return 1;
    default: return 0;
    }
}
#else
#define HAVE_BF16_DOT 0
#endif

/* ---------------------------------------------------------------------------------------------
 * The float arithmetic: float32 caches, and bf16 ones where the CPU has no bf16 dot product.
 *
 * Every row is computed in one fixed arithmetic, whatever tile it is in: the same functions
 * (compiled once, never inlined) run for each (row, block), so a row's result depends only on
 * its query, its sequence's K/V and its length. A row alone equals, bit for bit, the same row
 * in a prefill chunk, and the block size does not matter. Tiles change only the loop order.
 *
 *   scores   s[g][j] = sum over d of qs[g][d] k[j][d], qs = q * scale: eight lanes (lane i
 *            takes d = i mod 8, fused multiply-adds in order of d), the lanes then added as
 *            ((0+1)+(2+3))+((4+5)+(6+7))
 *   softmax  over the row's own length: e_j = exp(s_j - max), summed in eight lanes (lane i
 *            takes j = i mod 8, in order) added as above; p_j = e_j * (1 / sum)
 *   values   out[g][d] = fma(p_j, v[j][d], out[g][d]) in order of j
 */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }

static inline __m256 load8_bf16(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* `v` as it is: the compiler may fold its load into the instruction that uses it */
static inline __m256 as_loaded(__m256 v) { return v; }

/* exp(x) for 8 lanes: exp_approx's polynomial (common.h), 2^n put in the exponent bits. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_floor_ps(
        _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
    const __m256i bits =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

/* Scores of G (a constant, <= 3) query rows against four keys at a time, each key's chunk
 * loaded once for the G rows; then each remaining key alone, in the same sums. */
#define DEFINE_BLOCK_SCORES(NAME, T, LOAD8, HOLD)                                                   \
    static inline __attribute__((always_inline)) void NAME##_rows(                               \
        const float *qs, const int G, int64_t hd, const T *keys, int64_t n, float *scores,        \
        int64_t stride) {                                                                         \
        const int64_t chunks = hd / 8;                                                            \
        int64_t j = 0;                                                                            \
        for (; j + 4 <= n; j += 4) {                                                              \
            __m256 acc[3][4];                                                                     \
            for (int g = 0; g < G; g++)                                                           \
                for (int k = 0; k < 4; k++) acc[g][k] = _mm256_setzero_ps();                      \
            for (int64_t c = 0; c < chunks; c++) {                                                \
                __m256 qv[3];                                                                     \
                for (int g = 0; g < G; g++)                                                       \
                    qv[g] = HOLD(_mm256_loadu_ps(qs + g * hd + 8 * c));                           \
                for (int k = 0; k < 4; k++) {                                                     \
                    const __m256 key = HOLD(LOAD8(keys + (j + k) * hd + 8 * c));                  \
                    for (int g = 0; g < G; g++)                                                   \
                        acc[g][k] = _mm256_fmadd_ps(qv[g], key, acc[g][k]);                       \
                }                                                                                 \
            }                                                                                     \
            for (int g = 0; g < G; g++) _mm_storeu_ps(scores + g * stride + j, lanes_sum4(acc[g])); \
        }                                                                                         \
        for (; j < n; j++)                                                                        \
            for (int g = 0; g < G; g++) {                                                         \
                __m256 acc = _mm256_setzero_ps();                                                 \
                for (int64_t c = 0; c < chunks; c++)                                              \
                    acc = _mm256_fmadd_ps(_mm256_loadu_ps(qs + g * hd + 8 * c),                   \
                                          LOAD8(keys + j * hd + 8 * c), acc);                     \
                scores[g * stride + j] = lanes_sum(acc);                                          \
            }                                                                                     \
    }                                                                                             \
    /* scores[g * stride + j] for the n (<= block) keys of one block, for the group's rows */     \
    static NOINLINE void NAME(const float *qs, int64_t group, int64_t hd, const T *keys,          \
                              int64_t n, float *scores, int64_t stride) {                         \
        for (int64_t g = 0; g < group; g += 3) {                                                  \
            const float *q = qs + g * hd;                                                         \
            float *s = scores + g * stride;                                                       \
            switch (group - g < 3 ? group - g : 3) {                                              \
            case 1: NAME##_rows(q, 1, hd, keys, n, s, stride); break;                             \
            case 2: NAME##_rows(q, 2, hd, keys, n, s, stride); break;                             \
            default: NAME##_rows(q, 3, hd, keys, n, s, stride); break;                            \
            }                                                                                     \
        }                                                                                         \
    }

/* acc[g][:] += probs[g * stride + j] * values[j][:] for the n keys of one block, j in order:
 * G (a constant, <= 3) rows and 32 dimensions at a time, each value chunk loaded once. */
#define DEFINE_BLOCK_VALUES(NAME, T, LOAD8, HOLD)                                                   \
    static inline __attribute__((always_inline)) void NAME##_rows(                               \
        const float *probs, const int G, int64_t stride, int64_t hd, const T *values, int64_t n,  \
        float *acc) {                                                                             \
        for (int64_t part = 0; part < hd; part += 32) {                                           \
            __m256 a[3][4];                                                                       \
            for (int g = 0; g < G; g++)                                                           \
                for (int c = 0; c < 4; c++) a[g][c] = _mm256_loadu_ps(acc + g * hd + part + 8 * c); \
            for (int64_t j = 0; j < n; j++) {                                                     \
                __m256 p[3];                                                                      \
                for (int g = 0; g < G; g++) p[g] = _mm256_broadcast_ss(probs + g * stride + j);   \
                for (int c = 0; c < 4; c++) {                                                     \
                    const __m256 v = HOLD(LOAD8(values + j * hd + part + 8 * c));                 \
                    for (int g = 0; g < G; g++) a[g][c] = _mm256_fmadd_ps(p[g], v, a[g][c]);      \
                }                                                                                 \
            }                                                                                     \
            for (int g = 0; g < G; g++)                                                           \
                for (int c = 0; c < 4; c++) _mm256_storeu_ps(acc + g * hd + part + 8 * c, a[g][c]); \
        }                                                                                         \
    }                                                                                             \
    static NOINLINE void NAME(const float *probs, int64_t group, int64_t stride, int64_t hd,      \
                              const T *values, int64_t n, float *acc) {                           \
        for (int64_t g = 0; g < group; g += 3) {                                                  \
            const float *p = probs + g * stride;                                                  \
            float *a = acc + g * hd;                                                              \
            switch (group - g < 3 ? group - g : 3) {                                              \
            case 1: NAME##_rows(p, 1, stride, hd, values, n, a); break;                           \
            case 2: NAME##_rows(p, 2, stride, hd, values, n, a); break;                           \
            default: NAME##_rows(p, 3, stride, hd, values, n, a); break;                          \
            }                                                                                     \
        }                                                                                         \
    }

/* In place, softmax of one row of scores (its buffer padded to a multiple of 8 floats). */
static NOINLINE void row_softmax(float *s, int64_t length) {
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= length; j += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(s + j));
    float lanes[8], top = -INFINITY;
    _mm256_storeu_ps(lanes, top8);
    for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
    for (; j < length; j++) top = s[j] > top ? s[j] : top;
    const __m256 t = _mm256_set1_ps(top), lane_index = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 total = _mm256_setzero_ps();
    for (j = 0; j < length; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), t));
        if (j + 8 > length)
            e = _mm256_and_ps(e, _mm256_cmp_ps(lane_index, _mm256_set1_ps((float)(length - j)),
                                               _CMP_LT_OQ));
        _mm256_storeu_ps(s + j, e);
        total = _mm256_add_ps(total, e);
    }
    const __m256 inverse = _mm256_set1_ps(1.f / lanes_sum(total));
    for (j = 0; j < length; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inverse));
}
#else
/* Without AVX2 and FMA: the same structure in plain loops, each sum in order. */
#define DEFINE_BLOCK_SCORES(NAME, T, LOAD, HOLD)                                                    \
    static NOINLINE void NAME(const float *qs, int64_t group, int64_t hd, const T *keys,          \
                              int64_t n, float *scores, int64_t stride) {                         \
        for (int64_t j = 0; j < n; j++)                                                           \
            for (int64_t g = 0; g < group; g++) {                                                 \
                float s = 0.f;                                                                    \
                for (int64_t d = 0; d < hd; d++) s += qs[g * hd + d] * LOAD(keys[j * hd + d]);    \
                scores[g * stride + j] = s;                                                       \
            }                                                                                     \
    }

#define DEFINE_BLOCK_VALUES(NAME, T, LOAD, HOLD)                                                    \
    static NOINLINE void NAME(const float *probs, int64_t group, int64_t stride, int64_t hd,      \
                              const T *values, int64_t n, float *acc) {                           \
        for (int64_t g = 0; g < group; g++)                                                       \
            for (int64_t j = 0; j < n; j++) {                                                     \
                const float p = probs[g * stride + j];                                            \
                for (int64_t d = 0; d < hd; d++) acc[g * hd + d] += p * LOAD(values[j * hd + d]); \
            }                                                                                     \
    }

static NOINLINE void row_softmax(float *s, int64_t length) {
    float top = -INFINITY, total = 0.f;
    for (int64_t j = 0; j < length; j++) top = s[j] > top ? s[j] : top;
    for (int64_t j = 0; j < length; j++) {
        s[j] = exp_approx(s[j] - top);
        total += s[j];
    }
    const float inverse = 1.f / total;
    for (int64_t j = 0; j < length; j++) s[j] *= inverse;
}
#define load8_f32 float_identity
#define load8_bf16 bf16_to_float
#endif

/* Each twice, in the same sums: for a tile of several rows, each chunk held in a register for
 * all the multiply-adds that use it; for a row alone (decode), where K and V come from memory
 * rather than from a block another row just read, with the loads left to the compiler, which
 * measured faster there. */
DEFINE_BLOCK_SCORES(block_scores_f32, float, load8_f32, in_register)
DEFINE_BLOCK_VALUES(block_values_f32, float, load8_f32, in_register)
DEFINE_BLOCK_SCORES(row_scores_f32, float, load8_f32, as_loaded)
DEFINE_BLOCK_VALUES(row_values_f32, float, load8_f32, as_loaded)
/* bf16 in float arithmetic: the path where the CPU has no bf16 dot product, and the one a
 * windowed or soft-capped layer takes where it has (the dot-product tiles know neither). */
DEFINE_BLOCK_SCORES(block_scores_bf16, uint16_t, load8_bf16, in_register)
DEFINE_BLOCK_VALUES(block_values_bf16, uint16_t, load8_bf16, in_register)
DEFINE_BLOCK_SCORES(row_scores_bf16, uint16_t, load8_bf16, as_loaded)
DEFINE_BLOCK_VALUES(row_values_bf16, uint16_t, load8_bf16, as_loaded)

/* The first position a row of `length` attends to under a window (0: none). */
static inline int64_t window_start(int64_t length, int64_t window) {
    return window > 0 && length > window ? length - window : 0;
}

/* In place, s[j] = cap * tanh(s[j] / cap) for one row of n scores: tanh(u) as
 * (e - 1) / (e + 1) with e = exp(2u) (exp_approx, clamped: |tanh| <= 1 at the ends), the same
 * operations for every row whatever its tile. */
static NOINLINE void row_softcap(float *s, int64_t n, float cap) {
    const float twice_inverse = 2.f / cap;
    _Pragma("omp simd") for (int64_t j = 0; j < n; j++) {
        const float e = exp_approx(s[j] * twice_inverse);
        s[j] = cap * ((e - 1.f) / (e + 1.f));
    }
}

/* Floats of working memory a tile of `rows` needs: scaled queries, sums, padded scores (of at
 * most `window` positions a row, where there is a window). */
static int64_t float_tile_floats(int64_t rows, int64_t group, int64_t hd, int64_t longest,
                                 int64_t window) {
    const int64_t span = window > 0 && window < longest ? window : longest;
    return 2 * rows * group * hd + rows * group * ((span + 7) / 8 * 8);
}

/* One tile (rows with lengths in increasing order, one table) against one KV head; a tile of
 * one row takes ROW_SCORES and ROW_VALUES, the same sums as SCORES and VALUES. Row r attends to
 * positions first[r] .. lengths[r] - 1 (first[r] = 0 without a window); its scores are kept by
 * position - first[r], so a row's arithmetic depends on its own span only. */
#define DEFINE_FLOAT_TILE(NAME, T, LOAD, STORE, SCORES, VALUES, ROW_SCORES, ROW_VALUES)             \
    static void NAME(const T *q, int64_t q_row_stride, T *out, int64_t out_row_stride,            \
                     const T *k_head, const T *v_head, const int64_t *table,                      \
                     const int64_t *lengths, int64_t rows, int64_t group, int64_t hd,             \
                     int64_t block_size, float scale, int64_t window, float softcap,              \
                     float *work) {                                                               \
        const int64_t per_row = group * hd, longest = lengths[rows - 1];                          \
        float *qs = work, *acc = work + rows * per_row, *scores[TILE_ROWS];                       \
        int64_t stride[TILE_ROWS], first[TILE_ROWS];                                              \
        float *next = acc + rows * per_row;                                                       \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            first[r] = window_start(lengths[r], window);                                          \
            stride[r] = (lengths[r] - first[r] + 7) / 8 * 8;                                      \
            scores[r] = next;                                                                     \
            next += group * stride[r];                                                            \
            for (int64_t i = 0; i < per_row; i++)                                                 \
                qs[r * per_row + i] = LOAD(q[r * q_row_stride + i]) * scale;                      \
        }                                                                                         \
        memset(acc, 0, sizeof(float) * rows * per_row);                                           \
        __typeof__(&SCORES) const scores_of = rows > 1 ? SCORES : ROW_SCORES;                     \
        __typeof__(&VALUES) const values_of = rows > 1 ? VALUES : ROW_VALUES;                     \
        const int64_t num_used = (longest + block_size - 1) / block_size;                         \
        for (int64_t b = first[0] / block_size; b < num_used; b++) {                              \
            const T *keys = k_head + table[b] * block_size * hd;                                  \
            for (int64_t r = rows - 1; r >= 0; r--) {                                             \
                const int64_t end = lengths[r] < (b + 1) * block_size ? lengths[r]                \
                                                                      : (b + 1) * block_size;     \
                const int64_t begin = first[r] > b * block_size ? first[r] : b * block_size;      \
                if (end <= b * block_size) break;                                                 \
                if (begin >= end) continue;                                                       \
                scores_of(qs + r * per_row, group, hd, keys + (begin - b * block_size) * hd,      \
                          end - begin, scores[r] + (begin - first[r]), stride[r]);                \
            }                                                                                     \
        }                                                                                         \
        for (int64_t r = 0; r < rows; r++)                                                        \
            for (int64_t g = 0; g < group; g++) {                                                 \
                if (softcap > 0.f)                                                                \
                    row_softcap(scores[r] + g * stride[r], lengths[r] - first[r], softcap);       \
                row_softmax(scores[r] + g * stride[r], lengths[r] - first[r]);                    \
            }                                                                                     \
        for (int64_t b = first[0] / block_size; b < num_used; b++) {                              \
            const T *values = v_head + table[b] * block_size * hd;                                \
            for (int64_t r = rows - 1; r >= 0; r--) {                                             \
                const int64_t end = lengths[r] < (b + 1) * block_size ? lengths[r]                \
                                                                      : (b + 1) * block_size;     \
                const int64_t begin = first[r] > b * block_size ? first[r] : b * block_size;      \
                if (end <= b * block_size) break;                                                 \
                if (begin >= end) continue;                                                       \
                values_of(scores[r] + (begin - first[r]), group, stride[r], hd,                   \
                          values + (begin - b * block_size) * hd, end - begin, acc + r * per_row); \
            }                                                                                     \
        }                                                                                         \
        for (int64_t r = 0; r < rows; r++)                                                        \
            for (int64_t i = 0; i < per_row; i++)                                                 \
                out[r * out_row_stride + i] = STORE(acc[r * per_row + i]);                        \
    }

DEFINE_FLOAT_TILE(float_tile_f32, float, float_identity, float_identity, block_scores_f32,
                  block_values_f32, row_scores_f32, row_values_f32)
DEFINE_FLOAT_TILE(float_tile_bf16, uint16_t, bf16_to_float, float_to_bf16, block_scores_bf16,
                  block_values_bf16, row_scores_bf16, row_values_bf16)

#if HAVE_BF16_DOT
/* One decode row against one KV head, head_dim fixed at compile time so the inner loops
 * vectorize; bf16 scores by the CPU's bf16 dot product, values (groups of up to 8 query heads)
 * with the accumulators in registers. */
#define DEFINE_TASK(NAME, T, LOAD, STORE, HD, BF16_DOT)                                             \
    static void NAME(const T *q, T *out, const T *k_head, const T *v_head, const int64_t *table,   \
                     int64_t length, int64_t group, int64_t block_size, float scale,              \
                     float *scores) {                                                             \
        float qf[MAX_GROUP][HD], acc[MAX_GROUP][HD], row[HD];                                     \
        for (int64_t g = 0; g < group; g++) {                                                     \
            for (int d = 0; d < HD; d++) qf[g][d] = LOAD(q[g * HD + d]) * scale;                  \
            memset(acc[g], 0, sizeof(acc[g]));                                                    \
        }                                                                                         \
        const int64_t num_used = (length + block_size - 1) / block_size;                          \
        for (int64_t b = 0; b < num_used; b++) {                                                  \
            const T *base = k_head + table[b] * block_size * HD;                                  \
            const int64_t n = length - b * block_size < block_size ? length - b * block_size      \
                                                                   : block_size;                  \
            if (BF16_DOT) {                                                                       \
                bf16_block_scores(q, group, base, n, HD, scale, scores + b * block_size, length); \
                continue;                                                                         \
            }                                                                                     \
            for (int64_t o = 0; o < n; o++) {                                                     \
                const T *k = base + o * HD;                                                       \
                _Pragma("omp simd") for (int d = 0; d < HD; d++) row[d] = LOAD(k[d]);             \
                for (int64_t g = 0; g < group; g++) {                                             \
                    float s = 0.f;                                                                \
                    _Pragma("omp simd reduction(+ : s)") for (int d = 0; d < HD; d++) s +=        \
                        qf[g][d] * row[d];                                                        \
                    scores[g * length + b * block_size + o] = s;                                  \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        softmax_rows(scores, group, length);                                                      \
        for (int64_t b = 0; b < num_used; b++) {                                                  \
            const T *base = v_head + table[b] * block_size * HD;                                  \
            const int64_t n = length - b * block_size < block_size ? length - b * block_size      \
                                                                   : block_size;                  \
            if (BF16_DOT && bf16_block_values(scores + b * block_size, group, base, n, HD,         \
                                              &acc[0][0], length))                                \
                continue;                                                                         \
            for (int64_t o = 0; o < n; o++) {                                                     \
                const T *v = base + o * HD;                                                       \
                _Pragma("omp simd") for (int d = 0; d < HD; d++) row[d] = LOAD(v[d]);             \
                for (int64_t g = 0; g < group; g++) {                                             \
                    const float p = scores[g * length + b * block_size + o];                      \
                    _Pragma("omp simd") for (int d = 0; d < HD; d++) acc[g][d] += p * row[d];     \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int64_t g = 0; g < group; g++)                                                       \
            for (int d = 0; d < HD; d++) out[g * HD + d] = STORE(acc[g][d]);                      \
    }


DEFINE_TASK(task_bf16_64, uint16_t, bf16_to_float, float_to_bf16, 64, 1)
DEFINE_TASK(task_bf16_128, uint16_t, bf16_to_float, float_to_bf16, 128, 1)

/*
 * Consecutive rows of one prefill chunk (one table, lengths growing by one), up to TILE_ROWS
 * of them, against one KV head: the tile's R * group query rows are worked on together, laid
 * out across vector lanes, so that one bf16 dot product per (key, pair of dimensions) scores 16
 * query rows at once and no horizontal sums are needed.
 *
 *   scores   s[key][row] = sum_p q[row][p] . k[key][p] over dimension pairs p (q transposed
 *            once per tile; each key's pairs broadcast), four keys at a time
 *   softmax  per row over its own length (masked by lane), done across lanes
 *   values   out[row] = sum_key s[key][row] * v[key] with V converted to float once per tile,
 *            four query rows and 64 dimensions at a time (16 sums in registers, each value
 *            row loaded once for the four), then divided by each row's sum
 *
 * Measured (the 1.5B's shape, 12 heads on 2 KV heads of 128, 2 threads, AMD Zen 4): a prefill
 * chunk of 512 rows after 1,536 positions 28.7 -> 22.5 ms a layer, at position 0 4.2 -> 3.4,
 * the same bits (the value rows had been loaded again for each query row, and the counts of
 * keys and vectors tested inside the loops).
 *
 * The probabilities and sums are float32 as in the row-at-a-time task; only the order of the
 * additions differs.
 */
/* Scores of the four keys at `keys` against NV vectors of the tile's lanes from vector v0 on
 * (st_row: the first key's row of the scores at those lanes); only the first nk are stored. */
static inline __attribute__((always_inline)) void tile_scores(
    const int NV, const uint32_t *qt, int64_t width, int64_t v0, const uint32_t *keys,
    int64_t pairs, int64_t nk, __m512 scales, float *st_row) {
    __m512 acc[4][4];
    for (int k = 0; k < 4; k++)
        for (int v = 0; v < NV; v++) acc[k][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh lanes[4];
        for (int v = 0; v < NV; v++)
            lanes[v] = (__m512bh)_mm512_loadu_si512(qt + p * width + (v0 + v) * 16);
        for (int k = 0; k < 4; k++) {
            const __m512bh key = (__m512bh)_mm512_set1_epi32((int32_t)keys[k * pairs + p]);
            for (int v = 0; v < NV; v++) acc[k][v] = _mm512_dpbf16_ps(acc[k][v], lanes[v], key);
        }
    }
    for (int k = 0; k < nk; k++)
        for (int v = 0; v < NV; v++)
            _mm512_storeu_ps(st_row + k * width + v * 16, _mm512_mul_ps(acc[k][v], scales));
}

/* out[l] for the 4 lanes l0 .. l0+3 (p: key 0's probabilities at lane l0, a key's `width`
 * apart), 64 dimensions from `base` on: sum over keys < reach of p * v in order of the keys,
 * the 16 sums in registers. Lanes past the tile's rows have probabilities 0. */
static inline __attribute__((always_inline)) void tile_values(const float *vf, int64_t hd,
                                                              const float *p, int64_t width,
                                                              int64_t reach, int64_t base,
                                                              __m512 acc[4][4]) {
    for (int l = 0; l < 4; l++)
        for (int c = 0; c < 4; c++) acc[l][c] = _mm512_setzero_ps();
    for (int64_t key = 0; key < reach; key++) {
        const float *row = vf + key * hd + base;
        __m512 r[4];
        for (int c = 0; c < 4; c++) { /* loaded once (the compiler would load it per lane) */
            r[c] = _mm512_loadu_ps(row + 16 * c);
            __asm__("" : "+v"(r[c]));
        }
        for (int l = 0; l < 4; l++) {
            const __m512 w = _mm512_set1_ps(p[key * width + l]);
            for (int c = 0; c < 4; c++) acc[l][c] = _mm512_fmadd_ps(w, r[c], acc[l][c]);
        }
    }
}

static void tile_task_bf16(const uint16_t *q, int64_t q_row_stride, uint16_t *out,
                           int64_t out_row_stride, const uint16_t *k_head, const uint16_t *v_head,
                           const int64_t *table, const int64_t *lengths, int64_t rows,
                           int64_t group, int64_t hd, int64_t block_size, float scale,
                           float *work) {
    const int64_t longest = lengths[rows - 1], pairs = hd / 2;
    const int64_t nq = rows * group, vectors = (nq + 15) / 16, width = vectors * 16;
    uint32_t *qt = (uint32_t *)work;           /* [pairs][width] */
    float *st = (float *)(qt + pairs * width); /* [longest][width] scores, then probabilities */
    float *vf = st + longest * width;          /* [longest][hd] */
    float *inverse = vf + longest * hd;        /* [width] */

    /* query rows across lanes: lane l is row l / group, head l % group */
    for (int64_t l = 0; l < width; l++) {
        const uint32_t *src =
            l < nq ? (const uint32_t *)(q + (l / group) * q_row_stride + (l % group) * hd) : NULL;
        for (int64_t p = 0; p < pairs; p++) qt[p * width + l] = src ? src[p] : 0;
    }
    const __m512 scales = _mm512_set1_ps(scale);
    const int64_t num_used = (longest + block_size - 1) / block_size;
    for (int64_t b = 0; b < num_used; b++) {
        const int64_t first = b * block_size;
        const int64_t n = longest - first < block_size ? longest - first : block_size;
        const uint32_t *keys = (const uint32_t *)(k_head + table[b] * block_size * hd);
        const uint16_t *values = v_head + table[b] * block_size * hd;
        for (int64_t j = 0; j < n; j++)
            for (int64_t c = 0; c < hd; c += 16)
                _mm512_storeu_ps(vf + (first + j) * hd + c,
                                 _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(
                                     (const __m256i *)(values + j * hd + c))));
        for (int64_t v0 = 0; v0 < vectors; v0 += 4) {
            const int64_t nv = vectors - v0 < 4 ? vectors - v0 : 4;
            for (int64_t j = 0; j < n; j += 4) {
                const int64_t nk = n - j < 4 ? n - j : 4;
                const uint32_t *four = keys + j * pairs;
                uint32_t last[4 * 64]; /* the block's last keys, padded with zeros to four */
                if (nk < 4) {
                    memset(last, 0, sizeof last);
                    memcpy(last, four, sizeof(uint32_t) * (size_t)(nk * pairs));
                    four = last;
                }
                float *row = st + (first + j) * width + v0 * 16;
                switch (nv) { /* each count its own code: the sums in registers */
                case 4: tile_scores(4, qt, width, v0, four, pairs, nk, scales, row); break;
                case 3: tile_scores(3, qt, width, v0, four, pairs, nk, scales, row); break;
                case 2: tile_scores(2, qt, width, v0, four, pairs, nk, scales, row); break;
                default: tile_scores(1, qt, width, v0, four, pairs, nk, scales, row); break;
                }
            }
        }
    }
    /* softmax down each lane over that row's own length; the sums are kept for the end */
    for (int64_t v = 0; v < vectors; v++) {
        int32_t limit[16];
        for (int l = 0; l < 16; l++) {
            const int64_t lane = v * 16 + l;
            limit[l] = lane < nq ? (int32_t)lengths[lane / group] : 0;
        }
        const __m512i limits = _mm512_loadu_si512(limit);
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int64_t key = 0; key < longest; key++) {
            const __mmask16 seen = _mm512_cmpgt_epi32_mask(limits, _mm512_set1_epi32((int)key));
            top = _mm512_mask_max_ps(top, seen, top, _mm512_loadu_ps(st + key * width + v * 16));
        }
        top = _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(limits, _mm512_setzero_si512()),
                                   _mm512_setzero_ps(), top);
        __m512 total = _mm512_setzero_ps();
        for (int64_t key = 0; key < longest; key++) {
            const __mmask16 seen = _mm512_cmpgt_epi32_mask(limits, _mm512_set1_epi32((int)key));
            float *s = st + key * width + v * 16;
            const __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(_mm512_loadu_ps(s), top)));
            _mm512_storeu_ps(s, e);
            total = _mm512_add_ps(total, e);
        }
        _mm512_storeu_ps(inverse + v * 16,
                         _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_max_ps(total, _mm512_set1_ps(1e-30f))));
    }
    /* values, four query rows at a time, 64 dimensions a pass, the sums in registers */
    for (int64_t l0 = 0; l0 < nq; l0 += 4) {
        const int64_t nl = nq - l0 < 4 ? nq - l0 : 4;
        int64_t reach = 0;
        for (int64_t l = l0; l < l0 + nl; l++)
            reach = lengths[l / group] > reach ? lengths[l / group] : reach;
        for (int64_t base = 0; base < hd; base += 64) {
            __m512 acc[4][4];
            tile_values(vf, hd, st + l0, width, reach, base, acc);
            for (int64_t l = 0; l < nl; l++) {
                const int64_t lane = l0 + l;
                uint16_t *o = out + (lane / group) * out_row_stride + (lane % group) * hd + base;
                const __m512 norm = _mm512_set1_ps(inverse[lane]);
                for (int c = 0; c < 4; c++)
                    _mm256_storeu_si256((__m256i *)(o + 16 * c),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[l][c], norm)));
            }
        }
    }
}

static int64_t bf16_dot_tile_floats(int64_t rows, int64_t group, int64_t hd, int64_t longest,
                                    int64_t window) {
    (void)window; /* the dot-product tiles run layers without a window only */
    const int64_t width = (rows * group + 15) / 16 * 16;
    return group * longest + hd / 2 * width + longest * width + longest * hd + width;
}

static void bf16_dot_tile(const uint16_t *q, int64_t q_row_stride, uint16_t *out,
                          int64_t out_row_stride, const uint16_t *k_head, const uint16_t *v_head,
                          const int64_t *table, const int64_t *lengths, int64_t rows,
                          int64_t group, int64_t hd, int64_t block_size, float scale,
                          int64_t window, float softcap, float *work) {
    (void)window;
    (void)softcap;
    if (rows > 1)
        tile_task_bf16(q, q_row_stride, out, out_row_stride, k_head, v_head, table, lengths, rows,
                       group, hd, block_size, scale, work);
    else if (hd == 64)
        task_bf16_64(q, out, k_head, v_head, table, lengths[0], group, block_size, scale, work);
    else
        task_bf16_128(q, out, k_head, v_head, table, lengths[0], group, block_size, scale, work);
}
#endif

/* The entry points: rows cut into tiles (runs of one prefill chunk's rows: same table, lengths
 * growing by one), then (tile, KV head) tasks, longest tiles first. */
#define DEFINE_ENTRY(NAME, T, TILE, TILE_FLOATS)                                                    \
    static int NAME(const T *q, int64_t q_row_stride, const T *kv, const int64_t *block_tables,   \
                    int64_t table_width, const int64_t *row_tables, const int64_t *lengths,       \
                    T *out, int64_t out_row_stride, int64_t num_seqs, int64_t num_heads,          \
                    int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,                   \
                    int64_t block_size, float scale, int64_t window, float softcap,               \
                    int num_threads) {                                                            \
        const int64_t group = num_heads / num_kv_heads;                                           \
        if (group > MAX_GROUP || (head_dim != 64 && head_dim != 128)) return -1;                  \
        if (window < 0 || !(softcap >= 0.f)) return -1;                                           \
        const int64_t head_stride = num_blocks * block_size * head_dim;                           \
        const T *k_base = kv, *v_base = kv + num_kv_heads * head_stride;                          \
        int64_t *tiles = (int64_t *)malloc(sizeof(int64_t) * (num_seqs + 1));                     \
        if (!tiles) return -2;                                                                    \
        const int64_t num_tiles = cut_tiles(row_tables, lengths, num_seqs, TILE_ROWS, tiles);     \
        int failed = 0;                                                                           \
        _Pragma("omp parallel num_threads(num_threads)") {                                        \
            float *work = NULL;                                                                   \
            int64_t capacity = 0;                                                                 \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t task = 0;                        \
                                                         task < num_tiles * num_kv_heads;         \
                                                         task++) {                                \
                const int64_t tile = num_tiles - 1 - task / num_kv_heads, h = task % num_kv_heads; \
                const int64_t first = tiles[tile], rows = tiles[tile + 1] - first;                \
                const int64_t need =                                                              \
                    TILE_FLOATS(rows, group, head_dim, lengths[first + rows - 1], window);        \
                if (need > capacity) {                                                            \
                    free(work);                                                                   \
                    capacity = need * 2;                                                          \
                    work = (float *)malloc(sizeof(float) * capacity);                             \
                    if (!work) {                                                                  \
                        capacity = 0;                                                             \
                        _Pragma("omp atomic write") failed = 1;                                   \
                        continue;                                                                 \
                    }                                                                             \
                }                                                                                 \
                const int64_t *table =                                                            \
                    block_tables + (row_tables ? row_tables[first] : first) * table_width;        \
                TILE(q + first * q_row_stride + h * group * head_dim, q_row_stride,               \
                     out + first * out_row_stride + h * group * head_dim, out_row_stride,         \
                     k_base + h * head_stride, v_base + h * head_stride, table, lengths + first,  \
                     rows, group, head_dim, block_size, scale, window, softcap, work);            \
            }                                                                                     \
            free(work);                                                                           \
        }                                                                                         \
        free(tiles);                                                                              \
        return failed ? -2 : 0;                                                                   \
    }

DEFINE_ENTRY(attend_f32, float, float_tile_f32, float_tile_floats)
DEFINE_ENTRY(attend_bf16_float, uint16_t, float_tile_bf16, float_tile_floats)
#if HAVE_BF16_DOT
DEFINE_ENTRY(attend_bf16_dot, uint16_t, bf16_dot_tile, bf16_dot_tile_floats)
#endif

#define KVSERVE_ATTENTION_ARGS(T)                                                                   \
    const T *q, int64_t q_row_stride, const T *kv, const int64_t *block_tables,                   \
        int64_t table_width, const int64_t *row_tables, const int64_t *lengths, T *out,           \
        int64_t out_row_stride, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,        \
        int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale
#define KVSERVE_ATTENTION_PASS                                                                      \
    q, q_row_stride, kv, block_tables, table_width, row_tables, lengths, out, out_row_stride,     \
        num_seqs, num_heads, num_kv_heads, head_dim, num_blocks, block_size, scale

int kvserve_paged_attention_f32(KVSERVE_ATTENTION_ARGS(float), int64_t window, float softcap,
                                int num_threads) {
    return attend_f32(KVSERVE_ATTENTION_PASS, window, softcap, num_threads);
}

int kvserve_paged_attention_bf16(KVSERVE_ATTENTION_ARGS(uint16_t), int64_t window, float softcap,
                                 int num_threads) {
#if HAVE_BF16_DOT
    if (window == 0 && softcap == 0.f)
        return attend_bf16_dot(KVSERVE_ATTENTION_PASS, 0, 0.f, num_threads);
#endif
    return attend_bf16_float(KVSERVE_ATTENTION_PASS, window, softcap, num_threads);
}

int kvserve_paged_decode_f32(KVSERVE_ATTENTION_ARGS(float), int num_threads) {
    return attend_f32(KVSERVE_ATTENTION_PASS, 0, 0.f, num_threads);
}

int kvserve_paged_decode_bf16(KVSERVE_ATTENTION_ARGS(uint16_t), int num_threads) {
    return kvserve_paged_attention_bf16(KVSERVE_ATTENTION_PASS, 0, 0.f, num_threads);
}
